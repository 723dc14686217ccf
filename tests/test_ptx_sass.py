"""flashlab.ptx's machine-code view, without a GPU: ptxas assembles a
kernel's PTX and nvdisasm prints it; `spill_sites` finds every local
load and store there, exactly when ptxas reports spilled bytes. The
kernels compile in a fresh process without NUMBA_ENABLE_CUDASIM, as in
tests/test_gpu_ptx.py."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json
from flashlab import ptx
from flashlab.gpu import build, forward_v7, forward_v8, registry

hopper = (9, 0, "a")
out = {}
# row_dot16 needs 68 registers: capped at 24 ptxas spills
text = build.compile_ptx("row_dot_bf16", 0, 0, hopper)
for cap in (24, None):
    code = ptx.sass(text, hopper, cap)
    out[f"row_dot {cap}"] = dict(
        spill=ptx.assemble(text, hopper, cap)["spill"],
        sites=ptx.spill_sites(code),
        ops=sorted({op.split(".")[0] for _, op in ptx.instructions(code)}))
# the three-warpgroup forward at its register cap
spec = registry.get("forward_v8_bf16")
text = forward_v8.compile_ptx(64, 64)
code = ptx.sass(text, forward_v7.CC, spec.registers(64, 64))
out["forward_v8 64"] = dict(
    spill=ptx.assemble(text, forward_v7.CC, spec.registers(64, 64))["spill"],
    sites=ptx.spill_sites(code),
    ops=sorted({op.split(".")[0] for _, op in ptx.instructions(code)}))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def found():
    env = {k: v for k, v in os.environ.items()
           if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env,
                          capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_spill_sites_are_the_local_accesses_ptxas_reports(found):
    # capped, ptxas spills and the machine code holds local stores and
    # loads, each found once and in order; uncapped, neither
    capped, free = found["row_dot 24"], found["row_dot None"]
    assert capped["spill"] > 0 and free["spill"] == 0
    kinds = {op.split(".")[0] for _, op, _ in capped["sites"]}
    assert kinds == {"STL", "LDL"}, capped["sites"]
    addresses = [a for a, _, _ in capped["sites"]]
    assert addresses == sorted(set(addresses))
    # row_dot16's 16-byte global loads are landmarks beside its spills
    assert any("LDG" in " ".join(near) for _, _, near in capped["sites"])
    assert free["sites"] == []
    assert "LDG" in free["ops"] and "STL" not in free["ops"]


def test_forward_v8_machine_code_has_no_local_access(found):
    # the three-warpgroup forward at its register cap: ptxas reports no
    # spill, and no STL or LDL is among its instructions, which were read
    v8 = found["forward_v8 64"]
    assert v8["spill"] == 0 and v8["sites"] == []
    assert "HGMMA" in v8["ops"] and "SYNCS" in v8["ops"]

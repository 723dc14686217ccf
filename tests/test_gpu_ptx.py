"""Every CUDA kernel compiles for Hopper (cc 9.0) without float64 and
within the static shared-memory limit.

The simulator accepts things real hardware rejects and never shows the
PTX, so the kernels are also compiled for real here, in a subprocess
without NUMBA_ENABLE_CUDASIM (numba reads that flag once per process).
"""

import json
import os
import subprocess
import sys

import pytest

SHARED_LIMIT = 48 * 1024  # static shared memory per block
HEAD_DIMS = [(16, 16), (64, 64), (128, 128)]

SCRIPT = r"""
import json, re, sys
from flashlab import gpu
report = {}
for name in gpu.kernel_names():
    for d, dv in json.loads(sys.argv[1]):
        ptx = gpu.compile_ptx(name, d, dv)
        body = [line for line in ptx.splitlines()
                if not line.lstrip().startswith("//")]
        report[f"{name} {d} {dv}"] = {
            "f64": sum(bool(re.search(r"\.f64\b", line)) for line in body),
            "shared": sum(int(n) for n in re.findall(
                r"\.shared \.align \d+ \.b8 \S+\[(\d+)\]", ptx)),
            "exp": len(re.findall(r"ex2\.approx", ptx)),
        }
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    env = {x: y for x, y in os.environ.items()
           if x != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(HEAD_DIMS)], env=env,
        capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_kernel_was_compiled(report):
    from flashlab import gpu

    assert len(report) == len(gpu.kernel_names()) * len(HEAD_DIMS)


def test_no_float64_in_any_kernel(report):
    bad = {k: r["f64"] for k, r in report.items() if r["f64"]}
    assert not bad, f"float64 instructions in {bad}"


def test_shared_memory_fits(report):
    bad = {k: r["shared"] for k, r in report.items()
           if r["shared"] > SHARED_LIMIT}
    assert not bad, f"over {SHARED_LIMIT} bytes of shared memory: {bad}"


def test_forward_kernels_use_fast_float32_exp(report):
    # math.exp on float32 lowers to ex2.approx.f32; a float64 exp would not
    for key, r in report.items():
        if key.startswith("forward"):
            assert r["exp"] > 0, key

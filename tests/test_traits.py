"""flashlab.gpu.traits against the kernels themselves: each module's
shape(), the constants its make() closes over, its parameter names, the
registry's records and the shared memory of its compiled PTX."""

import inspect
import itertools
import json
import os
import subprocess
import sys

import pytest

from flashlab.gpu import registry, traits

# a constant make() computes -> the Traits field that states it; BK and
# BQ (the blocked backward) depend on which side the block owns
ROLES = {"BR": "br", "BC": "bc", "NT": "br", "CH": "bc", "KD": "k_steps",
         "NS": "n_tiles", "NO": "o_tiles", "NQ": "o_tiles",
         "NK": "o_tiles"}


def head_dims(spec):
    """Every (d, d_v) a kernel is built for."""
    return [(d, d_v) for d, d_v in itertools.product(spec.head_dims,
                                                     repeat=2)
            if spec.takes(d, d_v)]


def closed_over(spec, d, d_v):
    """The constants make(d, d_v) computed for its kernel (and for the
    device function holding its body, where the kernel is a thin shell
    around one: forward_v8's `run`)."""
    built = spec.make(d, d_v)
    found = dict(inspect.getclosurevars(
        getattr(built, "py_func", built)).nonlocals)
    inner = found.get("run")
    if inner is not None:
        found.update(inspect.getclosurevars(inner.py_func).nonlocals)
    return found


KERNELS = [k for k in registry.KERNELS if not k.helper]


@pytest.mark.parametrize("spec", KERNELS, ids=lambda k: k.name)
def test_traits_are_what_each_kernel_builds_and_launches(spec):
    module = traits.module_of(spec)
    for d, d_v in head_dims(spec):
        tr = traits.traits(spec.name, d, d_v)
        compared = 0
        if hasattr(module, "shape"):  # the forwards: what a launch uses
            assert module.shape(d, d_v) == (tr.br, tr.bc, tr.threads), (
                d, d_v)
            compared += 1
        keys = "dk" in tr.returns
        roles = dict(ROLES, BK="br" if keys else "bc",
                     BQ="bc" if keys else "br")
        for local, value in closed_over(spec, d, d_v).items():
            if local in roles:
                assert value == getattr(tr, roles[local]), (local, d, d_v)
                compared += 1
        assert compared, f"{spec.name}: nothing of it was compared"
        assert tr.warps * 32 == tr.threads
        assert (tr.k_steps > 0) == (tr.n_tiles > 0) == (spec.min_cc
                                                        >= registry.MMA_CC)


@pytest.mark.parametrize("spec", registry.KERNELS, ids=lambda k: k.name)
def test_traits_agree_with_the_registry(spec):
    dims = head_dims(spec) if not spec.helper else [(0, 0)]
    threads = {traits.traits(spec.name, *hd).threads for hd in dims}
    # a record states threads where they do not depend on the head dims
    assert spec.threads == (threads.pop() if len(threads) == 1 else None)
    built = spec.make(*dims[-1])
    params = list(inspect.signature(
        getattr(built, "py_func", built)).parameters)
    for d, d_v in dims:
        tr = traits.traits(spec.name, d, d_v)
        assert tr.max_registers == spec.registers(d, d_v)
        assert tr.dynamic_shared == (spec.shared(d, d_v) if spec.shared
                                     else 0)
        # what it writes are parameters of the kernel, in that order
        at = [params.index(p) for p in tr.returns]
        assert at == sorted(at), (tr.returns, params)


@pytest.mark.parametrize("spec", [k for k in KERNELS if k.shared],
                         ids=lambda k: k.name)
def test_dynamic_shared_memory_holds_the_tiles_make_lays_out(spec):
    # Q_i and two stages each of K_j and V_j, as the
    # kernel's make() sizes them; the PTX declares none of it
    # (the backward's: its own rows' tiles and two stages of the other
    # side's)
    for d, d_v in head_dims(spec):
        tiles = closed_over(spec, d, d_v)
        if "OWN_S" in tiles:
            need = traits.B16 * (tiles["OWN_S"] + 2 * tiles["STAGE_S"])
        elif "STAGE_B" in tiles:  # backward_v8: K_j, V_j and NSTAGES
            # of Q_i, dO_i
            need = tiles["K_B"] + tiles["V_B"] + tiles["NSTAGES"] * \
                tiles["STAGE_B"]
        elif "Q_B" in tiles:  # v8 counts bytes (16-bit or e4m3 values)
            need = tiles["Q_B"] + 2 * tiles["K_B"] + 2 * tiles["V_B"]
            if not tiles["IN_Q"]:  # O_i's staging, past V_j's stages
                need += tiles["STAGED"] * tiles["BR"] // 16
        else:
            need = traits.B16 * (tiles["Q_S"] + 2 * tiles["K_S"]
                                 + 2 * tiles["V_S"])
        tr = traits.traits(spec.name, d, d_v)
        if {"dk", "dq"} <= set(tr.returns):  # fused: and a dS^T tile
            need += traits.B16 * tiles["BK"] * tiles["BQ"]
        if "DQ_AT" in tiles and "dq" in tr.returns:  # backward_v8 fused:
            # a second dS^T, and two float32 dQ tiles
            need += traits.B16 * tiles["BK"] * tiles["BQ"] \
                + 2 * traits.F32 * tiles["BQ"] * d
        # and at most 2 KiB more: room to align the tiles to 1024 bytes,
        # and v8's mbarriers
        assert need <= tr.dynamic_shared <= need + 2048, (d, d_v)


def test_unknown_kernels_and_head_dims_are_refused():
    with pytest.raises(ValueError, match="d, d_v: forward_v5_bf16 is "
                                         r"built for head dims \(64, 128"):
        traits.traits("forward_v5_bf16", 32, 32)
    with pytest.raises(ValueError, match="d, d_v: backward_kv_blocked .*"
                                         "at most 64"):
        traits.traits("backward_kv_blocked", 128, 64)
    with pytest.raises(ValueError, match="name: expected one of"):
        traits.traits("forward_v9", 64, 64)
    with pytest.raises(ValueError, match="version: expected one of"):
        traits.forward(True, 64, 64)
    assert traits.forward(3, 64, 64).tile == (64, 32)
    assert traits.forward(3, 128, 32).tile == (32, 16)


# (d, d_v) where the tiles of the float32 kernels change (at most 64, or
# not) and d and d_v differ, so a swapped pair would show
PTX_DIMS = ((16, 32), (64, 128), (128, 64))
COMPILE = """
import json, sys
from flashlab import ptx
from flashlab.gpu import build
out = {}
for name, d, d_v in json.loads(sys.argv[1]):
    code = build.compile_ptx(name, d, d_v, (9, 0, "a"))
    out[f"{name} {d} {d_v}"] = ptx.shared_bytes(code)
print(json.dumps(out))
"""


def test_shared_memory_is_what_the_compiled_kernel_declares():
    # one kernel per factory (the dtypes and precisions of one version
    # share its make()), each helper with shared memory, compiled for
    # the H200 in a fresh process: the simulator cannot compile
    seen, cases = set(), []
    for spec in registry.KERNELS:
        made = traits.factory(spec)
        if made in seen:
            continue
        seen.add(made)
        dims = [(0, 0)] if spec.helper else [
            hd for hd in PTX_DIMS if spec.takes(*hd)]
        cases += [(spec.name, d, d_v) for d, d_v in dims]
    env = {k: v for k, v in os.environ.items()
           if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(cases)], env=env,
        capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    declared = json.loads(done.stdout)
    assert len(declared) == len(cases) > 20
    for name, d, d_v in cases:
        tr = traits.traits(name, d, d_v)
        assert declared[f"{name} {d} {d_v}"] == tr.shared, (name, d, d_v)

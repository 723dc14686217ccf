"""Every CUDA kernel compiles for Hopper (cc 9.0) without float64 and
within the static shared-memory limit.

The simulator accepts things real hardware rejects and never shows the
PTX, so the kernels are also compiled for real here, in a fresh process
without NUMBA_ENABLE_CUDASIM (numba reads that flag once per process).
"""

import pytest

from flashlab import gpu, ptx
from flashlab.gpu import backward_v5, forward_v7, forward_v8, registry, warp

SHARED_LIMIT = 48 * 1024  # static shared memory per block


@pytest.fixture(scope="module")
def report():
    return ptx.run_report()


def test_every_kernel_was_compiled(report):
    kernels = {k for k in report if not k.startswith("demo")}
    assert kernels == {f"{name} {d} {dv}" for name in gpu.kernel_names()
                       for d, dv in ptx.HEAD_DIMS
                       if gpu.supports(name, d, dv)}


def test_no_float64_in_any_kernel(report):
    bad = {k: r["f64"] for k, r in report.items()
           if r["f64"] and not k.startswith("demo")}
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


def test_bandwidth_kernels_load_16_bytes_into_registers():
    # row_dot16, prepare16 and find_bad_parts (helpers: not in the report)
    # read with ld.global.nc.v4 and keep what they loaded in registers: no
    # local arrays, and no spill where ptxas is installed, at the register
    # cap the registry gives them (row_dot16's: warp.DOT_BLOCKS_PER_SM
    # blocks of warp.THREADS fill an SM's 65536 registers; prepare16's:
    # warp.PREPARE_BLOCKS_PER_SM fit, and no more would)
    import json
    import os
    import subprocess
    import sys

    names = ("row_dot_bf16", "row_dot_f16", "prepare_bf16", "prepare_f16",
             "find_bad_parts32", "find_bad_parts16", "find_bad_parts8")
    code = ("import json; from flashlab import ptx; "
            "from flashlab.gpu import build, registry; out = {}\n"
            f"for name in {names!r}:\n"
            "    text = build.compile_ptx(name, 0, 0, ptx.HOPPER)\n"
            "    cap = registry.get(name).registers(0, 0)\n"
            "    out[name] = [ptx.wide_loads(text), ptx.local_bytes(text),"
            " ptx.assemble(text, ptx.HOPPER, cap)['spill'] if ptx.ptxas() "
            "else 0, text.count('div.s64') + text.count('rem.s64')]\n"
            "print(json.dumps(out))")
    env = {k: v for k, v in os.environ.items()
           if k != "NUMBA_ENABLE_CUDASIM"}
    found = json.loads(subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True,
        text=True, check=True).stdout)
    for name, (wide, local, spill, _) in found.items():
        assert wide > 0 and local == 0 and not spill, (name, found)
    # int64 division is a routine of many instructions: the row kernels
    # keep it out of their loops (their places had doubled row_dot16's
    # time), what is left being each lane's place once and prepare16's
    # rare exact rows
    for name in names[:4]:
        assert found[name][3] <= 6, (name, found[name])
    for kind in ("bf16", "f16"):
        cap = registry.get(f"row_dot_{kind}").registers(0, 0)
        assert cap * warp.THREADS * warp.DOT_BLOCKS_PER_SM == 65536
        cap = registry.get(f"prepare_{kind}").registers(0, 0)
        blocks = warp.PREPARE_BLOCKS_PER_SM
        assert cap * warp.THREADS * blocks <= 65536
        assert cap * warp.THREADS * (blocks + 1) > 65536


def test_counting_wide_loads():
    text = ("ld.global.nc.v4.u32 {%r1,%r2,%r3,%r4}, [%rd1];\n"
            "ld.global.v4.f32 {%f1,%f2,%f3,%f4}, [%rd2];\n"
            "ld.global.nc.u32 %r5, [%rd3];\nld.shared.v4.u32 {}, [%r6];")
    assert ptx.wide_loads(text) == 2


def test_tensor_core_kernels_use_mma_in_registers(report):
    # v5 and v6 multiply on the tensor cores, and their fragment arrays
    # stay in registers: no local memory in the PTX (ptxas spills are
    # measured on the GPU, test_gpu_tensor_cores)
    tensor = {k: r for k, r in report.items()
              if k.startswith(("forward_v5", "forward_v6", "backward_v5"))}
    # forward: bf16, f16, 3xtf32, tf32; backward: dq and dkv in bf16 and
    # f16; each at d = 64 and 128
    assert len(tensor) == (4 + 4) * 2
    for key, r in tensor.items():
        assert r["mma"] > 0 and r["local"] == 0, (key, r)
    # every product of a backward tile on the tensor cores: dQ's three
    # (S, dP, dS K) and dK/dV's four (S^T, dP^T, P^T dO, dS^T Q), unrolled
    # over the k-steps and n-tiles of a 64 x 64 tile at d = 64, whose
    # column slices (backward_v5.parts) run as a loop of one body each
    for kernel, products in (("dq", 3), ("dkv", 4)):
        slices = backward_v5.parts(kernel, 64, 64)
        mma = report[f"backward_v5_{kernel}_bf16 64 64"]["mma"]
        assert mma == products * 32 // slices, (kernel, mma)
    scalar = {k: r for k, r in report.items()
              if k.startswith("forward_v3")}
    assert all(r["mma"] == 0 for r in scalar.values())


def test_hot_kernels_do_not_spill(report):
    # ptxas, the driver's assembler, run on the same PTX: the tensor-core
    # kernels and chapter 9's register-capped ones (v3, v4, the blocked
    # backward) keep everything in registers, no stack, no spill
    assert ptx.ptxas() is not None, "requirements.txt installs ptxas"
    hot = ("forward_v3", "forward_v4", "forward_v5", "forward_v6",
           "backward_v5", "backward_v7", "backward_q_blocked",
           "backward_kv_blocked")
    spilled = {k: (r["regs"], r["stack"], r["spill"])
               for k, r in report.items() if k.startswith(hot)
               and (r["stack"] or r["spill"] or r["regs"] > 255)}
    assert not spilled, f"(registers, stack, spill bytes): {spilled}"
    # and the numbers are read, not defaulted: v2 at d = 128 does spill
    assert report["forward_v2 128 128"]["spill"] > 0


def test_backward_v7_is_wgmma_kept_asynchronous(report):
    # every product of a tile pair is one wgmma asm statement of its
    # k-steps: dQ's S and dP over d and d_v, dS K over the 64 streamed
    # keys; dK/dV's S^T and dP^T, then P^T dO and dS^T Q over the 64
    # streamed queries; the fused kernel's, and dS K over its keys
    # (dq_split). No mma.sync is left, and ptxas keeps the wgmmas
    # asynchronous (the whole-program assembly of launch.assemble)
    from flashlab.gpu import backward_v7

    keys = [k for k in report if k.startswith("backward_v7")]
    assert len(keys) == 3 * 2 * 2  # dq, dkv, fused; bf16, f16; d 64, 128
    streamed = backward_v7.STREAMED // 16
    for key in keys:
        r = report[key]
        d, d_v = map(int, key.split()[1:])
        part = key.split("_")[2]
        extra = {"dq": 1, "dkv": 2, "fused": 2}[part]
        dq = backward_v7.dq_split(d)[0] if part == "fused" else 0
        assert r["wgmma"] == d // 16 + d_v // 16 + extra * streamed + dq, (
            key, r)
        assert r["mma"] == 0 and r["local"] == 0 and r["f64"] == 0, key
        assert not r["serialized"], key


def test_the_check_can_see_float64(report):
    # the demo with a Python float literal must be caught, or the
    # zero counts above would prove nothing
    assert report["demo literal 0.0"]["f64"] > 0
    assert report["demo float32(0.0)"]["f64"] == 0


def test_counters_on_known_text():
    text = ("\tadd.f64 \t%fd1, %fd2, %fd3;\n// add.f64 in a comment\n"
            ".shared .align 4 .b8 _smem[4096];\n"
            "\tex2.approx.ftz.f32 %f1, %f2;\n"
            ".local .align 16 .b8 __local_depot0[128];\n"
            "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {};")
    assert ptx.float64_ops(text) == 1
    assert ptx.shared_bytes(text) == 4096
    assert ptx.fast_exps(text) == 1
    assert ptx.local_bytes(text) == 128
    assert ptx.tensor_ops(text) == 1


# forward_v7 and v8 (wgmma) are built for sm_90a only, so `report` does
# not compile them: they are compiled here, in a fresh process as well,
# and assembled by ptxas for sm_90a (v8 with its register cap)
V7_CASES = tuple((version, *case) for version in (7, 8) for case in (
    ("bf16", 64, 64), ("bf16", 128, 128), ("bf16", 64, 128),
    ("f16", 64, 64), ("f16", 128, 128))) + ((8, "e4m3", 128, 128),)
V7_SCRIPT = """
import json, sys
from flashlab import ptx
from flashlab.gpu import forward_v7, forward_v8, launch, registry
out = {}
for version, kind, d, dv in json.loads(sys.argv[1]):
    module = forward_v7 if version == 7 else forward_v8
    spec = registry.get(f"forward_v{version}_{kind}")
    text = module.compile_ptx(d, dv, kind)
    sig = registry.argument_types(spec.args)
    plain = text.replace(".target sm_90a", ".target sm_90")
    try:
        ptx.assemble(plain, (9, 0), spec.registers(d, dv))
        sm90 = True
    except RuntimeError:
        sm90 = False
    from cuda.core import Linker, LinkerOptions, ObjectCode
    linker = Linker(ObjectCode.from_ptx(text.encode()),
                    options=LinkerOptions(arch="sm_90a", verbose=True,
                                          max_register_count=
                                          spec.registers(d, dv)))
    linker.link("cubin")
    out[f"v{version} {kind} {d} {dv}"] = dict(
        relocatable_serialized="serialized" in linker.get_info_log(),
        wgmma=text.count("wgmma.mma_async"), mma=ptx.tensor_ops(text),
        wait1=text.count("wgmma.wait_group.sync.aligned 1;"),
        tma=text.count("cp.async.bulk.tensor"),
        wide_stores=text.count("st.global.v4.b32"),
        e4m3_packs=text.count("cvt.rn.satfinite.e4m3x2.f32"),
        poly=text.count("max.ftz.NaN.f32"),
        copies=text.count("cp.async.cg"), bars=text.count("bar.sync"),
        block_bars=text.count("bar.sync \\t0;"),
        turns=text.count("bar.arrive"),
        setmaxnreg=text.count("setmaxnreg"),
        f64=ptx.float64_ops(text), local=ptx.local_bytes(text),
        shared=ptx.shared_bytes(text), exp=ptx.fast_exps(text),
        abi=launch.code_kinds(launch.param_codes(sig))
        == launch.ptx_params(text), sm90=sm90,
        **ptx.assemble(text, forward_v7.CC, spec.registers(d, dv)))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def v7_report():
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", V7_SCRIPT,
                           json.dumps(V7_CASES)], env=env,
                          capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_v7_products_are_wgmma_from_registers_and_shared(v7_report):
    # S = Q K^T is d / 16 k-steps of m64n<Bc>k16 and O += P V Bc / 16 of
    # m64n<d_v>k16 (k32 and / 32 for e4m3), each issued twice in the text
    # (the first tile before the loop, the last P V after it); no
    # mma.sync left, no float64, no local memory; the tiles are dynamic
    # shared memory, none static
    from flashlab.gpu.wgmma import K_STEP

    assert set(v7_report) == {f"v{v} {k} {d} {dv}"
                              for v, k, d, dv in V7_CASES}
    for key, r in v7_report.items():
        d, dv = map(int, key.split()[2:])
        bc, ks = forward_v7.BLOCK_K[d], K_STEP[key.split()[1]]
        assert r["wgmma"] == 2 * (d // ks + bc // ks), (key, r)
        assert r["mma"] == 0 and r["f64"] == 0 and r["local"] == 0, key
        assert r["exp"] > 0 and r["shared"] == 0, (key, r)
        assert r["abi"], f"{key}: launch.Layout and the PTX disagree"
        # Q_i and two stages of K_j, V_j fit a Hopper block (227 KB)
        assert forward_v7.shared_bytes(d, dv) <= 227 * 1024, key


def test_v7_softmax_overlaps_the_products(v7_report):
    # the pipeline waits with one group still in flight (P V runs under
    # the softmax), and ptxas kept every wgmma asynchronous: nothing
    # touches an accumulator or an A fragment before its wait
    for key, r in v7_report.items():
        assert r["wait1"] == 1, (key, r)
        assert not r["serialized"], f"{key}: ptxas serialized the wgmmas"
        # why launch.assemble gives sm_90a kernels to ptxas whole: as
        # relocatable code (nvJitLink's way) every wgmma is waited at once
        assert r["relocatable_serialized"], key


def test_v7_assembles_for_sm90a_only_and_does_not_spill(v7_report):
    # ptxas for sm_90a: everything in registers; plain sm_90 has no wgmma
    for key, r in v7_report.items():
        assert not r["stack"] and not r["spill"] and r["regs"] <= 255, (
            key, r)
        assert not r["sm90"], f"{key}: wgmma assembled for plain sm_90"


def test_v8_stores_o_16_bytes_a_lane(v7_report):
    # forward v8's epilogue (two or three consumer warpgroups) reads O
    # back from shared memory and writes it 16 bytes a lane: d_v / 16
    # stores in the text, unrolled; v7 stores each pair of a C fragment
    # as it is
    for key, r in v7_report.items():
        version, _, d, dv = key.split()
        staged = version == "v8"
        assert r["wide_stores"] == (int(dv) // 16 if staged else 0), (key,
                                                                      r)


def test_v8_e4m3_packs_p_in_registers(v7_report):
    # P rounded to e4m3 four at a time, two cvt a register, twice in the
    # text (before the loop and in it): KP k-steps x 4 registers x 2
    from flashlab.gpu import forward_v8

    r = v7_report["v8 e4m3 128 128"]
    kp = forward_v8.BLOCK_K[128] // 32
    assert r["e4m3_packs"] == 2 * kp * 4 * 2, r
    assert all(x["e4m3_packs"] == 0 for key, x in v7_report.items()
               if "e4m3" not in key)


def test_v8_takes_its_poly_share_of_exponentials_on_the_fma_pipe(
        v7_report):
    # each softmax in the text (two in v8: before the loop and in it)
    # has Bc / 8 groups x 4 terms a lane, two rows; every POLY-th of a
    # row's runs flashlab.exp2's sequence (one max.NaN each), the rest
    # ex2.approx; no other kernel has the sequence
    from flashlab.gpu import forward_v8

    for key, r in v7_report.items():
        version, kind, d, _ = key.split()
        poly = forward_v8.POLY.get((kind, int(d)), 0)
        if version != "v8" or not poly:
            assert r["poly"] == 0, key
            continue
        # a lane's terms of one row: k = 0 .. 2 Bc / 8 - 1
        row = 2 * (forward_v8.BLOCK_K[int(d)] // 8)
        terms = 2 * 2 * row  # two softmaxes, two rows each
        assert r["poly"] == 2 * 2 * (row // poly), (key, r)
        # (and a few ex2 more: each row's alpha)
        assert terms - r["poly"] <= r["exp"] < terms, (key, r)


def test_v8_copies_by_tma_and_moves_registers(v7_report):
    # v7 copies with cp.async and meets at a block barrier per tile; v8's
    # producer issues TMA boxes (Q, K, V: d / 64 or d_v / 64 each, more in
    # the text where the compiler copies the loop), the only block
    # barrier is the one after the mbarriers' set-up, named barriers
    # appear only where the consumers take turns (PING_PONG), and
    # setmaxnreg moves registers both ways
    for key, r in v7_report.items():
        d, dv = map(int, key.split()[2:])
        if key.startswith("v7"):
            assert r["copies"] > 0 and r["tma"] == 0 and r["bars"] >= 3
            assert r["setmaxnreg"] == 0
        else:
            box = 128 if "e4m3" in key else 64  # columns of a TMA box
            assert r["tma"] >= d // box + d // box + dv // box, (key, r)
            assert r["copies"] == 0 and r["block_bars"] == 1, (key, r)
            turns = r["bars"] - r["block_bars"]
            if forward_v8.PING_PONG:
                assert turns >= 2 and r["turns"] == turns + 1, (key, r)
            else:
                assert turns == r["turns"] == 0, (key, r)
            assert r["setmaxnreg"] == 2, (key, r)
            assert r["regs"] <= forward_v8.max_registers(d, dv), (key, r)


TURNS_SCRIPT = """
import json
from flashlab import ptx
from flashlab.gpu import forward_v7, forward_v8, registry
forward_v8.PING_PONG = True
out = {}
for d in forward_v8.HEAD_DIMS:
    text = forward_v8.compile_ptx(d, d)
    out[d] = dict(syncs=text.count("bar.sync"),
                  arrives=text.count("bar.arrive"),
                  cap=forward_v8.max_registers(d, d),
                  **ptx.assemble(text, forward_v7.CC,
                                 forward_v8.max_registers(d, d)))
print(json.dumps(out))
"""


def test_v8_with_turns_builds_without_spills():
    # forward_v8.PING_PONG builds the consumers' turns in (off by
    # default: chapter 12): a named barrier waited on before each tile's
    # products and one arrived at after them, consumer 0's first turn
    # besides, and ptxas still fits the consumers in their registers
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", TURNS_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for d, r in json.loads(done.stdout).items():
        turns = r["syncs"] - 1  # and syncthreads' one
        assert turns >= 2 and r["arrives"] == turns + 1, (d, r)
        assert r["spill"] == 0 and r["regs"] <= r["cap"], (d, r)


BACKWARD_V8_SCRIPT = """
import itertools
import json
from flashlab import ptx
from flashlab.gpu import backward_v7, backward_v8, registry
out = {}
for kind, d in itertools.product(("bf16", "f16"), backward_v8.HEAD_DIMS):
    spec = registry.get(f"backward_v8_dkv_{kind}")
    text = backward_v8.compile_ptx(d, d, kind)
    v7 = backward_v7.compile_ptx("dkv", d, d, kind)
    out[f"{kind} d{d}"] = dict(
        wgmma=text.count("wgmma.mma_async"),
        v7_wgmma=v7.count("wgmma.mma_async"),
        tma=text.count("cp.async.bulk.tensor"),
        copies=text.count("cp.async.cg"), bars=text.count("bar.sync"),
        v7_bars=v7.count("bar.sync"), v7_copies=v7.count("cp.async.cg"),
        setmaxnreg=text.count("setmaxnreg"), local=ptx.local_bytes(text),
        f64=ptx.float64_ops(text),
        **ptx.assemble(text, backward_v8.CC, spec.registers(d, d)))
for kind, d, part in itertools.product(("bf16", "f16"),
                                       backward_v8.FUSED_HEAD_DIMS,
                                       ("fused", "ordered")):
    spec = registry.get(f"{backward_v8.NAMES[part]}_{kind}")
    text = backward_v8.compile_ptx(d, d, kind, part)
    out[f"{kind} {part} d{d}"] = dict(
        turns=(text.count("ld.acquire.gpu"), text.count("red.release.gpu")),
        reads=text.count("cp.async.bulk.wait_group.read"),
        wgmma=text.count("wgmma.mma_async"),
        tma=text.count("cp.async.bulk.tensor"),
        reduce=text.count("cp.reduce.async.bulk.tensor"),
        store=text.count("cp.async.bulk.tensor.3d.global.shared"),
        atomics=text.count("red.global") + text.count("atom.global"),
        copies=text.count("cp.async.cg"), bars=text.count("bar.sync"),
        setmaxnreg=text.count("setmaxnreg"), local=ptx.local_bytes(text),
        f64=ptx.float64_ops(text),
        **ptx.assemble(text, backward_v8.CC, spec.registers(d, d)))
print(json.dumps(out))
"""


def test_backward_v8_copies_by_tma_without_a_block_barrier():
    # backward_v8's dK/dV kernel at d = 64 and 128: v7's four products a
    # tile pair (the same wgmma statements), its copies TMA boxes (K_j,
    # V_j, Q_i, dO_i) where v7 copies with cp.async, and its one block
    # barrier the one after the mbarriers' set-up (v7's is in its loop);
    # setmaxnreg both ways; assembled by ptxas with its register cap,
    # nothing spilled. Its fused kernel at both head dims too, and v9's
    # (the fused kernel taking turns)
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", BACKWARD_V8_SCRIPT],
                          env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for kind, r in json.loads(done.stdout).items():
        assert not r["stack"] and not r["spill"], (kind, r)
        assert not r["serialized"], (kind, r)
        assert r["local"] == 0 and r["f64"] == 0, (kind, r)
        assert r["setmaxnreg"] == 2, (kind, r)
        d = int(kind.split("d")[-1])
        if "fused" in kind or "ordered" in kind:
            # and dQ = dS K (8 k-steps over the block's keys, a
            # warpgroup's d / 2 columns: one product each), added by TMA:
            # the block's tile in d / 32 boxes, no atomics; a named
            # barrier of both consumer warpgroups before the product
            assert r["wgmma"] == 2 * d // 16 + 8 + 8, (kind, r)
            assert r["reduce"] == d // 32 and r["atomics"] == 0, (kind, r)
            assert r["tma"] >= 4 and r["copies"] == 0, (kind, r)
            assert r["bars"] == 2, (kind, r)
            # v9 (ordered): one acquire spin and one release a tile, and
            # the tile's boxes stored instead at its first turn
            ordered = "ordered" in kind
            assert r["turns"] == [ordered] * 2, (kind, r)
            # the staged tile handed back once TMA has read it, in both
            # (ordered, before the additions it waits for)
            assert r["reads"] == 1, (kind, r)
            assert r["store"] == ordered * d // 32, (kind, r)
            continue
        # S^T, dP^T: d / 16 k-steps each; dV, dK: 4 (64 queries)
        assert r["wgmma"] == r["v7_wgmma"] == 2 * d // 16 + 8, (kind, r)
        assert r["tma"] >= 4 and r["copies"] == 0, (kind, r)
        assert r["v7_copies"] > 0 and r["v7_bars"] >= 1, (kind, r)
        assert r["bars"] == 1, (kind, r)

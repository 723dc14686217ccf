"""Hopper's asynchronous copies and barriers for numba.cuda (sm_90a).

TMA (the tensor memory accelerator) copies a box of a tensor from global
to shared memory on its own: one thread issues
`cp.async.bulk.tensor` with a tensor map (the tensor's address, shape,
strides, the box and the swizzle, encoded on the host by
`cuTensorMapEncodeTiled`, see flashlab.gpu.forward_v8) and an mbarrier
in shared memory that counts the bytes as they land. An mbarrier is a
64-bit counter with a phase: `arrive` (and `arrive_expect_tx`, which also
says how many bytes to wait for) completes a phase once all expected
arrivals and bytes are in; `wait(bar, parity)` spins until the phase of
that parity has completed. A producer and its consumers pass tiles back
and forth through two of them per buffer: full (the tile landed) and
empty (every consumer is done with it).

`setmaxnreg` moves registers between warpgroups: the producer gives most
of its own back, the consumers take them. See chapter 12.
"""

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_IR = {types.uint32: _I32, types.int32: _I32, types.uint64: _I64,
       types.float32: ir.FloatType()}
_CODES = {types.uint64: "l", types.float32: "f"}  # else "r"


def _statement(ptx, argtypes, constraints=None):
    """An intrinsic that emits `ptx` (operands $0.. of argtypes, uint32
    or int32 as "r", uint64 as "l", float32 as "f") with side effects and
    a memory clobber, so the compiler keeps it in place."""
    codes = [_CODES.get(t, "r") for t in argtypes]
    constraints = ",".join(codes + ["~{memory}"])

    def codegen(context, builder, signature, args):
        builder.asm(ir.FunctionType(ir.VoidType(),
                                    [_IR[t] for t in argtypes]),
                    ptx, constraints, list(args), True)
        return context.get_dummy_value()

    sig = types.void(*argtypes)
    if len(argtypes) == 0:
        def typer(typingctx):
            return sig, codegen
    elif len(argtypes) == 1:
        def typer(typingctx, a):
            return sig, codegen
    elif len(argtypes) == 2:
        def typer(typingctx, a, b):
            return sig, codegen
    elif len(argtypes) == 3:
        def typer(typingctx, a, b, c):
            return sig, codegen
    elif len(argtypes) == 5:
        def typer(typingctx, a, b, c, d, e):
            return sig, codegen
    else:
        def typer(typingctx, a, b, c, d, e, f):
            return sig, codegen
    return intrinsic(typer)


U32, I32, U64 = types.uint32, types.int32, types.uint64

# mbarrier_init(bar, count): a fresh barrier at shared address bar that a
# phase completes after `count` arrivals (and the bytes expected)
mbarrier_init = _statement("mbarrier.init.shared::cta.b64 [$0], $1;",
                           (U32, U32))
# the barriers' initialization visible to the async proxy (TMA), before
# the block barrier that publishes them
fence_mbarrier_init = _statement("fence.mbarrier_init.release.cluster;", ())
# arrive_expect_tx(bar, bytes): one arrival, and `bytes` more to land
arrive_expect_tx = _statement(
    "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", (U32, U32))
# arrive(bar): one arrival (a consumer is done with a buffer)
arrive = _statement("mbarrier.arrive.shared::cta.b64 _, [$0];", (U32,))
# wait(bar, parity): until the phase of that parity has completed; a
# fresh barrier counts its phase "before 0" (parity 1) as completed, so
# a producer's first wait on an empty buffer passes at once
wait = _statement(
    "{\n\t.reg .pred done;\nWAIT${:uid}:\n\t"
    "mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n\t"
    "@!done bra WAIT${:uid};\n}", (U32, U32))
# load_3d(dst, map, x, y, z, bar): the box at coordinates (x, y, z) of the
# tensor map at global address `map` into shared address dst, counted on
# bar (complete_tx)
load_3d = _statement(
    "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx"
    "::bytes [$0], [$1, {$2, $3, $4}], [$5];",
    (U32, U64, I32, I32, I32, U32))
# reduce_add_3d(map, x, y, z, src): add the float32 box at shared
# address src (laid out as load_3d lays a box) to the box at (x, y, z) of
# the tensor map at `map`, element by element in L2; the parts past the
# tensor's end are left out. It runs on its own: bulk_commit closes a
# group of them, bulk_wait_read waits until every group has read its
# shared memory (which may then be written again), bulk_wait until every
# group's additions are done
reduce_add_3d = _statement(
    "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group"
    " [$0, {$1, $2, $3}], [$4];", (U64, I32, I32, I32, U32))
# store_3d(map, x, y, z, src): reduce_add_3d's box written, not added:
# the same operands and groups, the same parts past the end left out
store_3d = _statement(
    "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group"
    " [$0, {$1, $2, $3}], [$4];", (U64, I32, I32, I32, U32))
bulk_commit = _statement("cp.async.bulk.commit_group;", ())
bulk_wait_read = _statement("cp.async.bulk.wait_group.read 0;", ())
bulk_wait = _statement("cp.async.bulk.wait_group 0;", ())
# wait_count(at, n): spin until the uint32 at global address `at`, read
# with acquire at the GPU's scope, equals n; then order that read before
# this thread's later TMA operations (a proxy fence: they run in the
# async proxy). One turn of an ordered sequence of additions: the
# blocks before this one have made theirs
wait_count = _statement(
    "{\n\t.reg .pred more;\n\t.reg .b32 seen;\nCOUNT${:uid}:\n\t"
    "ld.acquire.gpu.global.u32 seen, [$0];\n\t"
    "setp.ne.u32 more, seen, $1;\n\t"
    "@more bra COUNT${:uid};\n\t"
    "fence.proxy.async.global;\n}", (U64, U32))
# count_up(at): once this thread's bulk groups are complete (bulk_wait),
# their writes ordered before a release at the GPU's scope that adds one
# to the uint32 at global address `at`: the next block's turn
count_up = _statement(
    "fence.proxy.async.global;\n\t"
    "red.release.gpu.global.add.u32 [$0], 1;", (U64,))
# st_shared_f2(dst, x, y): two float32 at shared address dst (8-byte
# aligned), kept in program order (then a proxy fence hands them to TMA)
st_shared_f2 = _statement("st.shared.v2.f32 [$0], {$1, $2};",
                          (U32, types.float32, types.float32))
# registers per thread of the executing warpgroup: fewer (dec) or more
# (inc), a multiple of 8 in 24..256; the kernel's own cap must be fixed
release_registers = {n: _statement(
    f"setmaxnreg.dec.sync.aligned.u32 {n};", ()) for n in (24, 32, 40)}
take_registers = {n: _statement(
    f"setmaxnreg.inc.sync.aligned.u32 {n};", ()) for n in (160, 232, 240)}

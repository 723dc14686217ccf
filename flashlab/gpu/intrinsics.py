"""Tensor-core and async-copy instructions for numba.cuda, as inline PTX.

numba-cuda has no API for mma.sync, ldmatrix or cp.async, but an
`@intrinsic` may emit any PTX through llvmlite's `builder.asm`. Each
function below is one instruction (or two), typed for numba; the PTX ISA
manual ("Warp-level matrix multiply-accumulate instructions") defines the
fragment layouts that the docstrings restate and `flashlab.fragments`
models in numpy, where CI tests them. The CUDA simulator cannot run inline
PTX: kernels built on these run on a GPU, and CI compiles them to PTX.

Notation of the fragment layouts: a warp's lane = 4 g + t, so g = lane
// 4 is the lane's group (0..7) and t = lane % 4 its place in the group.
A 16-bit pair "(r, c..c+1)" is one 32-bit register holding elements
(r, c) in its low half and (r, c + 1) in its high half. See chapter 10.
"""

import numpy as np
from llvmlite import ir
from numba import config, types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic

from flashlab import exp2

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F4 = types.UniTuple(types.float32, 4)
_I4 = types.UniTuple(types.int32, 4)


def _asm(builder, ptx, constraints, result, operands, side_effect=False):
    """Emit one inline-PTX statement; result is an llvm type or None."""
    fty = ir.FunctionType(result or ir.VoidType(),
                          [x.type for x in operands])
    return builder.asm(fty, ptx, constraints, operands, side_effect)


def _tuple(context, builder, signature, value, n):
    """A numba tuple of the n fields of an llvm struct."""
    return context.make_tuple(builder, signature.return_type,
                              [builder.extract_value(value, i)
                               for i in range(n)])


def _mma(shape, kind, a_type):
    """An intrinsic for mma.sync.aligned.<shape>.row.col.f32.<kind>.f32."""
    ptx = (f"mma.sync.aligned.{shape}.row.col.f32.{kind}.{kind}.f32 "
           "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
    constraints = "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4)

    def typer(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = _F4(*([a_type] * 6), *([types.float32] * 4))

        def codegen(context, builder, signature, args):
            ab = [builder.bitcast(x, _I32) for x in args[:6]]
            res = _asm(builder, ptx, constraints,
                       ir.LiteralStructType([_F32] * 4),
                       ab + list(args[6:]))
            return _tuple(context, builder, signature, res, 4)

        return sig, codegen

    return intrinsic(typer)


mma_bf16 = _mma("m16n8k16", "bf16", types.int32)
mma_bf16.__doc__ = """D = A B + C, 16x16 bf16 times 16x8 bf16, float32 C, D.

(d0..d3) = mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), the a and b
registers int32 pairs (pack_bf16x2), c and d float32. Per lane:
  A (row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..2t+1),
                 a2 = (g, 2t+8..2t+9), a3 = (g+8, 2t+8..2t+9)
  B (k x n, pairs along k): b0 = (2t..2t+1, g), b1 = (2t+8..2t+9, g)
  C, D: c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1)
"""
mma_f16 = _mma("m16n8k16", "f16", types.int32)
mma_f16.__doc__ = """As mma_bf16 for float16 inputs (pack_f16x2)."""
mma_tf32 = _mma("m16n8k8", "tf32", types.float32)
mma_tf32.__doc__ = """D = A B + C, 16x8 tf32 times 8x8 tf32, float32 C, D.

(d0..d3) = mma_tf32(a0, a1, a2, a3, b0, b1, c0, ..., c3); a and b are
float32 whose low 13 mantissa bits the unit ignores (see to_tf32). Per
lane: A: a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4);
B (k x n): b0 = (t, g), b1 = (t+4, g); C, D as in mma_bf16.
"""


def _pack(kind):
    """An intrinsic rounding two float32 to one 16-bit pair."""
    ptx = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"

    def typer(typingctx, lo, hi):
        sig = types.int32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            # cvt puts its first source operand in the upper half
            return _asm(builder, ptx, "=r,f,f", _I32, [args[1], args[0]])

        return sig, codegen

    return intrinsic(typer)


pack_bf16x2 = _pack("bf16")
pack_bf16x2.__doc__ = """int32 pair of bf16(lo) (low half), bf16(hi)
(high half), rounded to nearest even."""
pack_f16x2 = _pack("f16")
pack_f16x2.__doc__ = """int32 pair of float16(lo), float16(hi), rounded
to nearest even (overflow gives inf)."""


@intrinsic
def pack_e4m3x4(typingctx, x0, x1, x2, x3):
    """int32 of four e4m3 bytes, x0's the lowest: each float32 rounded to
    nearest even, beyond +-448 saturated, NaN as 0x7F (flashlab.fp8.to_e4m3
    is the model); the A fragment of an 8-bit wgmma (sm_89 on)."""
    sig = types.int32(types.float32, types.float32, types.float32,
                      types.float32)

    def codegen(context, builder, signature, args):
        # cvt puts its first source operand in the upper byte
        return _asm(builder, "{ .reg .b16 lo, hi;\n\t"
                    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n\t"
                    "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n\t"
                    "mov.b32 $0, {lo, hi}; }", "=r,f,f,f,f", _I32,
                    list(args))

    return sig, codegen


def _unpack(kind):
    """An intrinsic widening an int32 pair of 16-bit floats to float32."""
    _F2 = types.UniTuple(types.float32, 2)

    def typer(typingctx, pair):
        sig = _F2(types.int32)

        def codegen(context, builder, signature, args):
            if kind == "bf16":  # bf16 is float32's upper half: exact
                lo = builder.bitcast(builder.shl(args[0], _I32(16)), _F32)
                hi = builder.bitcast(builder.and_(args[0],
                                                  _I32(-65536)), _F32)
            else:
                both = _asm(builder, "{ .reg .b16 l, h;\n\t"
                            "mov.b32 {l, h}, $2;\n\t"
                            "cvt.f32.f16 $0, l;\n\tcvt.f32.f16 $1, h; }",
                            "=f,=f,r", ir.LiteralStructType([_F32, _F32]),
                            [args[0]])
                lo, hi = (builder.extract_value(both, i) for i in (0, 1))
            return context.make_tuple(builder, signature.return_type,
                                      [lo, hi])

        return sig, codegen

    return intrinsic(typer)


unpack_bf16x2 = _unpack("bf16")
unpack_bf16x2.__doc__ = """(lo, hi) float32 of an int32 pair of bf16
(exact: bf16 is the upper half of a float32)."""
unpack_f16x2 = _unpack("f16")
unpack_f16x2.__doc__ = """(lo, hi) float32 of an int32 pair of float16
(exact)."""


@intrinsic
def ld_global_nc_v4(typingctx, arr, index):
    """Four int32 words, arr[index] and the next three along its last
    axis, in one 16-byte load through the read-only path: the address
    16-byte aligned, and nothing writes arr while the kernel runs.
    Bandwidth-bound kernels read with it (four-byte loads left row_dot16
    and find_bad_parts at half the copy speed)."""
    sig = _I4(arr, index)

    def codegen(context, builder, signature, args):
        p = _element_pointer(context, builder, signature.args[0], args[0],
                             signature.args[1], args[1])
        res = _asm(builder, "ld.global.nc.v4.u32 {$0,$1,$2,$3}, [$4];",
                   "=r,=r,=r,=r,l", ir.LiteralStructType([_I32] * 4), [p])
        return _tuple(context, builder, signature, res, 4)

    return sig, codegen


if config.ENABLE_CUDASIM:  # the simulator runs no PTX: the same values
    def ld_global_nc_v4(arr, index):  # noqa: F811
        """Four int32 words from arr[index] on (the simulator's form)."""
        *lead, x = index
        return tuple(arr[(*lead, x + k)] for k in range(4))


@intrinsic
def ld_shared_v4(typingctx, address):
    """Four int32 words at .shared address `address` (16-byte aligned) in
    one load, in program order with the asm around it (a memory
    clobber): a staged row read back after the stores that wrote it."""
    sig = _I4(types.uint32)

    def codegen(context, builder, signature, args):
        res = _asm(builder, "ld.shared.v4.b32 {$0,$1,$2,$3}, [$4];",
                   "=r,=r,=r,=r,r,~{memory}",
                   ir.LiteralStructType([_I32] * 4), list(args),
                   side_effect=True)
        return _tuple(context, builder, signature, res, 4)

    return sig, codegen


@intrinsic
def st_global_v4(typingctx, address, w0, w1, w2, w3):
    """Store int32 words w0..w3 at global `address` (uint64, 16-byte
    aligned) in one 16-byte store: a warp's four-byte stores of C
    fragments touch 16 bytes of each of 8 rows; these write whole rows."""
    sig = types.void(types.uint64, types.int32, types.int32, types.int32,
                     types.int32)

    def codegen(context, builder, signature, args):
        _asm(builder, "st.global.v4.b32 [$0], {$1,$2,$3,$4};",
             "l,r,r,r,r,~{memory}", None, list(args), side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def to_tf32(typingctx, x):
    """x rounded to tf32 (10 mantissa bits, nearest, ties away), as float32.

    The 3xTF32 split: hi = to_tf32(x), lo = to_tf32(x - hi).
    """
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        bits = _asm(builder, "cvt.rna.tf32.f32 $0, $1;", "=r,f", _I32,
                    [args[0]])
        return builder.bitcast(bits, _F32)

    return sig, codegen


@intrinsic
def ex2(typingctx, x):
    """2**x on the special-function unit, ex2.approx.ftz.f32: one
    instruction (math.exp2 also handles subnormal results, at three more).

    ex2(-inf) = 0, ex2(nan) = nan, ex2(inf) = inf; about 2 ulps; results
    below 2**-126 flush to 0, which P, summed with terms of 1, never needs.
    """
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return _asm(builder, "ex2.approx.ftz.f32 $0, $1;", "=f,f", _F32,
                    [args[0]])

    return sig, codegen


def _f32(x):
    """A float32 as a PTX literal (0f and its bits in hex)."""
    return f"0f{int(np.float32(x).view(np.uint32)):08X}"


_C1, _C2, _C3 = (_f32(c) for c in exp2.COEFFS)
# ex2_poly's PTX: flashlab.exp2.model's steps, one instruction each
EX2_POLY = " ".join((
    "{ .reg .f32 t, j, f, p; .reg .b32 e;",
    f"max.ftz.NaN.f32 t, $1, {_f32(exp2.LOWEST)};",
    f"add.rm.ftz.f32 j, t, {_f32(exp2.MAGIC)};",  # MAGIC + floor(t)
    f"sub.ftz.f32 f, j, {_f32(exp2.MAGIC)};",
    "sub.ftz.f32 f, t, f;",
    f"fma.rn.ftz.f32 p, f, {_C3}, {_C2};",
    f"fma.rn.ftz.f32 p, p, f, {_C1};",
    f"fma.rn.ftz.f32 p, p, f, {_f32(1)};",
    "mov.b32 e, j;",  # floor(t) in its low bits: << 23 leaves only it
    "shl.b32 e, e, 23;",
    "add.s32 e, e, 0x3F800000;",  # (j + 127) << 23: 2**j
    "mul.ftz.f32 $0, p, e; }"))


@intrinsic
def ex2_poly(typingctx, x):
    """2**x as ex2 gives it, on the FMA pipe: flashlab.exp2's polynomial
    (nine instructions, relative error below 1e-4; -inf gives 0, NaN
    NaN). flashlab.exp2.model is its numpy model."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return _asm(builder, EX2_POLY, "=f,f", _F32, [args[0]])

    return sig, codegen


@intrinsic
def opaque(typingctx, x):
    """x (uint32) through a mov the compiler treats as a side effect.

    A value made by it inside a loop stays inside: the compiler cannot
    hoist it, nor what is computed from it, out of the loop. The kernels
    pass their ldmatrix bases through it (see warp.lane_bases).
    """
    sig = types.uint32(types.uint32)

    def codegen(context, builder, signature, args):
        return _asm(builder, "mov.b32 $0, $1;", "=r,r", _I32, [args[0]],
                    side_effect=True)

    return sig, codegen


def _element_pointer(context, builder, arr_type, arr, index_type, index):
    """Generic 64-bit address of arr[index] (index an int or a tuple)."""
    ary = context.make_array(arr_type)(context, builder, value=arr)
    if isinstance(index_type, types.BaseTuple):
        indices = cgutils.unpack_tuple(builder, index, len(index_type))
        kinds = index_type.types
    else:
        indices, kinds = [index], [index_type]
    indices = [context.cast(builder, i, kind, types.intp)
               for i, kind in zip(indices, kinds)]
    ptr = cgutils.get_item_pointer(context, builder, arr_type, ary,
                                   indices)
    return builder.ptrtoint(ptr, _I64)


@intrinsic
def shared_address(typingctx, arr, index):
    """32-bit .shared address of arr[index], arr a cuda.shared.array."""
    sig = types.uint32(arr, index)

    def codegen(context, builder, signature, args):
        p = _element_pointer(context, builder, signature.args[0], args[0],
                             signature.args[1], args[1])
        return _asm(builder,
                    "{ .reg .u64 t; cvta.to.shared.u64 t, $1; "
                    "cvt.u32.u64 $0, t; }", "=r,l", _I32, [p])

    return sig, codegen


@intrinsic
def global_address(typingctx, arr, index):
    """64-bit address of arr[index], arr a device array in global memory."""
    sig = types.uint64(arr, index)

    def codegen(context, builder, signature, args):
        return _element_pointer(context, builder, signature.args[0],
                                args[0], signature.args[1], args[1])

    return sig, codegen


@intrinsic
def st_shared32(typingctx, dst, value):
    """Store 32 bits (two 16-bit values packed as an int32) at .shared
    address dst, in program order with the asm around it (a memory
    clobber): what a fence.proxy.async then hands to wgmma."""
    sig = types.void(types.uint32, types.int32)

    def codegen(context, builder, signature, args):
        _asm(builder, "st.shared.b32 [$0], $1;", "r,r,~{memory}", None,
             list(args), side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def red_add2(typingctx, address, x, y):
    """Add float32 x and y to the two float32 at global `address` (8-byte
    aligned, global_address) in one reduction, no value returned:
    red.global.add.v2.f32 (sm_90), half the instructions of two atomic
    adds."""
    sig = types.void(types.uint64, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        _asm(builder, "red.global.add.v2.f32 [$0], {$1, $2};",
             "l,f,f,~{memory}", None, list(args), side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def bar_sync(typingctx, barrier, count):
    """Named barrier `barrier` (1..15; 0 is syncthreads') for `count`
    threads (a multiple of 32): bar.sync, e.g. one warpgroup's 128."""
    sig = types.void(types.int32, types.int32)

    def codegen(context, builder, signature, args):
        _asm(builder, "bar.sync $0, $1;", "r,r,~{memory}", None,
             list(args), side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def bar_arrive(typingctx, barrier, count):
    """Arrive at named barrier `barrier` without waiting (bar.arrive): it
    completes once `count` threads have arrived or synced there, so one
    warpgroup can let another's bar_sync go on."""
    sig = types.void(types.int32, types.int32)

    def codegen(context, builder, signature, args):
        _asm(builder, "bar.arrive $0, $1;", "r,r,~{memory}", None,
             list(args), side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cp_async16(typingctx, dst, src, nbytes):
    """Copy 16 bytes global -> shared without the registers (cp.async.cg).

    dst: shared_address, src: global_address, both 16-byte aligned;
    nbytes (0 or 16) bytes are read and the rest of the 16 zero-filled, so
    a row past the end of an array lands as zeros. Completes only after
    cp_async_commit and cp_async_wait_all.
    """
    sig = types.void(types.uint32, types.uint64, types.int32)

    def codegen(context, builder, signature, args):
        _asm(builder, "cp.async.cg.shared.global [$0], [$1], 16, $2;",
             "r,l,r", None, list(args), side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cp_async_commit(typingctx):
    """Close the group of cp.async copies this thread has issued."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        _asm(builder, "cp.async.commit_group;", "", None, [],
             side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cp_async_wait_all(typingctx):
    """Wait until this thread's committed cp.async groups have landed.

    Other threads' copies are visible only after a barrier as well.
    """
    sig = types.void()

    def codegen(context, builder, signature, args):
        _asm(builder, "cp.async.wait_group 0;", "~{memory}", None, [],
             side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cp_async_wait_one(typingctx):
    """Wait until all but this thread's newest committed cp.async group
    have landed: the older copies are used while the newest flies."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        _asm(builder, "cp.async.wait_group 1;", "~{memory}", None, [],
             side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


def _ldmatrix(trans):
    """An intrinsic for ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16."""
    ptx = ("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "")
           + ".shared.b16 {$0,$1,$2,$3}, [$4];")

    def typer(typingctx, address):
        sig = _I4(types.uint32)

        def codegen(context, builder, signature, args):
            res = _asm(builder, ptx, "=r,=r,=r,=r,r,~{memory}",
                       ir.LiteralStructType([_I32] * 4), [args[0]],
                       side_effect=True)
            return _tuple(context, builder, signature, res, 4)

        return sig, codegen

    return intrinsic(typer)


ldmatrix_x4 = _ldmatrix(trans=False)
ldmatrix_x4.__doc__ = """Four 8x8 16-bit matrices from shared memory.

Lanes 8i..8i+7 give the shared addresses of rows 0..7 of matrix i (16
contiguous bytes each); every lane receives (r0, r1, r2, r3), r_i the
pair (g, 2t..2t+1) of matrix i. Four matrices laid out as the quarters of
a 16x16 tile are the mma A fragment; see fragments.ldmatrix.
"""
ldmatrix_x4_trans = _ldmatrix(trans=True)
ldmatrix_x4_trans.__doc__ = """ldmatrix_x4 transposed: r_i is the pair
(2t..2t+1, g) of matrix i, i.e. two elements of a column: the mma B
fragment of a row-major k x n tile (V in P V)."""

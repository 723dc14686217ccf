"""Hopper's warpgroup MMA (wgmma) for numba.cuda, as inline PTX (sm_90a).

A warpgroup (4 warps, 128 threads) multiplies a 64 x 16 A by a 16 x N B
with one wgmma.mma_async m64nNk16: B, and A unless it comes from
registers, is read from shared memory through a descriptor
(fragments.descriptor), and the 64 x N float32 accumulator lies in the
warpgroup's registers as mma.sync's C fragments stacked over its warps
(fragments.wgmma_c_places). These instructions exist only on sm_90a:
kernels built on them compile with cc=(9, 0, "a") and are loaded through
the driver, not numba's dispatcher.

A product is one asm statement from wgmma.fence to wgmma.commit_group,
and with wait=True to wgmma.wait_group 0 as well. With wait=False it is
asynchronous: the warpgroup goes on (a softmax, another product) while
the tensor cores work, and `wait_for(pending, ...)` later waits until at
most `pending` groups are in flight. Until then the product's
accumulator and A registers belong to the tensor cores: wait_for takes
them as operands it reads and rewrites, so the compiler keeps them where
they are and no instruction touches them before the wait. Accumulators
and A fragments are constant-size local arrays (in registers once
unrolled), read and written whole. See chapter 12.
"""

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
KINDS = {"bf16": "bf16", "f16": "f16", "e4m3": "e4m3"}  # PTX input types
K_STEP = {"bf16": 16, "f16": 16, "e4m3": 32}  # k of one wgmma: 32 bytes


def _elements(context, builder, arr_type, arr, count):
    """Pointers to elements 0..count-1 of a C-contiguous local array (the
    caller's array must hold count: a local array's shape is not part of
    its numba type)."""
    data = context.make_array(arr_type)(context, builder, value=arr).data
    return [builder.gep(data, [ir.Constant(_I64, i)]) for i in range(count)]


def _product(body, registers, wait):
    """One asm block: fence, the wgmmas of `body`, commit, and with
    `wait` wait for them.

    Predicate z (false) as scale-d makes a wgmma ignore the accumulator's
    old values (D = A B), p (true) adds to them (D = A B + D)."""
    end = ["wgmma.wait_group.sync.aligned 0;"] if wait else []
    return "\n\t".join(["{", ".reg .pred z, p;", f".reg .b64 {registers};",
                        "setp.ne.b32 z, 0, 0;", "setp.ne.b32 p, 1, 0;",
                        "wgmma.fence.sync.aligned;", *body,
                        "wgmma.commit_group.sync.aligned;", *end, "}"])


def mma_ss(n, steps, a_step, b_step, kind, trans_b=0, wait=True,
           trans_a=0):
    """acc = A B: `steps` k-steps of m64n<n>k16 (k32 for e4m3), A and B
    from shared memory.

    mma_ss(...)(acc, desc_a, desc_b): acc a float32 local array of n / 2
    (C-contiguous, register r at flat index r), desc_a and desc_b uint64
    descriptors of k-step 0; k-step s reads s a_step, s b_step bytes
    further on, or a_step[s], b_step[s] where they are tuples
    (compile-time constants: a swizzled tile's k-steps jump between
    panels). trans_b = 1 reads B MN-major, trans_a = 1 A (16-bit kinds
    only: dS stored as dS^T, keys x queries, is A of dQ = dS K). k-step 0
    ignores acc's old values (scale-d false): nothing needs zeroing.
    """
    regs = n // 2
    d = "{" + ",".join(f"${i}" for i in range(regs)) + "}"
    a_at, b_at = _offsets(a_step, steps), _offsets(b_step, steps)
    body = []
    for s in range(steps):
        body += [f"add.s64 a{s}, ${regs}, {a_at[s] >> 4};",
                 f"add.s64 b{s}, ${regs + 1}, {b_at[s] >> 4};",
                 f"{_opcode(n, kind)} {d}, a{s}, b{s}, "
                 f"{'z' if s == 0 else 'p'}, 1, 1"
                 f"{_trans(kind, trans_a, trans_b)};"]
    ptx = _product(body, f"a<{steps}>, b<{steps}>", wait)
    constraints = ",".join(["=f"] * regs + ["l", "l"])

    def typer(typingctx, acc, desc_a, desc_b):
        sig = types.void(acc, types.uint64, types.uint64)

        def codegen(context, builder, signature, args):
            res = builder.asm(
                ir.FunctionType(ir.LiteralStructType([_F32] * regs),
                                [_I64, _I64]),
                ptx, constraints, [args[1], args[2]], True)
            for i, at in enumerate(_elements(context, builder,
                                             signature.args[0], args[0],
                                             regs)):
                builder.store(builder.extract_value(res, i), at)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


def _opcode(n, kind):
    """The wgmma opcode of m64n<n> for input `kind`, float32 accumulators:
    k16 for 16-bit inputs, k32 for 8-bit ones (32 bytes of K either way).
    """
    return (f"wgmma.mma_async.sync.aligned.m64n{n}k{K_STEP[kind]}.f32."
            f"{KINDS[kind]}.{KINDS[kind]}")


def _trans(kind, *flags):
    """The transpose immediates of a 16-bit wgmma; 8-bit inputs have none
    (both operands are read K-major)."""
    if K_STEP[kind] != 16:
        if any(flags):
            raise ValueError(f"kind: {kind} operands are K-major only, got"
                             f" transpose flags {flags}")
        return ""
    return "".join(f", {x}" for x in flags)


def _offsets(step, steps):
    """Byte offset of each k-step: s step, or step[s] for a tuple."""
    return tuple(step) if isinstance(step, tuple) else tuple(
        s * step for s in range(steps))


def mma_rs(n, steps, b_step, kind, trans_b=1, wait=True):
    """acc += A B: `steps` k-steps of m64n<n>k16 (k32 for e4m3), A from
    registers, B from shared memory.

    mma_rs(...)(acc, a, desc_b): acc a float32 local array of n / 2, a an
    int32 local array (steps, 4), row s the A fragment of k-step s: 16-bit
    pairs (fragments.wgmma_a_places) or e4m3 quads
    (fragments.wgmma_a8_places); desc_b the uint64 descriptor of k-step
    0, k-step s b_step bytes on (or b_step[s], a tuple). trans_b = 1 (the
    default, 16-bit kinds) reads B MN-major: V stored keys x d_v is B of
    P V. e4m3 reads it K-major only (trans_b = 0): V^T.
    """
    regs = n // 2
    d = "{" + ",".join(f"${i}" for i in range(regs)) + "}"
    desc = regs + 4 * steps  # operand number of desc_b
    b_at = _offsets(b_step, steps)
    body = []
    for s in range(steps):
        a = "{" + ",".join(f"${regs + 4 * s + x}" for x in range(4)) + "}"
        body += [f"add.s64 b{s}, ${desc}, {b_at[s] >> 4};",
                 f"{_opcode(n, kind)} {d}, {a}, b{s}, p, 1, 1"
                 f"{_trans(kind, trans_b)};"]
    ptx = _product(body, f"b<{steps}>", wait)
    constraints = ",".join(["=f"] * regs + ["r"] * (4 * steps) + ["l"]
                           + [str(i) for i in range(regs)])

    def typer(typingctx, acc, a, desc_b):
        sig = types.void(acc, a, types.uint64)

        def codegen(context, builder, signature, args):
            accs = _elements(context, builder, signature.args[0], args[0],
                             regs)
            frags = _elements(context, builder, signature.args[1], args[1],
                              4 * steps)
            operands = ([builder.load(x) for x in frags] + [args[2]]
                        + [builder.load(x) for x in accs])
            res = builder.asm(
                ir.FunctionType(ir.LiteralStructType([_F32] * regs),
                                [x.type for x in operands]),
                ptx, constraints, operands, True)
            for i, at in enumerate(accs):
                builder.store(builder.extract_value(res, i), at)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


def wait_for(pending, *counts):
    """wgmma.wait_group `pending`: at most `pending` committed products
    stay in flight. wait_for(...)(x0, x1, ...) takes one local array per
    count (float32 accumulators, int32 A fragments), the first count
    elements of each: it reads and rewrites them, so they are live up to
    here, unmoved, and read after it only.
    """
    kinds = {types.float32: ("f", _F32), types.int32: ("r", _I32)}
    total = sum(counts)
    ptx = f"wgmma.wait_group.sync.aligned {pending};"

    def codegen(context, builder, signature, args):
        places = []
        for ty, arr, count in zip(signature.args, args, counts):
            places += _elements(context, builder, ty, arr, count)
        values = [builder.load(x) for x in places]
        code = [kinds[ty.dtype][0] for ty, count in zip(signature.args,
                                                        counts)
                for _ in range(count)]
        constraints = ",".join([f"={c}" for c in code]
                               + [str(i) for i in range(total)])
        res = builder.asm(
            ir.FunctionType(ir.LiteralStructType([x.type for x in values]),
                            [x.type for x in values]),
            ptx, constraints, values, True)
        for i, at in enumerate(places):
            builder.store(builder.extract_value(res, i), at)
        return context.get_dummy_value()

    def typer(typingctx, *arrays):
        if len(arrays) != len(counts) or any(
                a.dtype not in kinds for a in arrays):
            return None
        return types.void(*arrays), codegen

    return intrinsic(_fixed_arity(typer, len(counts)))


def _fixed_arity(typer, n):
    """typer with exactly n (1 or 2) array parameters: numba's intrinsic
    rejects *args typers."""

    def one(typingctx, a0):
        return typer(typingctx, a0)

    def two(typingctx, a0, a1):
        return typer(typingctx, a0, a1)

    return {1: one, 2: two}[n]


@intrinsic
def proxy_fence(typingctx):
    """fence.proxy.async.shared::cta: this thread's shared-memory writes
    (st.shared, cp.async) become visible to the async proxy that wgmma
    reads through; a barrier after it makes all threads' visible."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.asm(ir.FunctionType(ir.VoidType(), []),
                    "fence.proxy.async.shared::cta;", "~{memory}", [], True)
        return context.get_dummy_value()

    return sig, codegen

"""Chapter 12's exercises on the wgmma models: no GPU needed."""

import numpy as np

from flashlab import exp2, fragments, masks, order
from flashlab.exercises.checker import Case, Exercise, register

# ---------------------------------------------------------- descriptor


def _cases_descriptor(rng):
    out = [Case("K-major core matrices, d = 64", (0x2000, 128, 1024),
                fragments.descriptor(0x2000, 128, 1024)),
           Case("MN-major core matrices, d_v = 128", (0x6400, 2048, 128),
                fragments.descriptor(0x6400, 2048, 128)),
           Case("a generic address above 256 KiB (only 18 bits count)",
                (0x7F41230, 128, 256),
                fragments.descriptor(0x7F41230, 128, 256))]
    address = int(rng.integers(0, 2 ** 14)) * 16
    lbo, sbo = (int(x) * 16 for x in rng.integers(1, 2 ** 10, 2))
    out.append(Case("random fields", (address, lbo, sbo),
                    fragments.descriptor(address, lbo, sbo)))
    return out


def descriptor(address, lbo, sbo):
    """Chapter 12: wgmma's 64-bit matrix descriptor (no swizzle) as an int.

    Three fields in 16-byte units: the shared address (its low 18 bits)
    in bits 0-13, LBO (the next core matrix along K) in bits 16-29, SBO
    (the next along M or N) in bits 32-45.
    """
    return (((address & 0x3FFFF) >> 4) | ((lbo >> 4) << 16)
            | ((sbo >> 4) << 32))


def _descriptor_bytes(address, lbo, sbo):
    return (address & 0x3FFFF) | (lbo << 16) | (sbo << 32)


def _descriptor_swapped(address, lbo, sbo):
    return (((address & 0x3FFFF) >> 4) | ((sbo >> 4) << 16)
            | ((lbo >> 4) << 32))


def _descriptor_unmasked(address, lbo, sbo):
    return (address >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32)


register("descriptor", Exercise(
    12, "descriptor(address, lbo, sbo) -> int: wgmma's matrix "
    "descriptor (no swizzle) of a tile at shared address `address` with "
    "leading and stride byte offsets lbo, sbo",
    _cases_descriptor, descriptor,
    (("every field counts 16-byte units: shift the address, LBO and SBO "
      "right by 4 before placing them", _descriptor_bytes),
     ("LBO (along K) goes to bits 16-29 and SBO (along M or N) to bits "
      "32-45, not the other way round", _descriptor_swapped),
     ("only the address's low 18 bits are a shared-memory offset: mask "
      "with 0x3FFFF first, or a generic address spills into LBO's field",
      _descriptor_unmasked))))

# ------------------------------------------------------- swizzled_place


def _cases_swizzled_place(rng):
    out = []
    for name, rows, per_row in (("d = 64: one panel, 64 rows", 64, 8),
                                ("d = 128: two panels, 128 rows", 128, 16)):
        r = np.repeat(np.arange(rows), per_row)
        c = np.tile(np.arange(per_row), rows)
        out.append(Case(name, (r, c, rows),
                        fragments.panel_offset(r, c, rows)))
    r, c = rng.integers(0, 128, 30), rng.integers(0, 16, 30)
    out.append(Case("random rows and chunks, 128 rows", (r, c, 128),
                    fragments.panel_offset(r, c, 128)))
    return out


def swizzled_place(rows, chunks, n_rows):
    """Chapter 12: byte offset of 16-byte chunk `chunks` of row `rows` in a
    128-byte-swizzled tile of n_rows rows.

    Panels of 8 chunks (64 16-bit columns) lie one after the other, each
    n_rows x 128 bytes; in its panel, chunk c of row r sits in slot
    c ^ (r % 8) of the row's 128 bytes.
    """
    panel, c = chunks // 8, chunks % 8
    return panel * n_rows * 128 + rows * 128 + (c ^ (rows % 8)) * 16


def _swizzled_no_panels(rows, chunks, n_rows):
    per_row = 16  # one long row of every chunk, XOR on the whole chunk
    return rows * per_row * 16 + (chunks ^ (rows % 8)) * 16


def _swizzled_not_swizzled(rows, chunks, n_rows):
    return (chunks // 8) * n_rows * 128 + rows * 128 + (chunks % 8) * 16


def _swizzled_whole_row(rows, chunks, n_rows):
    return ((chunks // 8) * n_rows * 128 + rows * 128
            + ((chunks % 8) ^ rows) * 16)


register("swizzled_place", Exercise(
    12, "swizzled_place(rows (n,), chunks (n,), n_rows) -> int array "
    "(n,): the byte offset of each 16-byte chunk in a 128-byte-swizzled "
    "tile of n_rows rows (panels of 64 columns)",
    _cases_swizzled_place, swizzled_place,
    (("rows longer than 128 bytes are cut into panels of 8 chunks, stored "
      "one after the other (n_rows x 128 bytes each)", _swizzled_no_panels),
     ("the chunk's slot is c ^ (r % 8): without the XOR, chunk c of 8 rows "
      "falls in the same 4 banks", _swizzled_not_swizzled),
     ("only the row's low three bits take part (r % 8): XOR with the whole "
      "row leaves the 128-byte row", _swizzled_whole_row))))

# ------------------------------------------------- accumulator_register


def _places(n):
    """(64, n, 2) (thread, register) holding each element of m64nN."""
    out = np.empty((64, n, 2), np.int64)
    places = fragments.wgmma_c_places(n)  # (128, n // 2, 2)
    t, r = np.meshgrid(np.arange(128), np.arange(n // 2), indexing="ij")
    out[places[..., 0], places[..., 1]] = np.stack([t, r], -1)
    return out


def _cases_accumulator(rng):
    out = []
    for name, n in (("every element of m64n16", 16),
                    ("every element of m64n128", 128)):
        i, j = np.meshgrid(np.arange(64), np.arange(n), indexing="ij")
        out.append(Case(name, (i.ravel(), j.ravel()),
                        _places(n).reshape(-1, 2)))
    i, j = rng.integers(0, 64, 25), rng.integers(0, 256, 25)
    out.append(Case("random elements of m64n256", (i, j), _places(256)[i, j]))
    return out


def accumulator_register(i, j):
    """Chapter 12: (n, 2) (thread, register) of the warpgroup holding
    S[i, j] of a m64nN wgmma accumulator.

    Warp i // 16 holds rows 16 w..; in them, mma.sync's C fragment of
    8-column group j // 8 (lane 4 G + t: rows G, G + 8, columns 2 t,
    2 t + 1), its four registers numbered on by 4 per group.
    """
    warp, g, half = i // 16, i % 8, (i % 16) // 8
    thread = 32 * warp + 4 * g + (j % 8) // 2
    register_ = 4 * (j // 8) + 2 * half + j % 2
    return np.stack([thread, register_], -1)


def _accumulator_lane_swapped(i, j):
    warp, g, half = i // 16, i % 8, (i % 16) // 8
    thread = 32 * warp + 8 * ((j % 8) // 2) + g  # lane = 8 t + G
    return np.stack([thread, 4 * (j // 8) + 2 * half + j % 2], -1)


def _accumulator_no_warp(i, j):
    g, half = i % 8, (i % 16) // 8
    thread = 4 * g + (j % 8) // 2  # every row in warp 0
    return np.stack([thread, 4 * (j // 8) + 2 * half + j % 2], -1)


def _accumulator_a_order(i, j):
    warp, g, half = i // 16, i % 8, (i % 16) // 8
    thread = 32 * warp + 4 * g + (j % 8) // 2
    return np.stack([thread, 4 * (j // 8) + half + 2 * (j % 2)], -1)


register("accumulator_register", Exercise(
    12, "accumulator_register(i (n,), j (n,)) -> int array (n, 2): the "
    "(thread, register) of the warpgroup holding element (i, j) of a "
    "m64nN wgmma accumulator",
    _cases_accumulator, accumulator_register,
    (("lane = 4 G + t: the row group G picks four consecutive lanes, the "
      "column pair t one of them", _accumulator_lane_swapped),
     ("each warp of the warpgroup holds 16 rows: thread 32 (i // 16) + "
      "lane", _accumulator_no_warp),
     ("in C, registers 0 and 1 are the column pair of row G and 2, 3 that "
      "of row G + 8", _accumulator_a_order))))

# --------------------------------------------------------- wait_parity


def _model_parities(n, stages):
    """(consumer, producer) parity for tile n, found on viz.MBarrier: the
    one a wait fails on before the tile's phase completes and passes on
    after it (full), and the one that passes once the stage's previous
    tile is released (empty)."""
    from flashlab.viz import MBarrier

    full, empty = MBarrier(1), MBarrier(1)
    for _ in range(n // stages):  # the stage's earlier tiles, done
        full.arrive()
        empty.arrive()
    consumer = next(p for p in (0, 1) if not full.try_wait(p))
    full.arrive()  # tile n lands: now that wait passes
    if not full.try_wait(consumer):
        raise RuntimeError("MBarrier: a completed phase did not pass")
    producer = next(p for p in (0, 1) if empty.try_wait(p))
    return consumer, producer


def _cases_wait_parity(rng):
    out = []
    for name, n, stages in (
            ("v8's two stages, tiles 0-11", np.arange(12), 2),
            ("one stage, tiles 0-5", np.arange(6), 1),
            ("three stages, random tiles",
             np.sort(rng.integers(0, 60, 12)), 3),
            ("four stages, tiles past 100",
             np.sort(rng.integers(100, 400, 10)), 4)):
        want = np.array([_model_parities(int(x), stages) for x in n])
        out.append(Case(name, (n, stages), want))
    return out


def wait_parity(n, stages):
    """Chapter 12: (consumer, producer) mbarrier parities for K/V tiles n
    in a ring of `stages` stages.

    Tile n uses stage n % stages for the (n // stages)-th time: the
    consumers wait for that phase of the stage's full barrier, parity
    (n // stages) % 2; the producer, before copying it, waits for the
    phase before it of the stage's empty barrier, the other parity (on a
    fresh barrier, parity 1 passes at once).
    """
    phase = (n // stages) % 2
    return np.stack([phase, 1 - phase], -1)


def _parity_of_tile(n, stages):
    return np.stack([n % 2, 1 - n % 2], -1)


def _parity_same(n, stages):
    phase = (n // stages) % 2
    return np.stack([phase, phase], -1)


def _parity_not_a_bit(n, stages):
    phase = n // stages
    return np.stack([phase, 1 - phase], -1)


register("wait_parity", Exercise(
    12, "wait_parity(n (m,), stages) -> int array (m, 2): the parity the "
    "consumers wait on for K/V tile n (its stage's full barrier) and the "
    "one the producer waits on before copying it (its empty barrier)",
    _cases_wait_parity, wait_parity,
    (("a barrier belongs to a stage: tile n is its stage's pass "
      "n // stages, so the phase is (n // stages) % 2, not n % 2",
      _parity_of_tile),
     ("the producer waits for the consumers' previous pass over the "
      "stage, one phase back: the other parity (a fresh barrier passes "
      "parity 1 at once)", _parity_same),
     ("a parity is one bit: take the pass number modulo 2",
      _parity_not_a_bit))))

# ----------------------------------------------------------- p_exponent

_LOG2E = np.float32(np.log2(np.e))


def _cases_p_exponent(rng):
    f = np.float32
    s = (rng.standard_normal(40) * 3).astype(f)
    tau = f(0.125)
    shift = f(np.log(np.exp(s.astype(np.float64) * 0.125).sum()))
    huge = np.full(10, 1.8e7, f)
    third = f(0.3)
    big = np.array([3.0e38, 2.5e38, -3.0e38], f)
    cases = (("ten equal scores of 1.8e7, tau = 0.5", huge, f(0.5),
              f(huge[0] * f(0.5))),
             ("ten equal scores of 1.8e7, tau = 0.3", huge, third,
              f(huge[0] * third)),
             ("ten equal scores of -3e38, tau = 1", np.full(10, -3e38, f),
              f(1), f(-3e38)),
             ("scores up to 3e38 against a shift of 3e38", big, f(1),
              big[0]),
             ("ordinary scores, shift = the row's lse", s, tau, shift))
    out = []
    for name, s, tau, shift in cases:
        with np.errstate(over="ignore"):
            want = p_exponent(s, tau, shift).astype(np.float64)
        out.append(Case(name, (s, tau, shift), want))
    return out


def p_exponent(s, tau, shift):
    """Chapter 12: log2 of P / norm for float32 scores s (the backward's
    p_of), in float32 as the kernels compute it.

    s tau is rounded to float32 first, exactly as the forward and
    row_statistics rounded it when they found the shift; the shift is
    subtracted next, and log2 e multiplies last. Equal scores then give
    exactly 0 (P = 1 before the norm), and no finite score overflows.
    """
    x = (s * tau).astype(np.float32)
    return ((x - shift).astype(np.float32) * _LOG2E).astype(np.float32)


def _exponent_folded(s, tau, shift):
    # one FMA, x log2 e - (shift log2 e), the product exact inside it
    x = (s * tau).astype(np.float32)
    folded = (shift * _LOG2E).astype(np.float32)
    return (x.astype(np.float64) * np.float64(_LOG2E) - folded).astype(
        np.float32)


def _exponent_unrounded(s, tau, shift):
    x = s.astype(np.float64) * np.float64(tau)
    return ((x - shift) * _LOG2E).astype(np.float32)


def _exponent_float64(s, tau, shift):
    x = s.astype(np.float64) * np.float64(tau)
    return (x - np.float64(shift)) * np.log2(np.e)


register("p_exponent", Exercise(
    12, "p_exponent(s (n,) float32, tau, shift) -> (n,): log2 of P / norm "
    "as backward_v5.p_of forms it, in float32 (P = 2 ** p_exponent)",
    _cases_p_exponent, p_exponent,
    (("folding log2 e into the shift rounds shift log2 e on its own: at "
      "a shift of 9e6 that rounding is up to half a unit of the exponent "
      "(P off by up to 41%), and at 3e38 it overflows. Subtract the shift "
      "first, then multiply by log2 e", _exponent_folded),
     ("round s tau to float32 before subtracting: the shift is the "
      "rounded value, so an unrounded product leaves its rounding error "
      "in the exponent", _exponent_unrounded),
     ("compute in float32, as the kernel does: float64 arithmetic rounds "
      "differently", _exponent_float64))))

# ------------------------------------------------------- e4m3_key_order


def _cases_key_order(rng):
    every = np.arange(32)
    lane = int(rng.integers(0, 4))
    mine = np.array([16 * h + 4 * lane + y for h in (0, 1)
                     for y in range(4)])  # lane's bytes in registers 0, 2
    some = rng.permutation(32)[:int(rng.integers(3, 12))]
    return [Case(name, (k,), fragments.key_of_column8(k))
            for name, k in (("every column of a k-step", every),
                            (f"the columns lane {lane} of a quad holds",
                             mine),
                            ("a random handful of columns", some))]


def e4m3_key_order(k):
    """Chapter 12: the key (0..31) that column k of an e4m3 k-step's A
    operand holds when P is packed from S's C fragments without moving a
    byte between lanes.

    Column 16 h + 4 t + y is byte y of lane t's register 2 h (or 2 h + 1:
    the rows differ, not the columns). That lane holds S's columns
    2 t, 2 t + 1 of n-tiles 2 h and 2 h + 1, keys 8 apart: bytes 0 and 1
    take the first n-tile's pair, bytes 2 and 3 the second's.
    """
    h, t, y = k // 16, (k % 16) // 4, k % 4
    return 16 * h + 8 * (y // 2) + 2 * t + y % 2


def _key_order_identity(k):
    return np.asarray(k).copy()


def _key_order_inverse(k):
    # where key k sits, not which key column k holds
    h, pair, t, c = k // 16, (k % 16) // 8, (k % 8) // 2, k % 2
    return 16 * h + 4 * t + 2 * pair + c


def _key_order_four_apart(k):
    h, t, y = k // 16, (k % 16) // 4, k % 4
    return 16 * h + 4 * (y // 2) + 2 * t + y % 2


register("e4m3_key_order", Exercise(
    12, "e4m3_key_order(k int array) -> int array: the key each A column "
    "k (0..31) of an e4m3 k-step holds, P packed from S's C fragments "
    "without moving bytes between lanes (V^T's key order)",
    _cases_key_order, e4m3_key_order,
    (("the packed P is not in key order: a lane's four A bytes are "
      "consecutive columns, but its C fragments hold pairs of keys from "
      "two n-tiles", _key_order_identity),
     ("that is where each key goes, the inverse: the exercise asks which "
      "key a column holds", _key_order_inverse),
     ("the second pair comes from the next n-tile of S, 8 keys on, not "
      "4", _key_order_four_apart))))

# ------------------------------------------------------- fragment_run


def _cases_fragment_run(rng):
    tiles = 16  # a 128-key tile of S, as v8's at d = 128
    t = int(rng.integers(0, 4))
    base = 2 * t  # the lane's first column in a tile starting at key 0
    row = int(rng.integers(0, 128))
    lo, hi = sorted(int(x) for x in rng.integers(-20, 150, 2))
    cases = (
        ("every key allowed", (-5, 1000, base, tiles)),
        ("no key allowed (hi < lo)", (40, 39, base, tiles)),
        (f"a causal diagonal: keys up to row {row}", (0, row, base, tiles)),
        ("a window starting inside a pair", (2 * t + 9, 2 * t + 60, base,
                                             tiles)),
        ("the run ends on the pair's first column",
         (0, 2 * t + 8 * 5, base, tiles)),
        ("a tile of 8 n-tiles (d = 64's S)", (3, 41, base, 8)),
        ("a random interval", (lo, hi, base, tiles)))
    return [Case(name, args, fragments.fragment_run(*args))
            for name, args in cases]


def fragment_run(lo, hi, base, tiles):
    """Chapter 12: the bits of a lane's C-fragment row-half that a row
    keeps when its allowed keys are lo..hi (the mask of a diagonal tile).

    The lane's columns in that row are base + 8 n + e for n-tile n <
    tiles and element e < 2; the bit of (n, e) is 4 n + e, as
    warp.allowed_bits_of numbers the fragment's elements (the row's other
    half sits 2 places up). The kernel makes the same bits as one run
    (fragments.fragment_run); one test per element is the plain answer.
    """
    bits = 0
    for n in range(tiles):
        for e in range(2):
            if lo <= base + 8 * n + e <= hi:
                bits |= 1 << (4 * n + e)
    return bits


def _run_consecutive(lo, hi, base, tiles):
    # the lane's columns taken as consecutive keys
    bits = 0
    for k in range(2 * tiles):
        if lo <= base + k <= hi:
            bits |= 1 << (4 * (k // 2) + k % 2)
    return bits


def _run_unspread(lo, hi, base, tiles):
    # the run's bits left at 2 n + e
    bits = 0
    for n in range(tiles):
        for e in range(2):
            if lo <= base + 8 * n + e <= hi:
                bits |= 1 << (2 * n + e)
    return bits


def _run_hi_excluded(lo, hi, base, tiles):
    bits = 0
    for n in range(tiles):
        for e in range(2):
            if lo <= base + 8 * n + e < hi:
                bits |= 1 << (4 * n + e)
    return bits


register("fragment_run", Exercise(
    12, "fragment_run(lo, hi, base, tiles) -> int: the bits 4 n + e of a "
    "lane's C-fragment row-half whose columns base + 8 n + e (n < tiles, "
    "e < 2) lie in the allowed keys lo..hi",
    _cases_fragment_run, fragment_run,
    (("a lane's two columns of an n-tile are a pair, and the next pair is "
      "8 columns on: the other lanes of its quad hold the 6 between",
      _run_consecutive),
     ("each n-tile has 4 elements (2 rows x 2 columns): the pair of "
      "n-tile n goes to bits 4 n and 4 n + 1, not 2 n and 2 n + 1",
      _run_unspread),
     ("lo..hi is inclusive: key hi is allowed", _run_hi_excluded))))

# ------------------------------------------------------- register_budget

_SM_REGISTERS = 64 * 1024  # 32-bit registers of a Hopper SM


def _model_budget(groups, keep):
    """(cap, grow) by search: the largest cap a multiple of 8 whose block
    fits the SM, and the largest consumer count a multiple of 8, at most
    256, that the producer's release leaves room for."""
    threads = 128 * (groups + 1)
    cap = max(c for c in range(8, 257, 8) if c * threads <= _SM_REGISTERS)
    grow = max(g for g in range(8, 257, 8)
               if keep * 128 + g * 128 * groups <= cap * threads)
    return cap, grow


def _cases_register_budget(rng):
    from flashlab.gpu import forward_v8

    out = [Case(f"forward_v8's block of {g} consumers", (g, keep),
                forward_v8.REGISTERS[g][:1] + forward_v8.REGISTERS[g][2:])
           for g, (_, keep, _) in sorted(forward_v8.REGISTERS.items())]
    for g, keep in ((1, 56), (4, 24), (5, 40),
                    (int(rng.integers(1, 6)), int(rng.choice([24, 32])))):
        out.append(Case(f"{g} consumers, the producer keeps {keep}",
                        (g, keep), _model_budget(g, keep)))
    return out


def register_budget(groups, keep):
    """Chapter 12: (cap, grow) of a warp-specialized block of one producer
    warpgroup and `groups` consumer warpgroups.

    The kernel is built with `cap` registers a thread: the most, a
    multiple of 8, for which the whole block fits one SM's 65,536. At its
    start the producer's 128 threads keep `keep` (setmaxnreg.dec) and
    each consumer thread takes `grow` (setmaxnreg.inc): the most, a
    multiple of 8 and at most 256, that the block's own registers cover.
    """
    threads = 128 * (groups + 1)
    cap = _SM_REGISTERS // threads // 8 * 8
    left = cap * threads - 128 * keep
    return cap, min(256, left // (128 * groups) // 8 * 8)


def _budget_unrounded(groups, keep):
    threads = 128 * (groups + 1)
    cap = _SM_REGISTERS // threads
    return cap, min(256, (cap * threads - 128 * keep) // (128 * groups))


def _budget_no_producer(groups, keep):
    threads = 128 * (groups + 1)
    cap = _SM_REGISTERS // threads // 8 * 8
    return cap, min(256, cap * threads // (128 * groups) // 8 * 8)


def _budget_uncapped(groups, keep):
    threads = 128 * (groups + 1)
    cap = _SM_REGISTERS // threads // 8 * 8
    return cap, (cap * threads - 128 * keep) // (128 * groups) // 8 * 8


register("register_budget", Exercise(
    12, "register_budget(groups, keep) -> (cap, grow): the registers a "
    "thread a block of one producer and `groups` consumer warpgroups is "
    "built with, and what each consumer thread takes once the producer "
    "keeps `keep`",
    _cases_register_budget, register_budget,
    (("registers are allocated in 8s: round the cap (and what a consumer "
      "takes) down to a multiple of 8", _budget_unrounded),
     ("setmaxnreg moves the block's own registers: the producer's 128 "
      "threads keep theirs, and only the rest go to the consumers",
      _budget_no_producer),
     ("setmaxnreg takes at most 256 registers a thread",
      _budget_uncapped))))

# ---------------------------------------------------------- ds_tile_place


def _model_ds_places(t, kp, r):
    """Byte offsets from the models: the A fragment place of register r
    (fragments.wgmma_a_places), in warpgroup t // 128's rows of a
    one-panel 128-byte-swizzled tile (fragments.panel_offset)."""
    places = fragments.wgmma_a_places()[t % 128, r, 0]  # (n, 2) half 0
    rows = 64 * (t // 128) + places[:, 0]
    cols = 16 * kp + places[:, 1]
    return np.array([fragments.panel_offset(int(a), int(c) // 8, 128)
                     for a, c in zip(rows, cols)]) + 2 * (cols % 8)


def _cases_ds_tile_place(rng):
    t, kp, r = (x.ravel() for x in np.meshgrid(
        np.arange(256), np.arange(4), np.arange(4), indexing="ij"))
    out = [Case("every register of both warpgroups", (t, kp, r),
                _model_ds_places(t, kp, r))]
    t, kp, r = (rng.integers(0, n, 20) for n in (256, 4, 4))
    out.append(Case("random registers", (t, kp, r),
                    _model_ds_places(t, kp, r)))
    return out


def ds_tile_place(t, kp, r):
    """Chapter 12: byte offsets (n,) in the fused backward's dS^T tile
    (128 keys x 64 queries, one panel, 128-byte swizzled) of the pair
    that A register r of k-step kp of thread t holds.

    Warpgroup t // 128 owns keys 64 on; in it, warp w's rows 16 w + G and
    16 w + G + 8 (registers r % 2 = 0, 1) and columns 16 kp + 2 t' and 8
    more (r // 2), where lane = 4 G + t'. Row `row`'s chunk c lies at
    chunk c ^ (row % 8) of its 128 bytes.
    """
    warp, lane = (t % 128) // 32, t % 32
    row = 64 * (t // 128) + 16 * warp + lane // 4 + 8 * (r % 2)
    chunk = 2 * kp + r // 2
    return 128 * row + 16 * (chunk ^ (row % 8)) + 4 * (lane % 4)


def _ds_place_one_warpgroup(t, kp, r):
    warp, lane = (t % 128) // 32, t % 32
    row = 16 * warp + lane // 4 + 8 * (r % 2)
    chunk = 2 * kp + r // 2
    return 128 * row + 16 * (chunk ^ (row % 8)) + 4 * (lane % 4)


def _ds_place_unswizzled(t, kp, r):
    warp, lane = (t % 128) // 32, t % 32
    row = 64 * (t // 128) + 16 * warp + lane // 4 + 8 * (r % 2)
    return 128 * row + 16 * (2 * kp + r // 2) + 4 * (lane % 4)


def _ds_place_bits_swapped(t, kp, r):
    warp, lane = (t % 128) // 32, t % 32
    row = 64 * (t // 128) + 16 * warp + lane // 4 + 8 * (r // 2)
    chunk = 2 * kp + r % 2
    return 128 * row + 16 * (chunk ^ (row % 8)) + 4 * (lane % 4)


def _ds_place_half_pairs(t, kp, r):
    warp, lane = (t % 128) // 32, t % 32
    row = 64 * (t // 128) + 16 * warp + lane // 4 + 8 * (r % 2)
    chunk = 2 * kp + r // 2
    return 128 * row + 16 * (chunk ^ (row % 8)) + 2 * (lane % 4)


register("ds_tile_place", Exercise(
    12, "ds_tile_place(t (n,), kp (n,), r (n,)) -> int array (n,): the "
    "byte offset in the fused backward's swizzled dS^T tile (128 keys x "
    "64 queries) of the pair in A register r of k-step kp of thread t",
    _cases_ds_tile_place, ds_tile_place,
    (("the block's two warpgroups own 64 keys each: thread t's rows start "
      "at 64 (t // 128)", _ds_place_one_warpgroup),
     ("the tile is 128-byte swizzled: chunk c of a row sits at c ^ (row % "
      "8)", _ds_place_unswizzled),
     ("in an A fragment, registers 1 and 3 are 8 rows down and 2 and 3 "
      "8 columns on (r % 2 picks the row, r // 2 the column half)",
      _ds_place_bits_swapped),
     ("a register holds a pair of 16-bit values: lane t' of its quad "
      "starts 4 t' bytes into the chunk", _ds_place_half_pairs))))

# ------------------------------------------------------ dq_stage_place


def _model_dq_stage(t, n, h):
    """Byte offsets from the models: the place of registers 4 n + 2 h of
    a 64 x 64 accumulator (fragments.wgmma_c_places; warpgroup n // 4's
    64 x 32 one is its columns 32 (n // 4) on), where TMA's 128-byte
    swizzle lays that float32 of a box of 32 columns
    (fragments.swizzle_address), boxes one after another."""
    places = fragments.wgmma_c_places(64)[t, 4 * n + 2 * h]  # (n, 2)
    rows, cols = places[:, 0], places[:, 1]
    inside = fragments.swizzle_address(128 * rows + 4 * (cols % 32))
    return (cols // 32) * 64 * 128 + inside


def _cases_dq_stage_place(rng):
    t, n, h = (x.ravel() for x in np.meshgrid(
        np.arange(128), np.arange(8), np.arange(2), indexing="ij"))
    out = [Case("every pair of both warpgroups", (t, n, h),
                _model_dq_stage(t, n, h))]
    t, n, h = (rng.integers(0, k, 20) for k in (128, 8, 2))
    out.append(Case("random pairs", (t, n, h), _model_dq_stage(t, n, h)))
    return out


def dq_stage_place(t, n, h):
    """Chapter 12: byte offsets (m,) where backward v8's fused kernel
    stages, for TMA to add, the float32 pair of n-tile n (0..7), row half
    h, of a 64 x 64 dQ_i tile, held by thread t (0..127) of warpgroup
    n // 4: warpgroup c forms dQ_i's columns 32 c to 32 c + 31, and n is
    its accumulator's n-tile n % 4.

    The pair is row 16 w + G + 8 h, columns 8 n + 2 t' and one more
    (warp w of the warpgroup, lane 4 G + t'). The tile is two boxes of 32
    columns (8 KiB each, one after the other; box c is warpgroup c's),
    each row 128 bytes with its 16-byte chunk k at k ^ (row % 8), as
    TMA's 128-byte swizzle lays a box.
    """
    warp, lane = t // 32, t % 32
    row = 16 * warp + lane // 4 + 8 * h
    col = 8 * (n % 4) + 2 * (lane % 4)  # within box n // 4
    return 64 * 128 * (n // 4) + 128 * row + \
        16 * ((col // 4) ^ (row % 8)) + 4 * (col % 4)


def _stage_one_box(t, n, h):
    warp, lane = t // 32, t % 32
    row = 16 * warp + lane // 4 + 8 * h
    col = 8 * n + 2 * (lane % 4)
    return 256 * row + 16 * ((col // 4) ^ (row % 8)) + 4 * (col % 4)


def _stage_unswizzled(t, n, h):
    warp, lane = t // 32, t % 32
    row = 16 * warp + lane // 4 + 8 * h
    col = 8 * (n % 4) + 2 * (lane % 4)
    return 64 * 128 * (n // 4) + 128 * row + 4 * col


def _stage_h_as_column(t, n, h):
    warp, lane = t // 32, t % 32
    row = 16 * warp + lane // 4
    col = 8 * (n % 4) + 2 * (lane % 4) + h
    return 64 * 128 * (n // 4) + 128 * row + \
        16 * ((col // 4) ^ (row % 8)) + 4 * (col % 4)


def _stage_two_byte_values(t, n, h):
    warp, lane = t // 32, t % 32
    row = 16 * warp + lane // 4 + 8 * h
    col = 8 * (n % 4) + 2 * (lane % 4)
    return 64 * 128 * (n // 4) + 128 * row + \
        16 * ((col // 8) ^ (row % 8)) + 2 * (col % 8)


register("dq_stage_place", Exercise(
    12, "dq_stage_place(t (m,), n (m,), h (m,)) -> int array (m,): the "
    "byte offset where backward v8's fused kernel stages the float32 "
    "pair of n-tile n (0..7), row half h, of a 64 x 64 dQ_i tile, held "
    "by thread t of warpgroup n // 4 (its n-tile n % 4), in two "
    "128-byte-swizzled TMA boxes of 32 columns",
    _cases_dq_stage_place, dq_stage_place,
    (("a TMA box is 128 bytes wide, 32 float32 columns: warpgroup 1's "
      "columns, n-tiles 4 to 7, go to the second box, 8 KiB on",
      _stage_one_box),
     ("TMA lays a box 128-byte swizzled: chunk c of a row sits at c ^ "
      "(row % 8)", _stage_unswizzled),
     ("h is the row half: registers 2 and 3 of an n-tile are 8 rows "
      "down, not the next column", _stage_h_as_column),
     ("dQ is staged in float32: 4 bytes a value, 4 values a 16-byte "
      "chunk", _stage_two_byte_values))))

# ---------------------------------------------------------- full_tiles


def _cases_full_tiles(rng):
    out = []
    for name, nq, nk, causal, window, kv in (
            ("no rule: every tile but a ragged last one", 300, 1000,
             False, None, None),
            ("causal, a block on the diagonal", 1000, 1000, True, None,
             None),
            ("causal from the bottom right, fewer queries than keys", 200,
             900, "bottom_right", None, None),
            ("a window of 300 keys back, 40 ahead", 1200, 1200, False,
             (300, 40), None),
            ("causal with a window of 500 back", 2000, 2000, True,
             (500, 0), None),
            ("padding: 700 valid keys of 1024", 512, 1024, False, None,
             700)):
        rules = masks.rules(causal, window, None, None, (), nq, nk).index()
        kv_len = nk if kv is None else kv
        # a block where each bound falls inside it, then a random one
        fixed = (64, 128, 64) if nq < 640 else (512, 128, 64)
        br, bc = int(rng.choice([64, 128, 192])), int(rng.choice([64, 128]))
        drawn = (int(rng.integers(0, nq // br)) * br, br, bc)
        for i0, br, bc in (fixed, drawn):
            i1 = min(i0 + br, nq)
            args = (i0, i1, nk, bc, bool(rules.causal), int(rules.offset),
                    int(rules.left), int(rules.right), kv_len)
            lo, hi = masks.full_run(i0, i1, 0, -(-nk // bc) - 1, nk, bc,
                                    rules, kv_len)
            out.append(Case(f"{name} (rows {i0}..{i1 - 1}, {bc} keys a "
                            "tile)", args, np.arange(lo, hi + 1)))
    return out


def full_tiles(i0, i1, nk, bc, causal, offset, left, right, kv_len):
    """Chapter 12: the tiles of bc keys (tile t holds keys t bc..t bc +
    bc - 1) whose every pair with query rows i0..i1-1 is allowed, as an
    array of tile indices, from the bounds at once (no scan).

    Key j is allowed for row i where j <= i + offset (causal), j >= i +
    offset - left and j <= i + offset + right (a window side, where it
    is >= 0) and j < kv_len. A whole tile is allowed for every row when
    it is for the row that allows least on each side: its first key
    against the last row's lower bound, its last key against the first
    row's upper bounds; and a ragged last tile (past nk) is never full.
    """
    first = 0
    if left >= 0:  # j0 >= (i1 - 1) + offset - left
        first = max(first, i1 - 1 + offset - left)
    last_key = min(nk, kv_len) - 1  # every key below nk and kv_len
    if causal:
        last_key = min(last_key, i0 + offset)
    if right >= 0:
        last_key = min(last_key, i0 + offset + right)
    lo = -(-first // bc)  # the first tile starting at or after `first`
    hi = (last_key + 1) // bc - 1  # the last tile ending by last_key
    return np.arange(lo, max(hi, lo - 1) + 1)


def _full_last_row_causal(i0, i1, nk, bc, causal, offset, left, right,
                          kv_len):
    return full_tiles(i1 - 1, i1, nk, bc, causal, offset, left, right,
                      kv_len) if causal else full_tiles(
        i0, i1, nk, bc, causal, offset, left, right, kv_len)


def _full_ragged_counts(i0, i1, nk, bc, causal, offset, left, right,
                        kv_len):
    padded = -(-nk // bc) * bc  # the last tile as if it were whole
    return full_tiles(i0, i1, padded, bc, causal, offset, left, right,
                      kv_len if kv_len < nk else padded)


def _full_window_first_row(i0, i1, nk, bc, causal, offset, left, right,
                           kv_len):
    return full_tiles(i0, i0 + 1, nk, bc, causal, offset, left, right,
                      kv_len) if left >= 0 and not causal else full_tiles(
        i0, i1, nk, bc, causal, offset, left, right, kv_len)


register("full_tiles", Exercise(
    12, "full_tiles(i0, i1, nk, bc, causal, offset, left, right, kv_len) "
    "-> int array: the tiles of bc keys that need no mask for query rows "
    "i0..i1-1 (the run forward v8 finds once a block), from the bounds "
    "at once",
    _cases_full_tiles, full_tiles,
    (("under a causal mask the first row allows the fewest keys: test "
      "the tile's last key against row i0, not i1 - 1",
      _full_last_row_causal),
     ("a ragged last tile reaches past nk: its missing keys are masked, "
      "so it is never full", _full_ragged_counts),
     ("a window's lower bound is tightest for the last row: the tile's "
      "first key must reach i1 - 1 + offset - left",
      _full_window_first_row))))

# ---------------------------------------------------------- exp2_cubic


def _cases_exp2_cubic(rng):
    whole = rng.integers(-126, 1, 200).astype(np.float64)
    return [Case(name, (t,), exp2_cubic(t)) for name, t in (
        ("a grid over [-126, 0]", np.linspace(-126, 0, 1001)),
        ("just either side of integers",
         whole + rng.uniform(-1e-6, 1e-6, whole.size)),
        ("scores of a softmax row, shifted by its maximum",
         -np.abs(rng.standard_normal(300)) * 8),
        ("masked, non-finite and tiny",
         np.array([-np.inf, np.nan, 0.0, -0.0, -126.0, -126.5, -127.0,
                   -1000.0, -1e-12])))]


def exp2_cubic(t):
    """Chapter 12: 2**t by flashlab.exp2's steps, in float64: t raised to
    -127 (NaN stays NaN), j = floor(t), f = t - j in [0, 1), 2**f by the
    cubic 1 + f (c1 + f (c2 + f c3)) with exp2.COEFFS, times 2**j, where
    2**-127 counts as 0 (its float32 bits are 0).
    """
    t = np.maximum(t, -127.0)  # a masked score (-inf) weighs 0; NaN stays
    j = np.floor(t)
    f = t - j
    c1, c2, c3 = (float(c) for c in exp2.COEFFS)
    p = 1 + f * (c1 + f * (c2 + f * c3))  # Horner: highest power inside
    return np.where(j <= -127, 0.0, p * np.exp2(j))


def _cubic_unclamped(t):
    j = np.floor(t)
    f = t - j
    c1, c2, c3 = (float(c) for c in exp2.COEFFS)
    return (1 + f * (c1 + f * (c2 + f * c3))) * np.exp2(j)


def _cubic_rounded(t):
    t = np.maximum(t, -127.0)
    j = np.round(t)
    f = t - j
    c1, c2, c3 = (float(c) for c in exp2.COEFFS)
    return np.where(j <= -127, 0.0, (1 + f * (c1 + f * (c2 + f * c3)))
                    * np.exp2(j))


def _cubic_reversed(t):
    t = np.maximum(t, -127.0)
    j = np.floor(t)
    f = t - j
    c1, c2, c3 = (float(c) for c in exp2.COEFFS)
    return np.where(j <= -127, 0.0, (1 + f * (c3 + f * (c2 + f * c1)))
                    * np.exp2(j))


register("exp2_cubic", Exercise(
    12, "exp2_cubic(t (n,) float64) -> (n,) float64: 2**t as v8's e4m3 "
    "kernel computes part of its exponentials, by flashlab.exp2's steps "
    "(its COEFFS c1, c2, c3), in float64",
    _cases_exp2_cubic, exp2_cubic,
    (("raise t to -127 before the floor: floor(-inf) is -inf, and -inf - "
      "(-inf) is NaN, where a masked score must weigh 0",
      _cubic_unclamped),
     ("j is the floor of t, so that f lies in [0, 1), where the cubic "
      "was fit; rounding to nearest puts f in [-1/2, 1/2)",
      _cubic_rounded),
     ("Horner's rule nests the highest power innermost: 1 + f (c1 + f "
      "(c2 + f c3)), c1 the linear term", _cubic_reversed))))

# ----------------------------------------------------- dispatch_finish


def _cases_dispatch_finish(rng):
    causal = np.arange(32, 0, -1, dtype=np.float64)  # 4K, 128-row blocks
    drawn = rng.integers(1, 60, 700).astype(np.float64)
    return [Case(name, (works, sms), order.finish(works, sms))
            for name, works, sms in (
                ("causal, head by head: 16 heads of 32 ranks, 132 SMs",
                 np.tile(causal, 16), 132),
                ("causal, rank by rank: the same blocks, longest first",
                 np.repeat(causal, 16), 132),
                ("fewer blocks than SMs", np.array([5.0, 9.0, 2.0]), 8),
                ("ties: equal blocks, 2.5 waves", np.full(20, 3.0), 8),
                ("random works on 7 SMs", drawn, 7),
                ("one SM: the sum", drawn[:50], 1))]


def dispatch_finish(works, sms):
    """Chapter 12: when the last of `sms` SMs is done, blocks of `works`
    started in the order given, each on the SM that frees first (one
    block an SM at a time; ties to any)."""
    ends = np.zeros(sms)  # when each SM frees
    for work in works:
        ends[np.argmin(ends)] += work  # the first free SM takes it
    return float(ends.max())


def _dispatch_round_robin(works, sms):
    ends = np.zeros(sms)
    for i, work in enumerate(works):
        ends[i % sms] += work
    return float(ends.max())


def _dispatch_sorted(works, sms):
    return dispatch_finish(np.sort(works)[::-1], sms)


def _dispatch_even_share(works, sms):
    return float(np.sum(works)) / sms


register("dispatch_finish", Exercise(
    12, "dispatch_finish(works (n,) float64, sms int) -> float: when the "
    "last SM is done, the blocks started in order, each on the SM that "
    "frees first (flashlab.order's model of a launch)",
    _cases_dispatch_finish, dispatch_finish,
    (("a block goes to whichever SM frees first, not to the next SM in "
      "turn: short blocks free their SMs early", _dispatch_round_robin),
     ("the blocks start in the order given; longest first is an order "
      "the grid's layout must make, the GPU does not sort",
      _dispatch_sorted),
     ("sum / sms is the even share, a bound: the answer is when the last "
      "SM finishes", _dispatch_even_share))))

# ------------------------------------------------------------- dq_turn


def _cases_dq_turn(rng):
    out = []
    for name, nq, nk, causal, window, kv in (
            ("no rule: every block adds, rank by rank", 300, 1000, False,
             None, None),
            ("causal: the blocks up to the diagonal", 1000, 1000, True,
             None, None),
            ("causal from the bottom right, fewer queries than keys", 200,
             900, "bottom_right", None, None),
            ("a window of 300 keys back: the run starts past rank 0", 1200,
             1200, False, (300, 40), None),
            ("padding: 700 valid keys of 1024", 512, 1024, False, None,
             700)):
        rules = masks.rules(causal, window, None, None, (), nq, nk).index()
        kv_len = nk if kv is None else kv
        bk, bq = 128, 64  # backward v9's key blocks and query tiles
        for _ in range(4):
            i0 = int(rng.integers(0, -(-nq // bq))) * bq
            i1 = min(i0 + bq, nq)
            first, last = masks.tile_range(i0, i1, nk, bk, rules, kv_len)
            blocks = -(-nk // bk)
            for rank in (first, last, last + 1, first - 1,
                         int(rng.integers(0, blocks))):
                if not 0 <= rank < blocks:  # past either end: any block
                    rank = int(rng.integers(0, blocks))
                want = rank - first if first <= rank <= last else -1
                args = (rank, i0, i1, nk, bk, bool(rules.causal),
                        int(rules.offset), int(rules.left),
                        int(rules.right), kv_len)
                out.append(Case(f"{name} (rank {rank}, rows {i0}..{i1 - 1})",
                                args, want))
    return out


def dq_turn(rank, i0, i1, nk, bk, causal, offset, left, right, kv_len):
    """Chapter 12: backward v9's turn of key block `rank` (keys rank bk ..
    rank bk + bk - 1) at the dQ tile of query rows i0..i1-1: how many key
    blocks add to that tile before it, or -1 where it adds nothing.

    Key j is allowed for row i where j <= i + offset (causal), j >= i +
    offset - left and j <= i + offset + right (a window side, where it
    is >= 0) and j < kv_len. The blocks with an allowed pair are a run
    of ranks: from the one holding the first row's lowest allowed key to
    the one holding the last row's highest, and they add in rank order.
    """
    hi = min(nk, kv_len) - 1  # the highest key any row may see
    if causal:
        hi = min(hi, i1 - 1 + offset)
    if right >= 0:
        hi = min(hi, i1 - 1 + offset + right)
    lo = 0  # the lowest
    if left >= 0:
        lo = max(lo, i0 + offset - left)
    first, last = lo // bk, hi // bk  # floors: hi may be below 0
    if lo >= nk or not first <= rank <= last:
        return -1
    return rank - first


def _turn_by_rank(rank, i0, i1, nk, bk, causal, offset, left, right,
                  kv_len):
    turn = dq_turn(rank, i0, i1, nk, bk, causal, offset, left, right,
                   kv_len)
    return rank if turn >= 0 else -1


def _turn_first_row(rank, i0, i1, nk, bk, causal, offset, left, right,
                    kv_len):
    return dq_turn(rank, i0, i0 + 1, nk, bk, causal, offset, left, right,
                   kv_len) if causal else dq_turn(
        rank, i0, i1, nk, bk, causal, offset, left, right, kv_len)


def _turn_always(rank, i0, i1, nk, bk, causal, offset, left, right,
                 kv_len):
    lo = max(0, i0 + offset - left) if left >= 0 else 0
    return rank - lo // bk


register("dq_turn", Exercise(
    12, "dq_turn(rank, i0, i1, nk, bk, causal, offset, left, right, "
    "kv_len) -> int: how many key blocks add to the dQ tile of rows "
    "i0..i1-1 before block `rank` does in backward v9 (its count's value "
    "when the block's turn comes), -1 where the block adds nothing",
    _cases_dq_turn, dq_turn,
    (("the blocks that add to a tile need not start at rank 0: a window "
      "leaves out the keys below the first row's lowest", _turn_by_rank),
     ("under a causal mask the last row reaches the highest key: the run "
      "ends at the block holding key i1 - 1 + offset", _turn_first_row),
     ("a block outside the run adds nothing: it takes no turn (-1)",
      _turn_always))))

# ------------------------------------------------------- dq_needs_zeros


def _cases_dq_needs_zeros(rng):
    # (name, nq, nk, causal, offset as "top_left" 0 or "bottom_right"
    # nk - nq, window)
    named = [
        ("no rule: every row sees every key", 300, 700, False, "top_left",
         None),
        ("causal, as many queries as keys", 1000, 1000, True, "top_left",
         None),
        ("causal from the bottom right, more queries than keys: the first "
         "two tiles see nothing", 200, 70, True, "bottom_right", None),
        ("causal from the bottom right: the first tile's last rows see "
         "keys", 100, 40, True, "bottom_right", None),
        ("a window of 20 keys back, top left, more queries than keys: the "
         "last rows see nothing", 1000, 129, False, "top_left", (20, None)),
        ("a window 5 keys ahead, bottom right", 300, 100, False,
         "bottom_right", (None, 5)),
        ("a single query and key", 1, 1, True, "bottom_right", None)]
    for _ in range(8):
        nq, nk = (int(x) for x in rng.integers(1, 700, 2))
        window = (None, (int(rng.integers(0, 200)), None),
                  (None, int(rng.integers(0, 200))))[int(rng.integers(3))]
        named.append((f"random: {nq} queries, {nk} keys", nq, nk,
                      bool(rng.integers(2)),
                      ("top_left", "bottom_right")[int(rng.integers(2))],
                      window))
    out = []
    for name, nq, nk, causal, align, window in named:
        offset = nk - nq if align == "bottom_right" else 0
        rules = masks.Rules(causal, offset, window, None, None)
        empty = rules.empty_rows((), nq, nk)  # row by row, independently
        want = any(empty[i0:i0 + 64].all() for i0 in range(0, nq, 64))
        left, right = rules.index().left, rules.index().right
        out.append(Case(name, (nq, nk, 64, causal, offset, left, right),
                        want))
    return out


def dq_needs_zeros(nq, nk, bq, causal, offset, left, right):
    """Chapter 12: whether backward v9's float32 dQ must start as zeros,
    every key valid: some tile of bq query rows (rows i0..i0 + bq - 1)
    has no allowed key at all, so no key block takes a turn there and no
    first turn stores it. Key j is allowed for row i where j <= i +
    offset (causal), j >= i + offset - left and j <= i + offset + right
    (a window side, where it is >= 0), and j < nk.

    The tile's allowed keys, over all its rows, run from its first row's
    lowest to its last row's highest, with no gap (the windows of
    neighbouring rows overlap), so the key blocks' size does not enter.
    """
    for i0 in range(0, nq, bq):
        i1 = min(i0 + bq, nq)
        hi = nk - 1  # the tile's highest allowed key ...
        if causal:
            hi = min(hi, i1 - 1 + offset)
        if right >= 0:
            hi = min(hi, i1 - 1 + offset + right)
        lo = max(0, i0 + offset - left) if left >= 0 else 0  # ... lowest
        if lo > hi:
            return True
    return False


def _zeros_never(nq, nk, bq, causal, offset, left, right):
    return False


def _zeros_by_row(nq, nk, bq, causal, offset, left, right):
    # any row without keys, not any tile
    return dq_needs_zeros(nq, nk, 1, causal, offset, left, right)


def _zeros_first_tile(nq, nk, bq, causal, offset, left, right):
    return dq_needs_zeros(min(nq, bq), nk, bq, causal, offset, left, right)


register("dq_needs_zeros", Exercise(
    12, "dq_needs_zeros(nq, nk, bq, causal, offset, left, right) -> bool: "
    "whether backward v9's float32 dQ must be zeroed before the kernel "
    "(every key valid), because some tile of bq query rows has no key "
    "block whose first turn would store it",
    _cases_dq_needs_zeros, dq_needs_zeros,
    (("the first turn stores the whole tile, zeros in its rows without "
      "keys: only a tile with no allowed key at all needs them",
      _zeros_by_row),
     ("a window that ends behind the diagonal leaves the last rows "
      "without keys when queries outnumber keys", _zeros_first_tile),
     ("a bottom-right mask with more queries than keys leaves the first "
      "rows without keys", _zeros_never))))

# --------------------------------------------------------- handed_back


def _cases_handed_back(rng):
    # blocks of 192 rows (forward v8 at d = 64: three warpgroups of 64),
    # tiles of 128 keys, each warpgroup's own_last as the kernel finds it
    out = []
    for name, nq, nk, causal, kv in (
            ("causal, square", 1000, 1000, True, None),
            ("bottom right, more queries than keys: whole blocks without "
             "keys", 1024, 700, "bottom_right", None),
            ("bottom right, fewer queries than keys", 300, 1030,
             "bottom_right", None),
            ("no mask, padding: 0 valid keys", 500, 700, False, 0),
            ("causal, padding: 333 valid keys", 900, 700, True, 333)):
        rules = masks.rules(causal, None, None, None, (), nq, nk).index()
        kv_len = nk if kv is None else kv
        for i0 in range(0, nq, 192):
            first, last = masks.tile_range(i0, min(i0 + 192, nq), nk, 128,
                                           rules, kv_len)
            for g in range(3):
                r0, r1 = i0 + 64 * g, min(i0 + 64 * g + 64, nq)
                own = min(last, masks.last_tile(r1, nk, 128, rules,
                                                kv_len)) \
                    if r0 < r1 else first - 1
                want = np.arange(max(own + 1, first), last + 1)
                out.append(Case(f"{name}: rows {i0}.., warpgroup {g}",
                                (first, last, own), want))
    for _ in range(6):  # and bounds of any size
        first = int(rng.integers(0, 50))
        last = first + int(rng.integers(-1, 50))
        own = int(rng.integers(first - 1, last + 1))
        out.append(Case(f"random: tiles {first}..{last}, own {own}",
                        (first, last, own),
                        np.arange(own + 1, last + 1)))
    return out


def handed_back(first, last, own_last):
    """Chapter 12: the tiles a consumer warpgroup of forward v8 waits for
    only to hand back unread: those of its block's run first..last past
    the last tile its own rows reach, own_last.

    A block that visits no tile has first > last (masks.tile_range gives
    (tiles, tiles - 1)), and a warpgroup whose rows see no key has
    own_last -1 (masks.last_tile), or first - 1 where it has no rows.
    """
    return np.arange(max(own_last + 1, first), last + 1)


def _handed_from_own(first, last, own_last):
    return np.arange(own_last + 1, last + 1)


def _handed_every(first, last, own_last):
    return np.arange(first, last + 1)


def _handed_short(first, last, own_last):
    return np.arange(max(own_last + 1, first), last)


register("handed_back", Exercise(
    12, "handed_back(first, last, own_last) -> (n,) int: the tiles a "
    "consumer warpgroup of forward v8 waits for only to hand back, past "
    "its own last tile in its block's run first..last",
    _cases_handed_back, handed_back,
    (("a block that visits no tile has first > last and nothing to hand "
      "back; counting from own_last + 1 = 0 waits for copies that never "
      "come (the kernel hangs)", _handed_from_own),
     ("the tiles up to own_last are the warpgroup's own: it multiplies "
      "them, it does not hand them back", _handed_every),
     ("the run includes its last tile: first..last inclusive",
      _handed_short))))

# ------------------------------------------------------- row_dot_reader


def _row_dot_readers(rows, d_v, warps):
    """{(row, piece): (warp, turn, u, lane)} from fragments.row_dot_place,
    the kernel's own map, over every lane of a grid of `warps` warps."""
    lanes = fragments.row_dot_lanes(d_v)
    out = {}
    for w in range(warps):
        turn = 0
        while fragments.row_dot_place(w, turn, 0, 0, lanes, warps)[0] < rows:
            for u in range(fragments.ROW_DOT_UNROLL):
                for lane in range(32):
                    r, x = fragments.row_dot_place(w, turn, u, lane, lanes,
                                                   warps)
                    if r < rows and x < d_v // 8:
                        out[r, x] = (w, turn, u, lane)
            turn += 1
    return out


def _cases_row_dot_reader(rng):
    out = []
    for name, rows, d_v, warps in (
            ("d_v = 128, one warp", 70, 128, 1),
            ("d_v = 64, four warps (one block)", 200, 64, 4),
            ("d_v = 48: six pieces a row on eight lanes", 150, 48, 4),
            ("d_v = 112: fourteen pieces on sixteen lanes", 150, 112, 12),
            ("d_v = 16: sixteen rows a load", 500, 16, 3)):
        readers = _row_dot_readers(rows, d_v, warps)
        picks = [(0, 0), (rows - 1, d_v // 8 - 1)] + [
            (int(rng.integers(0, rows)), int(rng.integers(0, d_v // 8)))
            for _ in range(4)]
        for row, piece in picks:
            out.append(Case(f"{name}: row {row}, piece {piece}",
                            (row, piece, d_v, warps),
                            readers[row, piece]))
    return out


def row_dot_reader(row, piece, d_v, warps):
    """Chapter 12: (warp, turn, u, lane) of row_dot16 that loads 16-byte
    piece `piece` of row `row` (d_v 16-bit values a row), in a grid of
    `warps` warps: fragments.row_dot_place read backwards.

    A row's pieces go to row_dot_lanes(d_v) lanes (a power of two), so
    one load of a warp covers 32 / lanes rows; a lane's
    fragments.ROW_DOT_UNROLL loads take the next rows, and then the
    grid's next warp, until every warp has had its turn.
    """
    lanes = fragments.row_dot_lanes(d_v)
    per_load = 32 // lanes
    group, within = divmod(row, per_load * fragments.ROW_DOT_UNROLL)
    turn, warp = divmod(group, warps)
    u, sub = divmod(within, per_load)
    return warp, turn, u, sub * lanes + piece


def _reader_lanes_exact(row, piece, d_v, warps):
    lanes = d_v // 8
    per_load = 32 // lanes
    group, within = divmod(row, per_load * fragments.ROW_DOT_UNROLL)
    turn, warp = divmod(group, warps)
    u, sub = divmod(within, per_load)
    return warp, turn, u, sub * lanes + piece


def _reader_warp_major(row, piece, d_v, warps):
    lanes = fragments.row_dot_lanes(d_v)
    per_load = 32 // lanes
    group, within = divmod(row, per_load * fragments.ROW_DOT_UNROLL)
    warp, turn = divmod(group, warps)
    u, sub = divmod(within, per_load)
    return warp, turn, u, sub * lanes + piece


def _reader_loads_inner(row, piece, d_v, warps):
    lanes = fragments.row_dot_lanes(d_v)
    per_load = 32 // lanes
    group, within = divmod(row, per_load * fragments.ROW_DOT_UNROLL)
    turn, warp = divmod(group, warps)
    sub, u = divmod(within, fragments.ROW_DOT_UNROLL)
    return warp, turn, u, sub * lanes + piece


register("row_dot_reader", Exercise(
    12, "row_dot_reader(row, piece, d_v, warps) -> (warp, turn, u, "
    "lane): which lane of row_dot16 loads a 16-byte piece of a row, and "
    "when",
    _cases_row_dot_reader, row_dot_reader,
    (("a row's lanes are a power of two (their sums meet by shuffles): "
      "at d_v = 48 six pieces take eight lanes", _reader_lanes_exact),
     ("the grid's warps move on together: the next group of rows goes "
      "to the next warp, and a warp's next turn comes after every "
      "warp's", _reader_warp_major),
     ("one load of a warp covers 32 / lanes consecutive rows; its next "
      "load the rows after them", _reader_loads_inner))))

# -------------------------------------------------------- o_staged_place


def _o_staged_places(n_tiles):
    """{(row, col): (writer, offset, step, reader)} over a warp's 16 rows
    of O, n_tiles 8-column groups, from the kernel's own maps:
    fragments.c_places (who holds a pair), fragments.swizzled_offset
    (where it is staged) and fragments.staged_chunk (who reads it back,
    and when)."""
    places = fragments.c_places()  # (lane, element, (row, column))
    out = {}
    readers = {}
    for k in range(n_tiles // 2):
        for lane in range(32):
            readers[fragments.staged_chunk(k, lane, n_tiles)] = (k, lane)
    for lane in range(32):
        for e in range(4):
            r, c0 = (int(x) for x in places[lane, e])
            for n in range(n_tiles):
                col = 8 * n + c0
                offset = fragments.swizzled_offset(r, n, n_tiles) \
                    + 4 * (lane % 4) + 2 * (col % 2)
                out[r, col] = (lane, offset, *readers[r, n])
    return out


def _cases_o_staged_place(rng):
    out = []
    for d_v in (64, 128):
        places = _o_staged_places(d_v // 8)
        picks = [(0, 0), (15, d_v - 1), (8, 1), (7, 9)] + [
            (int(rng.integers(0, 16)), int(rng.integers(0, d_v)))
            for _ in range(4)]
        for row, col in picks:
            out.append(Case(f"d_v = {d_v}: row {row}, column {col}",
                            (row, col, d_v), places[row, col]))
    return out


def o_staged_place(row, col, d_v):
    """Chapter 12: (writer, offset, step, reader) of value (row, col) of a
    warp's 16 rows of O in forward v8's staged epilogue, d_v columns.

    The writer is the lane of the C fragment that holds it (4 (row mod 8)
    + its column's pair in the 8); it stages 16-bit pairs in rows of
    d_v / 8 chunks of 16 bytes, chunk c of row r at c XOR (r mod 8) (the
    tiles' swizzle), the odd column 2 bytes into its word. The warp reads
    the rows back as chunk lane + 32 step in row order.
    """
    per_row = d_v // 8  # 16-byte chunks of a row
    chunk, within = divmod(col, 8)
    writer = 4 * (row % 8) + within // 2
    offset = (row * per_row + (chunk ^ (row % 8))) * 16 + 2 * within
    step, reader = divmod(row * per_row + chunk, 32)
    return writer, offset, step, reader


def _staged_unswizzled(row, col, d_v):
    per_row = d_v // 8
    chunk, within = divmod(col, 8)
    step, reader = divmod(row * per_row + chunk, 32)
    return (4 * (row % 8) + within // 2, (row * per_row + chunk) * 16
            + 2 * within, step, reader)


def _staged_column_major(row, col, d_v):
    per_row = d_v // 8
    chunk, within = divmod(col, 8)
    step, reader = divmod(chunk * 16 + row, 32)
    return (4 * (row % 8) + within // 2,
            (row * per_row + (chunk ^ (row % 8))) * 16 + 2 * within, step,
            reader)


def _staged_word_only(row, col, d_v):
    per_row = d_v // 8
    chunk, within = divmod(col, 8)
    step, reader = divmod(row * per_row + chunk, 32)
    return (4 * (row % 8) + within // 2,
            (row * per_row + (chunk ^ (row % 8))) * 16 + 4 * (within // 2),
            step, reader)


register("o_staged_place", Exercise(
    12, "o_staged_place(row, col, d_v) -> (writer, offset, step, reader): "
    "which lane stages value (row, col) of a warp's 16 rows of O in "
    "forward v8's epilogue, at which byte, and which lane reads it back "
    "in which step",
    _cases_o_staged_place, o_staged_place,
    (("stored unswizzled, the 8 rows of one store of the warp sit in the "
      "same 4 banks: chunk c of row r goes to c XOR (r mod 8)",
      _staged_unswizzled),
     ("the warp reads the rows back in row order, 32 consecutive chunks "
      "a step, so each of its 16-byte stores writes whole rows",
      _staged_column_major),
     ("a word holds a pair: the odd column is its upper half, 2 bytes "
      "past the even one", _staged_word_only))))

# --------------------------------------------------------- o_stage_block


def _cases_o_stage_block(rng):
    # the blocks whose staging lies in Q_i's tile (forward_v8.stage_bytes
    # 0): two warpgroups at d = 128, d_v 128 or 64, and three at
    # d = d_v = 64. At d_v = 128 warpgroup 1 comes first: the warps
    # stacked back to back go wrong there before any other mistake does
    out = []
    for rows, d_v, groups in ((128, 128, 2), (128, 64, 2), (192, 64, 3)):
        for wg in reversed(range(groups)):
            for u in range(4):
                out.append(Case(
                    f"{rows} rows, d_v = {d_v}: warp {u} of warpgroup {wg}",
                    (u, wg, rows, d_v),
                    fragments.stage_place(u, wg, rows, 32 * d_v)))
    return out


def o_stage_block(u, wg, rows, d_v):
    """Chapter 12: the byte in forward v8's tile of Q_i (`rows` rows,
    128-byte-swizzled panels of 64 columns, each rows x 128 bytes) where
    warp u (0..3) of consumer warpgroup wg stages its 16 rows of O_i in
    the epilogue, 2 d_v bytes a row.

    Warpgroup wg's products read rows 64 wg .. 64 wg + 63 of every
    panel, 8192 bytes of it, which nobody reads once its last S product
    is done; its four warps fill those bytes in order, panel after panel.
    """
    staged = 16 * 2 * d_v  # a warp's 16 rows of O_i
    panel, within = divmod(u * staged, 64 * 128)
    return panel * rows * 128 + wg * 64 * 128 + within


def _stage_one_panel(u, wg, rows, d_v):
    return wg * 64 * 128 + u * 16 * 2 * d_v


def _stage_back_to_back(u, wg, rows, d_v):
    return (4 * wg + u) * 16 * 2 * d_v


register("o_stage_block", Exercise(
    12, "o_stage_block(u, wg, rows, d_v) -> byte: where in Q_i's tile "
    "warp u of consumer warpgroup wg stages its 16 rows of O_i in forward "
    "v8's epilogue",
    _cases_o_stage_block, o_stage_block,
    (("a warpgroup owns 8192 bytes of each panel (64 rows x 128 bytes); "
      "at d_v = 128 its warps need 16384, so warps 2 and 3 go on in the "
      "next panel, rows x 128 bytes further", _stage_one_panel),
     ("the tile is not row after row: a warpgroup's rows lie in every "
      "panel, 8192 bytes from wg 8192 on, so warpgroup 1 starts at byte "
      "8192 of each panel whatever d_v is", _stage_back_to_back))))

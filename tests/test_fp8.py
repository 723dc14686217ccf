"""e4m3: decoding, the satfinite cast against torch and by hand, scaling."""

import numpy as np
import pytest
import torch

from flashlab import fp8

CODES = np.arange(256).astype(np.uint8)
FINITE = CODES[(CODES & 0x7F) != fp8.NAN_CODE]  # 254 codes, +-0 included
POSITIVE = np.arange(fp8.MAX_CODE + 1).astype(np.uint8)  # 0 .. +448
EPS = 2.0**-53  # float64's unit roundoff


def torch_encode(x32):
    """torch's cast of float32 x to float8_e4m3fn, as uint8 codes."""
    t = torch.from_numpy(np.ascontiguousarray(x32, np.float32))
    return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def ties():
    """(127,) float64 midpoints of neighbouring values 0 .. 448, and 464.

    464 lies halfway from 448 to 480, the value E = 15, M = 7 would have
    if it were not NaN; every midpoint is exact in float32.
    """
    v = fp8.from_e4m3(POSITIVE).astype(np.float64)
    return np.append((v[:-1] + v[1:]) / 2, 464.0)


def samples(rng, n=4000):
    """float32 inputs: every region of the cast, both signs, fresh."""
    t = ties().astype(np.float32)
    parts = [
        rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n),
        np.exp2(rng.uniform(-12, np.log2(600), n)),  # log-uniform
        rng.uniform(0, 2.0**-6, n),  # subnormals
        np.arange(-40, 41) * 2.0**-10,  # subnormal values and ties
        t, np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(1e3)),
        [np.inf, np.nan, 0.0, 3.4e38, 1e-45, 2.0**-149, 449.0, 1e5],
    ]
    x = np.concatenate([np.asarray(p, np.float32) for p in parts])
    x = x * rng.choice(np.float32([-1, 1]), x.size)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([x, [np.float32(-0.0)], bits.view(np.float32)])
    return rng.permutation(x)


def test_every_code_decodes_as_torch():
    ref = torch.from_numpy(CODES).view(torch.float8_e4m3fn).float().numpy()
    got = fp8.from_e4m3(CODES)
    assert got.dtype == np.float32
    assert np.array_equal(got, ref, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(ref))  # -0.0 too


def test_decoding_by_hand():
    codes = [0x00, 0x01, 0x07, 0x08, 0x38, 0x39, 0x7E, 0xFE, 0x80, 0xB8]
    want = [0, 2**-9, 7 * 2**-9, 2**-6, 1, 1.125, 448, -448, -0.0, -1]
    got = fp8.from_e4m3(codes)
    assert np.array_equal(got, np.float32(want))
    assert np.signbit(got[8]) and got[6] == fp8.E4M3_MAX
    assert np.isnan(fp8.from_e4m3([0x7F, 0xFF])).all()


def test_cast_matches_torch(rng):
    x = samples(rng)
    got, ref = fp8.to_e4m3(x), torch_encode(x)
    assert got.dtype == np.uint8 and got.shape == x.shape
    # torch 2.13 saturates overflow and +-inf to +-448 as satfinite does
    # (so those are compared), but keeps a NaN's sign (0xFF), where the
    # cast writes 0x7F: NaN is compared by hand in the next test
    nan = np.isnan(x)
    assert (np.abs(x[~nan]) > fp8.E4M3_MAX).sum() > 10
    bad = np.flatnonzero((got != ref) & ~nan)
    assert bad.size == 0, (x[bad[:5]], got[bad[:5]], ref[bad[:5]])
    assert (got[nan] == fp8.NAN_CODE).all()
    assert (ref[nan] & 0x7F == fp8.NAN_CODE).all()


def test_saturation_nan_and_zero_by_hand():
    x = [448, 463.99, 464, 1e300, np.inf, -np.inf, -449, np.nan, -np.nan,
         0.0, -0.0, -2.0**-11, 2.0**-11]
    want = [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F, 0x7F,
            0x00, 0x80, 0x80, 0x00]
    assert fp8.to_e4m3(x).tolist() == want


def test_ties_round_to_even_by_hand():
    # units of 2^-10: k/2 steps of 2^-9; 7.5 steps is 2^-6 - 2^-10, the
    # tie between the largest subnormal (M = 7) and 2^-6 (code 8)
    x = np.array([1, 3, 5, 7, 15]) * 2.0**-10
    assert fp8.to_e4m3(x).tolist() == [0, 2, 2, 4, 8]
    # normal ties: 1 + 1/16 between 1 (0x38) and 1.125 (0x39); 1.1875
    # between 1.125 and 1.25 (0x3A); 15.5 * 2^4 between 240 and 256
    x = [1.0625, 1.1875, 248.0, -1.0625]
    assert fp8.to_e4m3(x).tolist() == [0x38, 0x3A, 0x78, 0xB8]


def nearest_even(x):
    """Codes of x (|x| <= 448) by search over all values: the nearest,
    the even code of two equally near (the rule, written another way)."""
    v = fp8.from_e4m3(POSITIVE).astype(np.float64)
    dist = np.abs(np.abs(x)[:, None] - v)  # (n, 127)
    near = dist == dist.min(axis=1, keepdims=True)
    even = near & (POSITIVE % 2 == 0)
    pick = np.where(near.sum(axis=1) > 1, even.argmax(1), near.argmax(1))
    return (pick | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def test_cast_is_nearest_ties_to_even(rng):
    n = 3000
    x = np.concatenate([
        rng.uniform(-448, 448, n),
        np.exp2(rng.uniform(-14, np.log2(448), n)),
        ties()[:-1], rng.uniform(-1, 1, n) * 2.0**-6,
    ])
    x = x * rng.choice([-1.0, 1.0], x.size)
    assert np.array_equal(fp8.to_e4m3(x), nearest_even(x))


def test_float64_input_is_rounded_once():
    # float32 would round 1.0625 + 2^-40 onto the tie, then to even (1.0)
    x = 1.0625 + 2.0**-40
    assert fp8.to_e4m3(np.float32(x)) == 0x38
    assert fp8.to_e4m3(x) == 0x39


def test_round_trip_every_finite_value():
    v = fp8.from_e4m3(FINITE)
    assert np.array_equal(fp8.to_e4m3(v), FINITE)  # -0.0 back to 0x80
    assert np.array_equal(fp8.to_e4m3(v.astype(np.float64)), FINITE)
    assert np.array_equal(fp8.from_e4m3(fp8.to_e4m3(v)), v)


def test_monotonic(rng):
    v = fp8.from_e4m3(POSITIVE)
    assert (np.diff(v) > 0).all()
    assert np.array_equal(fp8.from_e4m3(POSITIVE | 0x80), -v)
    x = samples(rng)
    x = np.sort(x[~np.isnan(x)])
    assert (np.diff(fp8.from_e4m3(fp8.to_e4m3(x))) >= 0).all()


def test_half_unit_by_hand():
    x = [0, 2.0**-7, 2.0**-6, 1, 1.99, 2, -3, 448, np.inf, np.nan]
    want = [2**-10, 2**-10, 2**-10, 2**-4, 2**-4, 2**-3, 2**-3, 16,
            np.inf, np.nan]
    got = fp8.half_unit(x)
    assert got.dtype == np.float64
    assert np.array_equal(got, want, equal_nan=True)


def test_error_within_half_unit_and_attained(rng):
    n = 10000
    x = np.concatenate([rng.uniform(-448, 448, n),
                        np.exp2(rng.uniform(-14, np.log2(460), n))])
    x = x * rng.choice([-1.0, 1.0], x.size)
    err = np.abs(fp8.from_e4m3(fp8.to_e4m3(x)) - x)
    assert (err <= fp8.half_unit(x)).all()
    t = ties()  # 464 too: it saturates to 448, half a unit (16) away
    err = np.abs(fp8.from_e4m3(fp8.to_e4m3(t)) - t)
    assert np.array_equal(err, fp8.half_unit(t))


def test_quantize_within_half_unit_times_descale(rng):
    n = 20000
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 4)
    x[rng.integers(n)] *= 50  # an outlier, as attention's inputs have
    codes, descale = fp8.quantize(x)
    assert codes.dtype == np.uint8 and isinstance(descale, float)
    assert descale == np.max(np.abs(x)) / 448
    got = fp8.dequantize(codes, descale)
    assert got.dtype == np.float64
    # half a unit of the scaled value, back in x's units, plus the two
    # float64 roundings (x / descale and code * descale), each 2^-53
    bound = descale * fp8.half_unit(x / descale) + 2 * EPS * np.abs(x)
    ratio = np.abs(got - x) / bound
    assert ratio.max() <= 1
    assert ratio.max() > 0.9  # the bound is tight, not a loose envelope


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantize_amax_lands_on_448(rng, dtype):
    x = (rng.standard_normal((3, 50)) * 10.0 ** rng.uniform(-30, 30))
    x = x.astype(dtype)
    i = np.unravel_index(np.argmax(np.abs(x)), x.shape)
    codes, descale = fp8.quantize(x)
    assert codes.shape == x.shape
    assert codes[i] == (0xFE if x[i] < 0 else 0x7E)
    assert (codes & 0x7F <= fp8.MAX_CODE).all()
    assert abs(fp8.dequantize(codes, descale)[i] - x[i]) <= 2 * EPS * abs(
        x[i])


def test_quantize_float32_smallest_subnormal():
    x = np.float32([1e-45, -1e-45, 0])  # float64 still holds amax / 448
    codes, descale = fp8.quantize(x)
    assert codes.tolist() == [0x7E, 0xFE, 0]
    assert np.array_equal(fp8.dequantize(codes, descale), x)


def test_quantize_all_zero():
    x = np.zeros((4, 5))
    x[1, 2] = -0.0
    codes, descale = fp8.quantize(x)
    assert descale == 1.0
    assert codes.tolist() == np.where(np.signbit(x), 0x80, 0).tolist()
    got = fp8.dequantize(codes, descale)
    assert np.array_equal(np.signbit(got), np.signbit(x)) and not got.any()
    assert fp8.quantize(np.zeros(0))[1] == 1.0


def test_quantize_non_finite_entries_are_nan(rng):
    x = rng.standard_normal((6, 40)) * 3
    bad = rng.random(x.shape) < 0.1
    bad[0, 0] = True
    y = x.copy()
    y[bad] = rng.choice([np.nan, np.inf, -np.inf], bad.sum())
    codes, descale = fp8.quantize(y)
    ref_codes, ref_descale = fp8.quantize(np.where(bad, 0.0, x))
    assert descale == ref_descale  # inf is not the amax
    assert (codes[bad] == fp8.NAN_CODE).all()  # not a saturated 448
    assert np.array_equal(codes[~bad], ref_codes[~bad])
    assert np.isnan(fp8.dequantize(codes, descale)[bad]).all()
    codes, descale = fp8.quantize([np.nan, -np.inf, 0.0])
    assert codes.tolist() == [0x7F, 0x7F, 0] and descale == 1.0


@pytest.mark.parametrize("call, error, name", [
    (lambda: fp8.to_e4m3(np.ones(3, complex)), TypeError, "x"),
    (lambda: fp8.to_e4m3(["a", "b"]), TypeError, "x"),
    (lambda: fp8.quantize(np.ones(3, complex)), TypeError, "x"),
    (lambda: fp8.quantize(np.array([True])), TypeError, "x"),
    (lambda: fp8.quantize(np.array([1], object)), TypeError, "x"),
    (lambda: fp8.quantize([1e-310]), ValueError, "x"),
    (lambda: fp8.half_unit(1j), TypeError, "x"),
    (lambda: fp8.from_e4m3([1.0]), TypeError, "codes"),
    (lambda: fp8.from_e4m3([256]), ValueError, "codes"),
    (lambda: fp8.dequantize([-1], 1.0), ValueError, "codes"),
    (lambda: fp8.dequantize([1], 0.0), ValueError, "descale"),
    (lambda: fp8.dequantize([1], -2.0), ValueError, "descale"),
    (lambda: fp8.dequantize([1], np.inf), ValueError, "descale"),
    (lambda: fp8.dequantize([1], np.nan), ValueError, "descale"),
    (lambda: fp8.dequantize([1], "1"), TypeError, "descale"),
    (lambda: fp8.dequantize([1], True), TypeError, "descale"),
])
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=f"^{name}: "):
        call()


def test_attention_fp8_names_what_is_wrong():
    # checked before any GPU is needed: descales, dtypes, head dims, device
    import torch

    from flashlab import gpu

    x = torch.zeros(2, 5, 128).to(torch.float8_e4m3fn)
    cases = [
        ((x, x, x), dict(descale_q=0.0), ValueError, "descale_q: expected a"),
        ((x, x, x), dict(descale_v=float("nan")), ValueError,
         "descale_v: expected a"),
        ((x, x, x), dict(descale_k=True), ValueError, "descale_k: "),
        ((x.float(), x, x), {}, TypeError,
         "q: expected a torch.float8_e4m3fn tensor, got torch.float32"),
        ((x, np.zeros((2, 5, 128)), x), {}, TypeError, "k: expected a"),
        ((x, x, x[..., :64]), {}, ValueError,
         r"v: expected shape \(\.\.\., N, d\) with d in \(128,\)"),
        ((x[0, 0], x, x), {}, ValueError, "q: expected shape"),
        ((x, x, x), {}, ValueError, "q: expected a CUDA tensor, got one "
         "on cpu"),
    ]
    for args, opts, error, message in cases:
        with pytest.raises(error, match="^" + message):
            gpu.attention_fp8(*args, **opts)


def test_gpu_quantize_matches_the_model(rng):
    # torch's float32 division then cast against the float64 model: the
    # same descale, codes equal away from ties (a tie may land one code
    # apart after the float32 rounding of x / descale)
    import torch

    from flashlab import gpu

    x = (rng.standard_normal((4, 300)) * 3).astype(np.float32)
    x[0, 0], x[1, 1] = np.nan, -np.inf
    x8, descale = gpu.quantize(torch.tensor(x))
    codes, want = fp8.quantize(x)
    assert descale == want
    got = x8.view(torch.uint8).numpy()
    assert got[0, 0] == got[1, 1] == fp8.NAN_CODE
    assert np.abs(got.astype(int) - codes.astype(int)).max() <= 1
    assert (got == codes).mean() > 0.99
    with pytest.raises(TypeError, match="^x: expected a floating-point"):
        gpu.quantize(torch.zeros(3, dtype=torch.int32))

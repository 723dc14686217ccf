"""e4m3, the 8-bit float of the fp8 forward, as numpy models it.

An e4m3 byte is a sign bit, 4 exponent bits E and 3 mantissa bits M:
(-1)^s (1 + M/8) 2^(E - 7) for E >= 1, and (-1)^s (M/8) 2^-6 for E = 0
(subnormals, spacing 2^-9 below the smallest normal 2^-6). It has no
infinity: E = 15 is an ordinary binade, except the codes 0x7F and 0xFF
with M = 7, which are NaN; the largest finite value is 1.75 * 2^8 = 448.
With 3 mantissa bits a value carries about one decimal digit, so the fp8
path scales each tensor to use the whole range before the cast: x / descale
with descale = amax / 448, and the kernel multiplies the descale back in.

`to_e4m3` is the cast the kernels issue (PTX `cvt.rn.satfinite`): round to
nearest, ties to even, everything beyond 448 saturated, NaN to 0x7F;
`from_e4m3` is exact. `quantize` and `dequantize` are the per-tensor
scaling. See chapter 12.
"""

import numbers

import numpy as np

E4M3_MAX = 448.0  # 1.75 * 2^8: E = 15, M = 6 (M = 7 is NaN)
EXPONENT_BIAS = 7
MANTISSA_BITS = 3
MIN_NORMAL = 2.0**-6  # E = 1; below it the spacing stays 2^-9
MAX_CODE = 0x7E  # +448; the sign bit 0x80 gives -448
NAN_CODE = 0x7F  # the NaN the cast writes; 0xFF is NaN too
SIGN_BIT = 0x80


def _e4m3_table():
    """(256,) float32 value of every code (NaN codes NaN)."""
    c = np.arange(256)
    e, m = (c >> MANTISSA_BITS) & 15, c & 7
    # E = 0 continues the spacing of E = 1 down to zero: no hidden 1
    mag = np.where(e == 0, np.ldexp(m, -9),
                   np.ldexp(8 + m, e - EXPONENT_BIAS - MANTISSA_BITS))
    mag = np.where(c & 0x7F == NAN_CODE, np.nan, mag)
    return np.where(c & SIGN_BIT, -mag, mag).astype(np.float32)


_TABLE = _e4m3_table()


def _as_real(name, x):
    """x as a float64 ndarray, or raise naming `name`."""
    arr = np.asarray(x)
    # float64 holds every float16/32/64 and every integer up to 2^53
    # exactly, so the one rounding is the cast to e4m3 itself
    if arr.dtype.kind not in "fiu" or arr.dtype.itemsize > 8:
        raise TypeError(
            f"{name}: expected real numbers (a float or integer array of "
            f"at most 64 bits), got dtype {arr.dtype}"
        )
    with np.errstate(invalid="ignore"):  # signalling NaNs stay NaN
        return arr.astype(np.float64)


def _as_codes(name, codes):
    """codes as a uint8 ndarray, or raise naming `name`."""
    arr = np.asarray(codes)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{name}: expected uint8 e4m3 codes, got dtype {arr.dtype}"
        )
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ValueError(
            f"{name}: expected e4m3 codes in 0..255, got values from "
            f"{arr.min()} to {arr.max()}"
        )
    return arr.astype(np.uint8)


def _binade(a):
    """floor(log2 a) for a >= 2^-6, -6 below (subnormals share its step)."""
    _, e = np.frexp(a)  # exact: a = f 2^e with 0.5 <= f < 1
    return np.where(a >= MIN_NORMAL, e - 1, -6)


def to_e4m3(x):
    """x (...) -> uint8 codes, rounded as cvt.rn.satfinite. See chapter 12."""
    x = _as_real("x", x)
    a = np.abs(x)
    finite = np.isfinite(a)
    a = np.where(finite, a, 0.0)  # inf and NaN get their codes below
    b = _binade(a)
    # a / step is exact (a power of two) and rint rounds ties to even;
    # m is 8..16 in a normal binade (0..8 below 2^-6), and m = 16 is the
    # next binade's M = 0, so the code is one sum with no special case
    m = np.rint(np.ldexp(a, MANTISSA_BITS - b))
    code = (b + EXPONENT_BIAS - 1) * 8 + m
    code = np.where(finite, np.minimum(code, MAX_CODE), MAX_CODE)  # sat.
    code = code.astype(np.uint8) | np.where(np.signbit(x), SIGN_BIT, 0)
    # the cast writes one NaN whatever the sign and payload
    return np.where(np.isnan(x), NAN_CODE, code).astype(np.uint8)


def from_e4m3(codes):
    """codes (...) uint8 -> (...) float32 values, exact. See chapter 12."""
    return _TABLE[_as_codes("codes", codes)]


def half_unit(x):
    """(...) float64: half the e4m3 spacing at |x|, to_e4m3's worst move."""
    a = np.abs(_as_real("x", x))
    finite = np.isfinite(a)
    b = _binade(np.where(finite, a, 0.0))
    # a binade 2^b holds 8 steps of 2^(b - 3); half of one is 2^(b - 4)
    return np.where(finite, np.ldexp(1.0, b - MANTISSA_BITS - 1), a)


def quantize(x):
    """x (...) real -> (codes (...) uint8, descale float). See chapter 12.

    Per-tensor scaling: descale = amax / 448 over the finite entries
    (1.0 if none is nonzero), so x's largest entry lands on +-448.
    Non-finite entries become NaN codes, never a saturated +-448.
    """
    x = _as_real("x", x)
    finite = np.isfinite(x)
    amax = float(np.max(np.abs(x[finite]), initial=0.0))
    descale = amax / E4M3_MAX if amax > 0 else 1.0
    if 0 < descale < np.finfo(np.float64).tiny:
        # a subnormal descale has too few bits to hold amax / 448
        raise ValueError(
            f"x: largest finite |x| is {amax!r}, too small for a float64 "
            f"descale (needs at least 448 * 2**-1022); scale x up first"
        )
    codes = to_e4m3(np.where(finite, x, 0.0) / descale)
    # e4m3 has no infinity: inf would saturate to a plausible 448, and
    # flashlab's rule is that non-finite input shows as NaN
    return np.where(finite, codes, NAN_CODE).astype(np.uint8), descale


def dequantize(codes, descale):
    """codes (...) uint8, descale -> (...) float64 values. See chapter 12."""
    codes = _as_codes("codes", codes)
    if isinstance(descale, bool) or not isinstance(descale, numbers.Real):
        raise TypeError(
            f"descale: expected a real number, got {descale!r}"
        )
    if not (np.isfinite(descale) and descale > 0):
        raise ValueError(
            f"descale: expected a finite number > 0, got {descale!r}"
        )
    return from_e4m3(codes).astype(np.float64) * float(descale)

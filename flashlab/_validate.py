"""Argument checks shared by every attention entry point."""

import math
import numbers

import numpy as np

from flashlab import heads

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def as_float_array(name, x):
    """Return `x` as a float32/float64 ndarray, or raise naming `name`."""
    try:
        arr = np.asarray(x)
    except ValueError:  # nested sequences of different lengths
        raise ValueError(f"{name}: expected an array of one shape, got "
                         f"ragged sequences") from None
    if arr.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a float32 or float64 array, got dtype "
            f"{arr.dtype}"
        )
    return arr


def check_qkv(q, k, v):
    """Validate q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv)."""
    q = as_float_array("q", q)
    k = as_float_array("k", k)
    v = as_float_array("v", v)
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim < 2:
            raise ValueError(
                f"{name}: expected at least 2 dims (..., N, d), got shape "
                f"{arr.shape}"
            )
        if arr.shape[-2] < 1 or arr.shape[-1] < 1:
            raise ValueError(
                f"{name}: expected N >= 1 and d >= 1, got shape {arr.shape}"
            )
    for name, arr in (("k", k), ("v", v)):
        if arr.dtype != q.dtype:
            raise TypeError(
                f"{name}: expected dtype {q.dtype} to match q, got "
                f"{arr.dtype}"
            )
    heads.group_size(q.shape, k.shape, v.shape)  # equal or grouped heads
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k: expected head dim d={q.shape[-1]} to match q, got "
            f"{k.shape[-1]}"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"v: expected Nk={k.shape[-2]} rows to match k, got "
            f"{v.shape[-2]}"
        )
    return q, k, v


def check_scale(scale, d, dtype=None):
    """Return the score scale: 1/sqrt(d) for None, else a finite float
    (finite in dtype too, where given: the scores are scaled in it)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale: expected a real number or None, got {scale!r}"
        )
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    # compared as a Python float: a numpy float32 scale against float64's
    # bound would cast the bound to float32 (and warn of an overflow)
    if dtype is not None and abs(float(scale)) > float(np.finfo(dtype).max):
        raise ValueError(
            f"scale: expected a number that {np.dtype(dtype)} (q's dtype) "
            f"holds, at most {np.finfo(dtype).max:.4g} in size, got "
            f"{scale!r}")
    return float(scale)


def check_block(name, value, default):
    """Return a block size as an int >= 1 (None: default), or raise."""
    return default if value is None else check_count(name, value)


def check_count(name, value):
    """Return a size as an int >= 1, or raise naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    return int(value)


def check_flag(name, value):
    """Return a bool flag, refusing truthy non-bools such as 1 or "no"."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)

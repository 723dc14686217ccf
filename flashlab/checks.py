"""Gradient checks that the tests and chapter 8 share."""

import numpy as np


def finite_difference_error(loss, arrays, grads, h=1e-6):
    """Largest |central difference - gradient| over every input element.

    loss(*arrays) -> float; grads are its claimed gradients, one per array.
    In float64 with h = 1e-6 the difference itself is good to about 1e-9:
    O(h^2) truncation plus O(eps / h) rounding.
    """
    arrays = [np.array(x, dtype=np.float64) for x in arrays]
    worst = 0.0
    for x, grad in zip(arrays, grads):
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + h
            up = loss(*arrays)
            x[idx] = old - h
            down = loss(*arrays)
            x[idx] = old
            worst = max(worst, abs((up - down) / (2 * h) - grad[idx]))
    return float(worst)


def extended_attention(q, k, v, do, scale=None):
    """(o, dq, dk, dv) of materialized attention in numpy's longdouble.

    The textbook formulas on the float64 inputs, carried out with more
    precision than float64 where the platform has it (x86: 64-bit
    mantissa): the truth both float64 implementations are measured
    against in chapter 8.
    """
    q, k, v, do = (np.asarray(x, dtype=np.longdouble) for x in (q, k, v,
                                                                   do))
    c = (np.longdouble(1) / np.sqrt(np.longdouble(q.shape[-1]))
         if scale is None else np.longdouble(scale))
    s = q @ np.swapaxes(k, -1, -2) * c  # (..., Nq, Nk)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ v
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
    return (o, ds @ k * c, np.swapaxes(ds, -1, -2) @ q * c,
            np.swapaxes(p, -1, -2) @ do)

"""The gradient check that the tests and chapter 8 share."""

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

"""The online update, in both FlashAttention-1 and -2 forms."""

import numpy as np
import pytest

from flashlab import online, reference
from helpers import max_abs_err

SEED_000_SCORES = np.array([1.0, 2.0, 0.0, 1.0, 3.0, 2.0])
SEED_000_VALUES = np.array(
    [[2.0, 0.0], [0.0, 2.0], [1.0, 1.0], [2.0, 0.0], [0.0, 2.0], [1.0, 1.0]]
)


def test_seed_000_chunk_by_chunk():
    states = online.stream(SEED_000_SCORES, SEED_000_VALUES, 2)
    got = [
        (float(s.m), round(float(s.l), 3), np.round(s.u, 3).tolist())
        for s in states
    ]
    assert got == [
        (2.0, 1.368, [0.736, 2.0]),
        (2.0, 1.871, [1.607, 2.135]),
        (3.0, 2.056, [0.959, 3.153]),
    ]
    assert np.round(states[-1].output(), 3).tolist() == [0.466, 1.534]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 40])
def test_both_forms_agree_with_reference(rng, chunk):
    s = rng.standard_normal((4, 17)) * 5  # 4 independent queries
    v = rng.standard_normal((17, 3))
    want = reference.softmax(s) @ v
    fa2 = online.stream(s, v, chunk)
    fa1 = online.stream_normalized(s, v, chunk)
    assert len(fa2) == len(fa1) == -(-17 // chunk)
    for a, b in zip(fa2, fa1):  # the same partial answer after every chunk
        assert max_abs_err(a.output(), b.o) < 1e-14
        assert np.array_equal(a.m, b.m)
    assert max_abs_err(fa2[-1].output(), want) < 1e-14


def test_bad_arguments():
    with pytest.raises(ValueError, match="chunk"):
        online.stream(SEED_000_SCORES, SEED_000_VALUES, 0)
    with pytest.raises(ValueError, match="values"):
        online.stream(SEED_000_SCORES, SEED_000_VALUES[:5], 2)
    with pytest.raises(TypeError, match="chunk: expected an integer"):
        online.stream(SEED_000_SCORES, SEED_000_VALUES, 1.5)
    with pytest.raises(ValueError, match="values: expected \\(\\.\\.\\., C"):
        online.stream(SEED_000_SCORES, SEED_000_VALUES[:, 0], 2)
    with pytest.raises(ValueError, match="scores: expected"):
        online.stream(np.float64(1.0), SEED_000_VALUES, 2)
    # a numpy integer is a size as any other
    assert len(online.stream(SEED_000_SCORES, SEED_000_VALUES,
                             np.int64(2))) == len(
        online.stream(SEED_000_SCORES, SEED_000_VALUES, 2))

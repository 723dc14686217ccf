"""Chapter 5's exercises: the tiled loop and the tiles causal visits."""

import numpy as np

from flashlab import masks, reference
from flashlab.exercises.cases import NO_RESCALE
from flashlab.exercises.checker import Case, Exercise, register

# ------------------------------------------------------- tiled_attention


def _cases_tiled(rng):
    out = []
    for name, nq, nk, bq, bk, shift in (
            ("random 16 x 16, tiles 4 x 8", 16, 16, 4, 8, 0.0),
            ("ragged 10 x 13, tiles 4 x 5", 10, 13, 4, 5, 0.0),
            ("one query, one key", 1, 1, 2, 2, 0.0),
            ("large scores", 7, 9, 3, 4, 30.0)):
        q = rng.standard_normal((nq, 8)) + shift / 8
        k = rng.standard_normal((nk, 8)) + shift / 8
        v = rng.standard_normal((nk, 3))
        out.append(Case(name, (q, k, v, bq, bk),
                        reference.attention(q, k, v)))
    return out


def tiled_attention(q, k, v, block_q, block_k):
    """Chapter 5: O for q (Nq, d), k (Nk, d), v (Nk, d_v), tile by tile."""
    tau = 1 / np.sqrt(q.shape[1])
    o = np.empty((len(q), v.shape[1]))
    for i0 in range(0, len(q), block_q):
        q_i = q[i0:i0 + block_q] * tau
        m = np.full(len(q_i), -np.inf)
        l, u = np.zeros(len(q_i)), np.zeros((len(q_i), v.shape[1]))
        for j0 in range(0, len(k), block_k):
            s = q_i @ k[j0:j0 + block_k].T  # S_ij (Br, Bc)
            m_new = np.maximum(m, s.max(axis=1))
            alpha = np.exp(m - m_new)
            p = np.exp(s - m_new[:, None])
            l = alpha * l + p.sum(axis=1)
            u = alpha[:, None] * u + p @ v[j0:j0 + block_k]
            m = m_new
        o[i0:i0 + block_q] = u / l[:, None]
    return o


def _tiled_no_scale(q, k, v, block_q, block_k):
    return tiled_attention(q * np.sqrt(q.shape[1]), k, v, block_q, block_k)


def _tiled_no_rescale(q, k, v, block_q, block_k):
    tau = 1 / np.sqrt(q.shape[1])
    o = np.empty((len(q), v.shape[1]))
    for i0 in range(0, len(q), block_q):
        q_i = q[i0:i0 + block_q] * tau
        m = np.full(len(q_i), -np.inf)
        l, u = np.zeros(len(q_i)), np.zeros((len(q_i), v.shape[1]))
        for j0 in range(0, len(k), block_k):
            s = q_i @ k[j0:j0 + block_k].T
            m = np.maximum(m, s.max(axis=1))
            p = np.exp(s - m[:, None])
            l = l + p.sum(axis=1)
            u = u + p @ v[j0:j0 + block_k]
        o[i0:i0 + block_q] = u / l[:, None]
    return o


register("tiled_attention", Exercise(
    5, "tiled_attention(q (Nq, d), k (Nk, d), v (Nk, d_v), block_q, "
    "block_k) -> (Nq, d_v), scale 1/sqrt(d)",
    _cases_tiled, tiled_attention,
    (("the scores are tau Q K^T with tau = 1/sqrt(d)", _tiled_no_scale),
     (NO_RESCALE, _tiled_no_rescale))))

# ---------------------------------------------------------- causal_tiles


def _cases_causal_tiles(rng):
    out = []
    for nq, nk, bq, bk in ((8, 8, 2, 2), (10, 10, 4, 3), (5, 12, 2, 4),
                           (1, 1, 1, 1), (64, 64, 16, 16)):
        rules = masks.rules(True, None, None, None, (), nq, nk)
        want = {(i0 // bq, j0 // bk)
                for i0 in range(0, nq, bq) for j0 in range(0, nk, bk)
                if not rules.skips(range(i0, min(i0 + bq, nq)),
                                   range(j0, min(j0 + bk, nk)))}
        out.append(Case(f"Nq={nq}, Nk={nk}, tiles {bq} x {bk}",
                        (nq, nk, bq, bk), frozenset(want)))
    return out


def causal_tiles(nq, nk, block_q, block_k):
    """Chapter 5: the (query tile, key tile) pairs causal attention visits.

    Top-left causal: query i sees key j <= i. A tile is needed when its
    first key is at or before its last query.
    """
    return {(i0 // block_q, j0 // block_k)
            for i0 in range(0, nq, block_q) for j0 in range(0, nk, block_k)
            if j0 <= min(i0 + block_q, nq) - 1}


def _tiles_all(nq, nk, block_q, block_k):
    return {(i, j) for i in range(-(-nq // block_q))
            for j in range(-(-nk // block_k))}


def _tiles_strict(nq, nk, block_q, block_k):
    return {(i0 // block_q, j0 // block_k)
            for i0 in range(0, nq, block_q) for j0 in range(0, nk, block_k)
            if j0 + block_k - 1 <= i0}


register("causal_tiles", Exercise(
    5, "causal_tiles(nq, nk, block_q, block_k) -> set of (query tile, "
    "key tile) indices that top-left causal attention must visit",
    _cases_causal_tiles, causal_tiles,
    (("tiles entirely above the diagonal (first key after the last "
      "query) hold no allowed pair: skip them", _tiles_all),
     ("a tile on the diagonal is needed too: it holds pairs with "
      "j <= i; compare its first key with its last query",
      _tiles_strict))))

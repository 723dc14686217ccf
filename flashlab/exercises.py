"""Exercises that check themselves: `check(name, fn)` runs a reader's fn.

Each exercise runs the reader's function on fresh random inputs and on the
edge cases that break careless code (a single key, ragged chunks, scores
near 1000, blocks with no allowed key) and compares with flashlab's own
answer. A failure names the case, the first element that differs, the
expected and the received value, and a hint: when the wrong answer is the
one a typical mistake produces (a forgotten rescale, a division before
the end, a maximum not subtracted), the hint names that mistake.

`solution(name)` is the worked answer the book shows; `MISTAKES` are the
typical wrong answers, kept here so that the tests can check that each is
caught with the right hint. Every chapter ends with two of them.
"""

import math
from typing import Callable, NamedTuple

import numpy as np

from flashlab import costs, io, masks, merge, reference

RTOL = 1e-9  # float64 throughout: any correct order of operations is closer


class ExerciseError(AssertionError):
    """A reader's answer differs from flashlab's; the message says where."""


class Case(NamedTuple):
    """One input of an exercise and flashlab's answer to it."""

    name: str
    args: tuple
    want: object


class Exercise(NamedTuple):
    """A checked exercise: its task, its cases, a solution, typical errors."""

    chapter: int
    task: str
    cases: Callable  # rng -> list of Case
    solution: Callable
    mistakes: tuple  # (hint, wrong function) pairs


def check(name, fn, seed=None):
    """Run fn on every case of exercise `name`; raise ExerciseError if wrong.

    Returns a one-line report when every case passes. seed fixes the
    random cases (by default they are fresh on every call).
    """
    ex = _get(name)
    cases = ex.cases(np.random.default_rng(seed))
    for case in cases:
        try:
            with np.errstate(all="ignore"):
                got = fn(*case.args)
        except Exception as err:  # report it as a wrong answer, with why
            raise ExerciseError(
                f"{name}, case '{case.name}': your function raised "
                f"{type(err).__name__}: {err}") from err
        problem = _compare(case.want, got)
        if problem is not None:
            raise ExerciseError(
                f"{name}, case '{case.name}': {problem}\n"
                f"hint: {_diagnose(ex, case, got)}")
    return f"{name}: all {len(cases)} cases pass"


def task(name):
    """The exercise's statement, with the signature to implement."""
    ex = _get(name)
    return f"{name} (chapter {ex.chapter}): {ex.task}"


def solution(name):
    """The worked solution of exercise `name` (a function)."""
    return _get(name).solution


def _get(name):
    if name not in EXERCISES:
        raise ValueError(
            f"name: expected one of {sorted(EXERCISES)}, got {name!r}")
    return EXERCISES[name]


def _compare(want, got):
    """None if got matches want, else a sentence saying where it does not."""
    if isinstance(want, (set, frozenset)):
        got_set = set(got) if got is not None else set()
        if got_set == want:
            return None
        extra, missing = sorted(got_set - want), sorted(want - got_set)
        return (f"expected {len(want)} items, got {len(got_set)}; "
                f"missing {missing[:4]}, not expected {extra[:4]}")
    if isinstance(want, tuple):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"expected a tuple of {len(want)} values, got {got!r}"
        for k, (w, g) in enumerate(zip(want, got)):
            problem = _compare(w, g)
            if problem is not None:
                return f"item {k} of the tuple: {problem}"
        return None
    want = np.asarray(want, dtype=np.float64)
    try:
        got = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return f"expected an array of shape {want.shape}, got {got!r}"
    if got.shape != want.shape:
        return f"expected shape {want.shape}, got shape {got.shape}"
    same = (np.isclose(got, want, rtol=RTOL, atol=RTOL)
            | (np.isnan(got) & np.isnan(want)))
    if same.all():
        return None
    idx = tuple(int(i) for i in np.argwhere(~same)[0])
    where = f" at index {idx}" if idx else ""
    return (f"expected {float(want[idx]):.10g}{where}, got "
            f"{float(got[idx]):.10g}")


def _diagnose(ex, case, got):
    """The hint of the typical mistake that gives exactly `got`, if any."""
    with np.errstate(all="ignore"):
        for hint, wrong in ex.mistakes:
            try:
                if _compare(wrong(*case.args), got) is None:
                    return hint
            except Exception:  # a mistake that cannot even run this case
                continue
    if (np.issubdtype(np.asarray(got).dtype, np.number)
            and not np.all(np.isfinite(np.asarray(got, dtype=float)))
            and np.all(np.isfinite(np.asarray(case.want, dtype=float)))):
        return ("your answer is not finite where the true one is: look for "
                "exp of a large score, or (-inf) - (-inf) in an empty block")
    return ("compare with the chapter's derivation one step at a time, on "
            "this case's inputs")


# ------------------------------------------------------------- cases

def _rows(rng, with_masked=True):
    """(name, scores (N,), values (N, d_v), chunk) for the row exercises."""
    out = [
        ("random, N=12 in chunks of 4", 12, 4, 0.0),
        ("a single key", 1, 3, 0.0),
        ("ragged: N=10 in chunks of 4", 10, 4, 0.0),
        ("scores near 1000", 9, 2, 1000.0),
        ("rising scores, chunks of 1", 6, 1, 0.0),
    ]
    rows = []
    for name, n, chunk, shift in out:
        s = rng.standard_normal(n) * 3 + shift
        if name.startswith("rising"):
            s = np.sort(s) * 4
        rows.append((name, s, rng.standard_normal((n, 3)), chunk))
    if with_masked:
        s = rng.standard_normal(8)
        s[:3] = -np.inf  # the whole first chunk is masked
        rows.append(("first chunk masked (-inf)", s,
                     rng.standard_normal((8, 3)), 3))
    return rows


def _softmax_output(scores, values):
    return reference.softmax(scores) @ values


def _cases_deferred(rng):
    return [Case(n, (s, v), _softmax_output(s, v))
            for n, s, v, _ in _rows(rng, with_masked=False)]


def _cases_lse(rng):
    return [Case(n, (s,), float(reference.logsumexp(s)))
            for n, s, _, _ in _rows(rng)]


def _cases_online(rng):
    return [Case(n, (s, v, c), _softmax_output(s, v))
            for n, s, v, c in _rows(rng)]


def _cases_state(rng):
    out = []
    for n, s, _, c in _rows(rng):
        m = float(s.max())
        out.append(Case(n, (s, c), (m, float(np.exp(s - m).sum()))))
    return out


def _summary_of(s, v):
    sm = merge.summarize(s, v)
    return float(sm.m), float(sm.l), sm.u


def _cases_merge(rng):
    out = []
    for name, s, v, _ in _rows(rng, with_masked=False):
        cut = len(s) // 2
        b = _summary_of(s[cut:], v[cut:])
        if cut:
            a = _summary_of(s[:cut], v[:cut])
        else:
            a = (-math.inf, 0.0, np.zeros(v.shape[1]))  # an empty block
            name += " (first block empty)"
        out.append(Case(name, (a, b), _summary_of(s, v)))
    empty = (-math.inf, 0.0, np.zeros(3))
    out.append(Case("both blocks empty", (empty, empty), empty))
    return out


def _cases_combine(rng):
    out = []
    for name, s, v, _ in _rows(rng):
        cuts = [0, len(s) // 3, 2 * len(s) // 3, len(s)]
        outs, lses = [], []
        for j0, j1 in zip(cuts, cuts[1:]):
            sm = merge.summarize(s[j0:j1], v[j0:j1]) if j1 > j0 else \
                merge.empty((), v.shape[1], np.float64)
            outs.append(sm.output())
            lses.append(sm.lse())
        out.append(Case(name + ", three splits",
                        (np.array(outs), np.array(lses)),
                        _softmax_output(s, v)))
    return out


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


# --------------------------------------------- solutions and mistakes

def deferred_division(scores, values):
    """Chapter 2: exp-weighted sum of values first, one division at the end.

    scores (N,), values (N, d_v) -> output (d_v,).
    """
    m = scores.max()
    p = np.exp(scores - m)  # every term <= 1: no overflow
    return (p @ values) / p.sum()


def _deferred_no_max(scores, values):
    p = np.exp(scores)
    return (p @ values) / p.sum()


def _deferred_no_division(scores, values):
    return np.exp(scores - scores.max()) @ values


def log_sum_exp(scores):
    """Chapter 2: log sum_j exp(s_j) = m + log sum_j exp(s_j - m)."""
    m = scores.max()
    if m == -np.inf:
        return -np.inf
    return float(m + np.log(np.exp(scores - m).sum()))


def _lse_no_max(scores):
    return float(np.log(np.exp(scores).sum()))


def _lse_m_dropped(scores):
    m = scores.max()
    return float(np.log(np.exp(scores - m).sum()))


def online_output(scores, values, chunk):
    """Chapter 3: running (m, l, a) over chunks, one division at the end."""
    m, l, a = -np.inf, 0.0, np.zeros(values.shape[1])
    for j0 in range(0, len(scores), chunk):
        s, v = scores[j0:j0 + chunk], values[j0:j0 + chunk]
        m_new = max(m, s.max())
        if m_new == -np.inf:
            continue  # nothing allowed yet: nothing to add
        alpha = np.exp(m - m_new)  # rescales what was summed against m
        p = np.exp(s - m_new)
        l = alpha * l + p.sum()
        a = alpha * a + p @ v
        m = m_new
    return a / l


def _online_no_rescale(scores, values, chunk):
    m, l, a = -np.inf, 0.0, np.zeros(values.shape[1])
    for j0 in range(0, len(scores), chunk):
        s, v = scores[j0:j0 + chunk], values[j0:j0 + chunk]
        m = max(m, s.max())
        p = np.exp(s - m)
        l = l + p.sum()
        a = a + p @ v
    return a / l


def _online_divide_each_chunk(scores, values, chunk):
    m, o = -np.inf, np.zeros(values.shape[1])
    for j0 in range(0, len(scores), chunk):
        s, v = scores[j0:j0 + chunk], values[j0:j0 + chunk]
        m_new = max(m, s.max())
        p = np.exp(s - m_new)
        o = np.exp(m - m_new) * o + (p @ v) / p.sum()
        m = m_new
    return o


def _online_no_max(scores, values, chunk):
    l, a = 0.0, np.zeros(values.shape[1])
    for j0 in range(0, len(scores), chunk):
        p = np.exp(scores[j0:j0 + chunk])
        l = l + p.sum()
        a = a + p @ values[j0:j0 + chunk]
    return a / l


def online_state(scores, chunk):
    """Chapter 3: the final running maximum m and denominator l."""
    m, l = -np.inf, 0.0
    for j0 in range(0, len(scores), chunk):
        s = scores[j0:j0 + chunk]
        m_new = max(m, s.max())
        if m_new == -np.inf:
            continue
        l = np.exp(m - m_new) * l + np.exp(s - m_new).sum()
        m = m_new
    return float(m), float(l)


def _state_no_rescale(scores, chunk):
    m, l = -np.inf, 0.0
    for j0 in range(0, len(scores), chunk):
        s = scores[j0:j0 + chunk]
        m = max(m, s.max())
        l = l + np.exp(s - m).sum()
    return float(m), float(l)


def _state_last_max(scores, chunk):
    m, l = -np.inf, 0.0
    for j0 in range(0, len(scores), chunk):
        s = scores[j0:j0 + chunk]
        m_new = s.max()
        l = np.exp(m - m_new) * l + np.exp(s - m_new).sum()
        m = m_new
    return float(m), float(l)


def merge_summaries(a, b):
    """Chapter 4: (m, l, u) of the union of two blocks' keys."""
    (ma, la, ua), (mb, lb, ub) = a, b
    m = max(ma, mb)
    if m == -np.inf:
        return m, 0.0, np.zeros_like(ua)  # both empty: still empty
    alpha, beta = np.exp(ma - m), np.exp(mb - m)  # exp(-inf) = 0 if empty
    return m, alpha * la + beta * lb, alpha * ua + beta * ub


def _merge_no_rescale(a, b):
    (ma, la, ua), (mb, lb, ub) = a, b
    return max(ma, mb), la + lb, ua + ub


def _merge_inverted(a, b):
    (ma, la, ua), (mb, lb, ub) = a, b
    m = max(ma, mb)
    alpha, beta = np.exp(m - ma), np.exp(m - mb)
    return m, alpha * la + beta * lb, alpha * ua + beta * ub


def combine_outputs(outs, lses):
    """Chapter 4: one output from normalized split outputs and their lse.

    outs (S, d_v), lses (S,): split s holds o_s = u_s / l_s and
    lse_s = m_s + log l_s, so l_s e^(m_s - M) = e^(lse_s - M).
    """
    top = lses.max()
    w = np.exp(lses - top)  # each split's share of the denominator
    return (w @ np.where(np.isneginf(lses)[:, None], 0, outs)) / w.sum()


def _combine_mean(outs, lses):
    return outs.mean(axis=0)


def _combine_no_max(outs, lses):
    w = np.exp(lses)
    return (w @ outs) / w.sum()


def tiled_attention(q, k, v, block_q, block_k):
    """Chapter 5: O for q (Nq, d), k (Nk, d), v (Nk, d_v), tile by tile."""
    tau = 1 / np.sqrt(q.shape[1])
    o = np.empty((len(q), v.shape[1]))
    for i0 in range(0, len(q), block_q):
        q_i = q[i0:i0 + block_q] * tau
        m = np.full(len(q_i), -np.inf)
        l, a = np.zeros(len(q_i)), np.zeros((len(q_i), v.shape[1]))
        for j0 in range(0, len(k), block_k):
            s = q_i @ k[j0:j0 + block_k].T  # S_ij (Br, Bc)
            m_new = np.maximum(m, s.max(axis=1))
            alpha = np.exp(m - m_new)
            p = np.exp(s - m_new[:, None])
            l = alpha * l + p.sum(axis=1)
            a = alpha[:, None] * a + p @ v[j0:j0 + block_k]
            m = m_new
        o[i0:i0 + block_q] = a / l[:, None]
    return o


def _tiled_no_scale(q, k, v, block_q, block_k):
    return tiled_attention(q * np.sqrt(q.shape[1]), k, v, block_q, block_k)


def _tiled_no_rescale(q, k, v, block_q, block_k):
    tau = 1 / np.sqrt(q.shape[1])
    o = np.empty((len(q), v.shape[1]))
    for i0 in range(0, len(q), block_q):
        q_i = q[i0:i0 + block_q] * tau
        m = np.full(len(q_i), -np.inf)
        l, a = np.zeros(len(q_i)), np.zeros((len(q_i), v.shape[1]))
        for j0 in range(0, len(k), block_k):
            s = q_i @ k[j0:j0 + block_k].T
            m = np.maximum(m, s.max(axis=1))
            p = np.exp(s - m[:, None])
            l = l + p.sum(axis=1)
            a = a + p @ v[j0:j0 + block_k]
        o[i0:i0 + block_q] = a / l[:, None]
    return o


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


def materialized_attention(q, k, v):
    """Chapter 1: S = tau Q K^T, P = softmax of each row, O = P V."""
    s = q @ k.T / np.sqrt(q.shape[1])  # (Nq, Nk)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


def _materialized_no_scale(q, k, v):
    return materialized_attention(q * np.sqrt(q.shape[1]), k, v)


def _materialized_columns(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=0, keepdims=True))
    return (p / p.sum(axis=0, keepdims=True)) @ v


def intermediate_bytes(n, heads, batch, itemsize):
    """Chapter 1: bytes of S and P (n x n each) for a layer's heads."""
    return 2 * batch * heads * n * n * itemsize


def _bytes_s_only(n, heads, batch, itemsize):
    return batch * heads * n * n * itemsize


def _bytes_no_heads(n, heads, batch, itemsize):
    return 2 * batch * n * n * itemsize


def fa2_transfers(n, d, block_q):
    """Chapter 6: elements moved by the FA2 forward (d_v = d, one head)."""
    query_blocks = -(-n // block_q)
    return n * d + query_blocks * 2 * n * d + n * d  # Q; K, V per block; O


def _fa2_no_reread(n, d, block_q):
    return 4 * n * d


def _fa2_with_s_and_p(n, d, block_q):
    return fa2_transfers(n, d, block_q) + 4 * n * n


def fa1_block_sizes(sram, d):
    """Chapter 6: Algorithm 1's (Br, Bc) for an SRAM of `sram` elements."""
    bc = -(-sram // (4 * d))  # ceil(M / 4d)
    return min(bc, d), bc


def _fa1_floor(sram, d):
    bc = sram // (4 * d)
    return min(bc, d), bc


def _fa1_no_cap(sram, d):
    bc = -(-sram // (4 * d))
    return bc, bc


def causal_mask(nq, nk, align):
    """Chapter 7: bool (Nq, Nk), True where query i may see key j.

    align "top_left": j <= i; "bottom_right": j <= i + Nk - Nq.
    """
    offset = 0 if align == "top_left" else nk - nq
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None] + offset


def _causal_ignores_align(nq, nk, align):
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None]


def _causal_strict(nq, nk, align):
    offset = 0 if align == "top_left" else nk - nq
    return np.arange(nk)[None, :] < np.arange(nq)[:, None] + offset


def window_mask(nq, nk, left, right):
    """Chapter 7: bool (Nq, Nk), i - left <= j <= i + right (top-left)."""
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return (j >= i - left) & (j <= i + right)


def _window_exclusive(nq, nk, left, right):
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return (j > i - left) & (j < i + right)


def _window_swapped(nq, nk, left, right):
    return window_mask(nq, nk, right, left)


def softmax_backward(p, dp):
    """Chapter 8: dS = P (dP - D) for one row, D = sum_j P_j dP_j."""
    return p * (dp - p @ dp)


def _softmax_backward_no_d(p, dp):
    return p * dp


def _softmax_backward_sum_dp(p, dp):
    return p * (dp - dp.sum())


def row_delta(do, o):
    """Chapter 8: D_i = rowsum(dO_i * O_i), (Nq, d_v) -> (Nq,)."""
    return (do * o).sum(axis=1)


def _delta_total(do, o):
    return np.full(len(do), (do * o).sum())


def _delta_do_only(do, o):
    return do.sum(axis=1)


def thread_piece(t, tx_n, rm, cn):
    """Chapter 9: (rows, cols) of S that thread t holds in v3 and v4."""
    ty, tx = t // tx_n, t % tx_n
    return (tuple(range(ty * rm, ty * rm + rm)),
            tuple(range(tx * cn, tx * cn + cn)))


def _piece_swapped(t, tx_n, rm, cn):
    ty, tx = t % tx_n, t // tx_n
    return (tuple(range(ty * rm, ty * rm + rm)),
            tuple(range(tx * cn, tx * cn + cn)))


def _piece_strided(t, tx_n, rm, cn):
    ty, tx = t // tx_n, t % tx_n
    return (tuple(range(ty * rm, ty * rm + rm)),
            tuple(tx + tx_n * c for c in range(cn)))


def fa2_intensity(n, d, block_q):
    """Chapter 9: FLOPs per HBM byte of the float32 FA2 forward."""
    return costs.flops(n, n, d) / (4 * costs.fused_transfers(
        n, d, block_q=block_q))


def _intensity_elements(n, d, block_q):
    return costs.flops(n, n, d) / costs.fused_transfers(n, d,
                                                        block_q=block_q)


def _intensity_dense(n, d, block_q):
    return costs.flops(n, n, d) / (4 * costs.dense_transfers(
        n, d, block_q=block_q))


def _cases_materialized(rng):
    out = []
    for name, nq, nk, shift in (("random 6 x 9", 6, 9, 0.0),
                                ("one query, one key", 1, 1, 0.0),
                                ("large scores", 5, 7, 40.0)):
        q = rng.standard_normal((nq, 4)) + shift / 4
        k = rng.standard_normal((nk, 4)) + shift / 4
        v = rng.standard_normal((nk, 3))
        out.append(Case(name, (q, k, v), reference.attention(q, k, v)))
    return out


def _cases_bytes(rng):
    return [Case(f"n={n}, {h} heads, batch {b}, {s} bytes", (n, h, b, s),
                 float(2 * b * h * costs.matrix_bytes(n, n, s)))
            for n, h, b, s in ((1024, 8, 2, 2), (4096, 32, 4, 2),
                               (1, 1, 1, 4), (int(rng.integers(2, 500)),
                                              3, 5, 4))]


def _cases_fa2_transfers(rng):
    return [Case(f"n={n}, d={d}, block_q={bq}", (n, d, bq),
                 float(costs.fused_transfers(n, d, block_q=bq)))
            for n, d, bq in ((6, 2, 2), (1, 4, 8), (100, 16, 32),
                             (int(rng.integers(50, 300)), 8, 7))]


def _cases_fa1_blocks(rng):
    return [Case(f"M={m}, d={d}", (m, d),
                 tuple(float(x) for x in io.fa1_blocks(m, d)))
            for m, d in ((1024, 32), (1000, 32), (65536, 64), (256, 64),
                         (int(rng.integers(300, 20000)), 16))]


def _mask_case(nq, nk, **rules):
    keep = masks.rules(rules.get("causal", False), rules.get("window"),
                       None, None, (), nq, nk).allowed(range(nq), range(nk))
    return np.ones((nq, nk)) if keep is None else keep.astype(float)


def _cases_causal_mask(rng):
    out = []
    for nq, nk in ((4, 4), (3, 6), (6, 3), (1, 1),
                   (int(rng.integers(2, 9)), int(rng.integers(2, 9)))):
        for align in ("top_left", "bottom_right"):
            causal = True if align == "top_left" else "bottom_right"
            out.append(Case(f"Nq={nq}, Nk={nk}, {align}", (nq, nk, align),
                            _mask_case(nq, nk, causal=causal)))
    return out


def _cases_window_mask(rng):
    return [Case(f"Nq={nq}, Nk={nk}, window ({lt}, {rt})",
                 (nq, nk, lt, rt), _mask_case(nq, nk, window=(lt, rt)))
            for nq, nk, lt, rt in ((6, 6, 2, 0), (5, 8, 1, 3), (1, 1, 0, 0),
                                   (7, 4, 3, 1),
                                   (9, 9, int(rng.integers(0, 4)), 2))]


def _cases_softmax_backward(rng):
    out = []
    for name, n in (("random row of 7", 7), ("a single key", 1),
                    ("row of 20", 20)):
        s = rng.standard_normal(n) * 2
        p = reference.softmax(s)
        dp = rng.standard_normal(n)
        out.append(Case(name, (p, dp), p * (dp - p @ dp)))
    return out


def _cases_delta(rng):
    return [Case(f"{nq} rows, d_v={dv}", (do, o), (do * o).sum(axis=1))
            for nq, dv in ((5, 3), (1, 1), (12, 8))
            for do, o in [(rng.standard_normal((nq, dv)),
                           rng.standard_normal((nq, dv)))]]


def _cases_thread_piece(rng):
    tl = gpu_tiles()
    out = [Case(f"thread {t} of the d=64 layout", (t, tl.TX, tl.RM, tl.CN),
                thread_piece(t, tl.TX, tl.RM, tl.CN))
           for t in (0, 1, tl.TX, 127, int(rng.integers(2, 127)))]
    return [c._replace(want=tuple(tuple(float(x) for x in part)
                                  for part in c.want)) for c in out]


def _cases_intensity(rng):
    return [Case(f"n={n}, d={d}, block_q={bq}", (n, d, bq),
                 fa2_intensity(n, d, bq))
            for n, d, bq in ((16384, 64, 64), (1024, 128, 128),
                             (int(rng.integers(100, 5000)), 32, 16))]


def gpu_tiles():
    """The v3/v4 layout at d = 64 (the GPU package's own, no GPU needed)."""
    from flashlab.gpu.device import tiles

    return tiles(64, 64)


_NO_MAX = ("exp of a score near 1000 overflows to inf: subtract the "
           "maximum m before exponentiating (chapter 2)")
_NO_RESCALE = ("when the running maximum grows from m to m', what was summed "
               "against m must be multiplied by alpha = exp(m - m') before "
               "the new terms are added")

EXERCISES = {
    "materialized_attention": Exercise(
        1, "materialized_attention(q (Nq, d), k (Nk, d), v (Nk, d_v)) -> "
        "(Nq, d_v): S, softmax of each row, P V; scale 1/sqrt(d)",
        _cases_materialized, materialized_attention,
        (("the scores are tau Q K^T with tau = 1/sqrt(d)",
          _materialized_no_scale),
         ("the softmax normalizes each query's row of S (axis 1), not each "
          "key's column", _materialized_columns))),
    "intermediate_bytes": Exercise(
        1, "intermediate_bytes(n, heads, batch, itemsize) -> bytes of S and "
        "P for one layer", _cases_bytes, intermediate_bytes,
        (("both S and P are n x n per head: count two matrices",
          _bytes_s_only),
         ("every head of every batch element has its own S and P",
          _bytes_no_heads))),
    "fa2_transfers": Exercise(
        6, "fa2_transfers(n, d, block_q) -> elements moved by the FA2 "
        "forward of one head (d_v = d)", _cases_fa2_transfers,
        fa2_transfers,
        (("each query block rereads all of K and V: ceil(n / block_q) "
          "passes", _fa2_no_reread),
         ("S and P never leave the chip in the fused schedule",
          _fa2_with_s_and_p))),
    "fa1_block_sizes": Exercise(
        6, "fa1_block_sizes(sram, d) -> (Br, Bc) of Algorithm 1",
        _cases_fa1_blocks, fa1_block_sizes,
        (("Bc = ceil(M / 4d): round up", _fa1_floor),
         ("the paper caps Br at d: Br = min(Bc, d)", _fa1_no_cap))),
    "causal_mask": Exercise(
        7, "causal_mask(nq, nk, align) -> bool (Nq, Nk), align "
        "'top_left' or 'bottom_right'", _cases_causal_mask, causal_mask,
        (("bottom-right alignment shifts the diagonal by Nk - Nq: the last "
          "query sees the last key", _causal_ignores_align),
         ("a query may attend to its own position: j <= i + offset, not <",
          _causal_strict))),
    "window_mask": Exercise(
        7, "window_mask(nq, nk, left, right) -> bool (Nq, Nk) for "
        "i - left <= j <= i + right", _cases_window_mask, window_mask,
        (("both window edges are inclusive", _window_exclusive),
         ("left bounds the keys before i, right the keys after",
          _window_swapped))),
    "softmax_backward": Exercise(
        8, "softmax_backward(p (N,), dp (N,)) -> dS (N,) for one row",
        _cases_softmax_backward, softmax_backward,
        (("the softmax Jacobian has a -p p^T part: subtract D = sum_j p_j "
          "dp_j", _softmax_backward_no_d),
         ("D weights dP by P: D = sum_j p_j dp_j, not sum_j dp_j",
          _softmax_backward_sum_dp))),
    "row_delta": Exercise(
        8, "row_delta(do (Nq, d_v), o (Nq, d_v)) -> D (Nq,)",
        _cases_delta, row_delta,
        (("D is one number per row: sum over the row only", _delta_total),
         ("D_i = dO_i . O_i: multiply by O before summing",
          _delta_do_only))),
    "thread_piece": Exercise(
        9, "thread_piece(t, tx_n, rm, cn) -> (rows, cols) of the S tile "
        "that thread t holds in forward v3/v4", _cases_thread_piece,
        thread_piece,
        (("t = ty * tx_n + tx: the row of threads is t // tx_n",
          _piece_swapped),
         ("a thread's S columns are contiguous (tx * cn ...); only its "
          "output columns are strided", _piece_strided))),
    "fa2_intensity": Exercise(
        9, "fa2_intensity(n, d, block_q) -> FLOPs per HBM byte of the "
        "float32 FA2 forward", _cases_intensity, fa2_intensity,
        (("a float32 element is 4 bytes", _intensity_elements),
         ("the fused schedule does not move S and P", _intensity_dense))),
    "deferred_division": Exercise(
        2, "deferred_division(scores (N,), values (N, d_v)) -> (d_v,): "
        "sum the exp-weighted values, then divide once",
        _cases_deferred, deferred_division,
        ((_NO_MAX, _deferred_no_max),
         ("the exp-weighted sum of values still needs one division by "
          "l = sum_j exp(s_j - m) at the end", _deferred_no_division))),
    "log_sum_exp": Exercise(
        2, "log_sum_exp(scores (N,)) -> float, stable for large scores",
        _cases_lse, log_sum_exp,
        ((_NO_MAX, _lse_no_max),
         ("log sum_j exp(s_j - m) is lse - m: add m back", _lse_m_dropped))),
    "online_output": Exercise(
        3, "online_output(scores (N,), values (N, d_v), chunk) -> (d_v,): "
        "one pass over chunks keeping (m, l, a)",
        _cases_online, online_output,
        ((_NO_RESCALE, _online_no_rescale),
         ("dividing each chunk by its own sum and adding the results is not "
          "the softmax: keep the unnormalized a and l, divide once at the "
          "end", _online_divide_each_chunk),
         (_NO_MAX, _online_no_max))),
    "online_state": Exercise(
        3, "online_state(scores (N,), chunk) -> (m, l): the running maximum "
        "and denominator after the last chunk",
        _cases_state, online_state,
        ((_NO_RESCALE, _state_no_rescale),
         ("m is the maximum over all chunks so far, not the last chunk's "
          "maximum", _state_last_max))),
    "merge_summaries": Exercise(
        4, "merge_summaries((m_a, l_a, u_a), (m_b, l_b, u_b)) -> (m, l, u) "
        "of the union of the two blocks",
        _cases_merge, merge_summaries,
        (("two summaries on different maxima cannot be added as they are: "
          "put both on m = max(m_a, m_b) first", _merge_no_rescale),
         ("alpha = exp(m_a - m), not exp(m - m_a): moving onto a larger "
          "maximum shrinks a block's terms", _merge_inverted))),
    "combine_outputs": Exercise(
        4, "combine_outputs(outs (S, d_v), lses (S,)) -> (d_v,): the output "
        "of all splits from each split's normalized output and lse",
        _cases_combine, combine_outputs,
        (("splits are not equally important: weight split s by its share "
          "of the denominator, exp(lse_s - max lse)", _combine_mean),
         (_NO_MAX.replace("a score", "an lse"), _combine_no_max))),
    "tiled_attention": Exercise(
        5, "tiled_attention(q (Nq, d), k (Nk, d), v (Nk, d_v), block_q, "
        "block_k) -> (Nq, d_v), scale 1/sqrt(d)",
        _cases_tiled, tiled_attention,
        (("the scores are tau Q K^T with tau = 1/sqrt(d)", _tiled_no_scale),
         (_NO_RESCALE, _tiled_no_rescale))),
    "causal_tiles": Exercise(
        5, "causal_tiles(nq, nk, block_q, block_k) -> set of (query tile, "
        "key tile) indices that top-left causal attention must visit",
        _cases_causal_tiles, causal_tiles,
        (("tiles entirely above the diagonal (first key after the last "
          "query) hold no allowed pair: skip them", _tiles_all),
         ("a tile on the diagonal is needed too: it holds pairs with "
          "j <= i; compare its first key with its last query",
          _tiles_strict))),
}

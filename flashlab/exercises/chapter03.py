"""Chapter 3's exercises: the online update, output and state."""

import numpy as np

from flashlab.exercises.cases import NO_MAX, NO_RESCALE, rows, softmax_output
from flashlab.exercises.checker import Case, Exercise, register

# --------------------------------------------------------- online_output


def _cases_online(rng):
    return [Case(n, (s, v, c), softmax_output(s, v))
            for n, s, v, c in rows(rng)]


def online_output(scores, values, chunk):
    """Chapter 3: running (m, l, u) over chunks, one division at the end."""
    m, l, u = -np.inf, 0.0, np.zeros(values.shape[1])
    for j0 in range(0, len(scores), chunk):
        s, v = scores[j0:j0 + chunk], values[j0:j0 + chunk]
        m_new = max(m, s.max())
        if m_new == -np.inf:
            continue  # nothing allowed yet: nothing to add
        alpha = np.exp(m - m_new)  # rescales what was summed against m
        p = np.exp(s - m_new)
        l = alpha * l + p.sum()
        u = alpha * u + p @ v
        m = m_new
    return u / l


def _online_no_rescale(scores, values, chunk):
    m, l, u = -np.inf, 0.0, np.zeros(values.shape[1])
    for j0 in range(0, len(scores), chunk):
        s, v = scores[j0:j0 + chunk], values[j0:j0 + chunk]
        m = max(m, s.max())
        p = np.exp(s - m)
        l = l + p.sum()
        u = u + p @ v
    return u / l


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
    l, u = 0.0, np.zeros(values.shape[1])
    for j0 in range(0, len(scores), chunk):
        p = np.exp(scores[j0:j0 + chunk])
        l = l + p.sum()
        u = u + p @ values[j0:j0 + chunk]
    return u / l


register("online_output", Exercise(
    3, "online_output(scores (N,), values (N, d_v), chunk) -> (d_v,): "
    "one pass over chunks keeping (m, l, u)",
    _cases_online, online_output,
    ((NO_RESCALE, _online_no_rescale),
     ("dividing each chunk by its own sum and adding the results is not "
      "the softmax: keep the unnormalized u and l, divide once at the "
      "end", _online_divide_each_chunk),
     (NO_MAX, _online_no_max))))

# ---------------------------------------------------------- online_state


def _cases_state(rng):
    out = []
    for n, s, _, c in rows(rng):
        m = float(s.max())
        out.append(Case(n, (s, c), (m, float(np.exp(s - m).sum()))))
    return out


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


register("online_state", Exercise(
    3, "online_state(scores (N,), chunk) -> (m, l): the running maximum "
    "and denominator after the last chunk",
    _cases_state, online_state,
    ((NO_RESCALE, _state_no_rescale),
     ("m is the maximum over all chunks so far, not the last chunk's "
      "maximum", _state_last_max))))

"""Step-through figures: one frame per step of flashlab's own trace."""

import re

import matplotlib
import numpy as np
import pytest

from flashlab import online, tiled, viz

matplotlib.use("Agg")


def frames(html):
    """Number of frames and whether the Next button is there."""
    text = html.data
    return (len(set(re.findall(r"frames\[(\d+)\] =", text))),
            'title="Next frame"' in text)


def test_online_steps_one_frame_per_chunk(rng):
    s, v = rng.standard_normal(7), rng.standard_normal((7, 2))
    n, has_next = frames(viz.online_steps(s, v, chunk=3))
    assert n == len(online.stream(s, v, 3)) == 3 and has_next


def test_merge_steps_three_frames(rng):
    n, _ = frames(viz.merge_steps(rng.standard_normal(5),
                                  rng.standard_normal((5, 2)), split=2))
    assert n == 3


@pytest.mark.parametrize("causal", [False, True])
def test_tile_walk_and_causal_map_follow_the_trace(rng, causal):
    q, k, v = (rng.standard_normal((10, 4)) for _ in range(3))
    opts = dict(block_q=4, block_k=3, causal=causal)
    visited = len(tiled.trace(q, k, v, **opts))
    assert frames(viz.tile_walk(q, k, v, **opts))[0] == visited
    assert frames(viz.causal_map(10, 10, **opts))[0] == visited


def test_traffic_steps_reaches_the_ledger_totals():
    html = viz.traffic_steps(16, 4, block_q=8, block_k=8, steps=5)
    assert frames(html)[0] == 5
    book = viz.io.ledger("dense", 16, 4, block_q=8, block_k=8, record=True)
    assert sum(e for _, _, e in book.events) == book.total
    assert np.array_equal(
        [d for d, _, _ in book.events[:1]], ["read"])


def test_player_needs_no_network(rng):
    html = viz.merge_steps(rng.standard_normal(3),
                           rng.standard_normal((3, 1)), split=1).data
    assert "http://" not in html and "https://" not in html
    assert 'class="fa' not in html  # no icon font to fetch

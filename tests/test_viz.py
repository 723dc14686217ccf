"""Step-through figures: one frame per step of flashlab's own trace."""

import re

import matplotlib
import numpy as np
import pytest

from flashlab import online, reference, tiled, viz

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


def test_rescale_add_adds_up_to_the_online_state(rng):
    s, v = rng.standard_normal(9) * 5, rng.standard_normal((9, 3))
    steps = viz.rescale_add(s, v, chunk=2)
    ref = reference.softmax(s) @ v
    for st, want in zip(steps, online.stream(s, v, 2)):
        # rescaled + added must be the merged state, to rounding of a sum
        assert abs(st.rescaled.l + st.added.l - want.l) <= 1e-15 * want.l
        assert np.allclose(st.rescaled.u + st.added.u, want.u,
                           rtol=1e-14, atol=0)
        assert st.rescaled.l == st.alpha * st.old.l
        assert st.top == s[st.keys.start:st.keys.stop].max()
    assert np.max(np.abs(steps[-1].new.output() - ref)) < 1e-14
    assert steps[0].alpha == 0 and steps[0].old.l == 0


def test_rescale_lines_show_the_seed_arithmetic():
    scores = [1.0, 2.0, 0.0, 1.0, 3.0, 2.0]
    values = np.array([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0],
                       [2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    text = "\n".join(viz.rescale_lines(viz.rescale_add(scores, values,
                                                       2)[-1]))
    assert "1.871 x 0.368 = 0.688 + 1.368 = 2.056" in text
    assert "[1.607, 2.135] x 0.368 = [0.591, 0.786]" in text
    assert "+ [0.368, 2.368] = [0.959, 3.153]" in text


def test_merge_steps_three_frames(rng):
    n, _ = frames(viz.merge_steps(rng.standard_normal(5),
                                  rng.standard_normal((5, 2)), split=2))
    assert n == 3


@pytest.mark.parametrize("causal", [False, True])
def test_tile_walk_start_every_tile_and_end(rng, causal):
    q, k, v = (rng.standard_normal((5, 2)) for _ in range(3))
    opts = dict(block_q=2, block_k=3, causal=causal)  # ragged both ways
    visited = len(tiled.trace(q, k, v, **opts))
    html = viz.tile_walk(q, k, v, **opts)
    assert frames(html)[0] == visited + 2
    images = re.findall(r"frames\[\d+\] = \"([^\"]+)\"", html.data)
    assert len(set(images)) == len(images)  # every frame differs


@pytest.mark.parametrize("opts, want", [
    (dict(causal=True), dict(full=6, masked=4, skipped=6)),
    (dict(kv_lengths=np.array(9)), dict(full=8, masked=4, skipped=4)),
    (dict(causal=True, window=(4, 0)), dict(full=0, masked=7,
                                            skipped=9)),
])
def test_tile_map_counts_match_the_trace(rng, opts, want):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    got = viz.tile_map(ax, 16, 16, block_q=4, block_k=4, **opts)
    plt.close(fig)
    x = rng.standard_normal((16, 2))
    visited = len(tiled.trace(x, x, x, block_q=4, block_k=4, **opts))
    assert got == want and got["full"] + got["masked"] == visited


def test_traffic_steps_reaches_the_ledger_totals():
    html = viz.traffic_steps(16, 4, block_q=8, block_k=8, steps=5)
    assert frames(html)[0] == 5
    book = viz.io.ledger("dense", 16, 4, block_q=8, block_k=8, record=True)
    assert sum(e for _, _, e in book.events) == book.total
    assert np.array_equal(
        [d for d, _, _ in book.events[:1]], ["read"])


def test_every_frame_is_listed_as_text_with_numbers(rng):
    s, v = rng.standard_normal(5), rng.standard_normal((5, 2))
    players = [viz.online_steps(s, v, chunk=2),
               viz.merge_steps(s, v, split=2),
               viz.tile_walk(v, v, v, block_q=2, block_k=2),
               viz.traffic_steps(8, 2, block_q=4, block_k=4, steps=3)]
    for html in players:
        n, _ = frames(html)
        items = re.findall(r"<li><pre>(.*?)</pre></li>", html.data, re.S)
        assert len(items) == n and all(re.search(r"\d", t) for t in items)


def test_player_needs_no_network(rng):
    html = viz.merge_steps(rng.standard_normal(3),
                           rng.standard_normal((3, 1)), split=1).data
    assert "http://" not in html and "https://" not in html
    assert 'class="fa' not in html  # no icon font to fetch


def test_hbm_sram_draws_the_ledger_counts():
    import matplotlib.pyplot as plt

    fig, totals = viz.hbm_sram(6, 2, block_q=2, block_k=2)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    plt.close(fig)
    for s in ("dense", "fa2"):
        book = viz.io.ledger(s, 6, 2, block_q=2, block_k=2)
        assert totals[s] == book.total
        for n in book.reads.values():
            assert n == 0 or f"read {n:,}" in texts
    assert totals == {"dense": 240, "fa2": 96}  # seed 001's counts


def test_explorer_lanes_end_in_the_same_output(rng):
    import json

    q, k, v = (rng.standard_normal((5, 3)) * 3 for _ in range(3))
    html = viz.explorer(q, k, v, block_k=2).data
    data = json.loads(re.search(r"const data = (.*);", html).group(1))
    assert len(data) == 5  # one entry per query to choose
    o = reference.attention(q, k, v)
    for i, steps in enumerate(data):
        assert len(steps) == 3 + 1  # key tiles 0-1, 2-3, 4, then the end
        end = steps[-1]
        assert end["dense"].endswith(end["tiled"].split("= ")[-1])
        assert end["tiled"].endswith(viz._vec(o[i]))
        assert float(end["diff"]) < 1e-14


def test_sectors_and_bank_conflicts_count_what_the_primer_says():
    import matplotlib.pyplot as plt

    lanes = np.arange(32)
    assert len(viz.sectors(lanes * 4)) == 4  # 128 contiguous bytes
    assert len(viz.sectors(lanes * 256)) == 32  # one sector per lane
    assert len(viz.sectors(lanes * 8)) == 8
    assert viz.bank_conflicts((lanes * 32 + 5) * 4) == 32
    assert viz.bank_conflicts((lanes * 33 + 5) * 4) == 1
    assert viz.bank_conflicts(np.zeros(32, int)) == 1  # one word: broadcast
    assert viz.bank_conflicts(lanes % 2 * 128) == 2  # two words, one bank
    for fig in (viz.gpu_hierarchy(),
                viz.access_patterns({"a": lanes * 4}, "global"),
                viz.access_patterns({"b": lanes * 4}, "shared")):
        assert fig.axes
        plt.close(fig)


def test_a_folded_diff_counts_its_lines_and_hides_them():
    from unittest import mock

    from flashlab import show

    shown = []
    with mock.patch("IPython.display.display", shown.append):
        show.diff(online.stream, online.stream_normalized, fold=True)
        show.diff(online.stream, online.stream_normalized)
    folded, plain = shown[0].data, shown[1].data
    body = show.diff_text(online.stream, online.stream_normalized)
    added = sum(ln.startswith("+") for ln in body.splitlines()[2:])
    assert folded.startswith('<details class="flashlab-diff">')
    assert f"{added} lines added" in folded and "</details>" in folded
    assert plain.startswith("```diff") and "<details" not in plain

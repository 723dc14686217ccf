"""Chapter 12's figures: the numbers they draw are the models' and the
stored runs' own."""

import re

import matplotlib
import numpy as np
import pytest

from flashlab import fragments, measured, viz

matplotlib.use("Agg")


def test_ncu_sections_reads_every_metric_of_the_stored_profile():
    text = measured.text("hopper_profile_h200.txt")
    profile = viz.ncu_sections(text)
    assert list(profile) == [line[3:] for line in text.splitlines()
                             if line.startswith("== ")]
    # each section's metric lines, read here by a regex of their own
    for name, body in zip(profile, text.split("== ")[1:]):
        want = {m[0]: float(m[1].replace(",", "")) for m in re.findall(
            r"^\s+(\w+__\S+)\s+\S+\s+([\d,.]+)\s*$", body, re.M)}
        assert profile[name] == want and len(want) == 23
    stalls = viz.stall_reasons(next(iter(profile.values())))
    assert "selected" not in stalls and stalls["wait"] == 1.5


def test_ncu_sections_skips_what_is_not_a_metric():
    text = ("== k\n  Metric Name  Metric Unit  Metric Value\n"
            "  a__b  inst  1,234\n  c__d  %  n/a\n  ------  ---  ---\n")
    assert viz.ncu_sections(text) == {"k": {"a__b": 1234.0}}


def test_v7_program_is_the_intra_warpgroup_pipeline():
    before, loop, after = viz.v7_program()
    # issue S and P V, wait for S only, softmax under P V, then wait
    assert loop == ["barrier", "issue S", "issue PV", "wait S", "softmax",
                    "wait PV", "rescale", "to_a"]
    assert before[:2] == ["barrier", "issue S"] and before[-1] == "to_a"
    assert after == ["barrier", "issue PV", "wait PV"]


@pytest.mark.parametrize("softmax", [0.5, 0.75, 1.5])
def test_v7_timeline_keeps_the_kernels_dependencies(softmax):
    tiles, groups = 5, 2
    spans = viz.v7_timeline(viz.v7_program(), tiles, groups,
                            {"softmax": softmax})
    products = sorted((s for s in spans if s.who == "tensor cores"),
                      key=lambda s: s.start)
    for a, b in zip(products, products[1:]):  # one queue: no overlap
        assert b.start >= a.end - 1e-12
    barriers = [s.start for s in spans if s.who == "barrier"]
    assert len(barriers) == tiles + 1
    for g in range(groups):
        mine = {(s.what, s.tile): s for s in spans if s.group == g}
        assert {t for w, t in mine if w == "S"} == set(range(tiles))
        assert {t for w, t in mine if w == "PV"} == set(range(tiles))
        for j in range(tiles):
            # the softmax needs S_j; P V of tile j needs its softmax
            assert mine["softmax", j].start >= mine["S", j].end - 1e-12
            assert mine["PV", j].start >= mine["softmax", j].end - 1e-12
            assert mine["S", j].start >= barriers[j] - 1e-12
            if j:  # the softmax of tile j under P V of tile j - 1
                pv = mine["PV", j - 1]
                assert mine["softmax", j].start < pv.end
        lanes = sorted((s for s in spans if s.who == f"warpgroup {g}"),
                       key=lambda s: s.start)
        for a, b in zip(lanes, lanes[1:]):
            assert b.start >= a.end - 1e-12


def test_owners_are_the_fragment_places():
    acc, a = viz.wgmma_owners(64), viz.wgmma_owners()
    assert np.array_equal(np.bincount(acc.ravel()), np.full(128, 32))
    assert np.array_equal(np.bincount(a.ravel()), np.full(128, 8))
    assert np.array_equal(acc[:, :16], a)  # P goes back in unmoved
    warp = np.broadcast_to(np.arange(64)[:, None] // 16, acc.shape)
    assert np.array_equal(acc // 32, warp)  # warp w: rows 16 w..


def test_swizzle_slots_put_a_chunk_of_8_rows_in_8_slots():
    slots = viz.swizzle_slots()
    for k in range(8):  # every row and every chunk a permutation
        assert sorted(slots[k]) == sorted(slots[:, k]) == list(range(8))
    r, c = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    assert np.array_equal(slots, fragments.swizzle(r, c))


def test_figures_draw():
    import matplotlib.pyplot as plt

    rows = measured.rows("hopper_h200.csv")
    impls = sorted({r["impl"] for r in rows})
    for fig in (viz.core_matrices(), viz.wgmma_registers(),
                viz.swizzle_pattern(),
                viz.timeline_figure(viz.v7_timeline(viz.v7_program())),
                viz.stall_figure(viz.ncu_sections(
                    measured.text("hopper_profile_h200.txt"))),
                viz.hopper_bench(rows, impls, (1024, 4096, 16384)),
                viz.ladder_figure(measured.record(
                    "hopper_ladder_h200.json"))):
        assert fig.axes
        plt.close(fig)

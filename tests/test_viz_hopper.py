"""Chapter 12's figures: the numbers they draw are the models' and the
stored runs' own."""

import re

import matplotlib
import numpy as np
import pytest

from flashlab import fragments, measured, viz
from flashlab.gpu import forward_v8

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
        # the forwards' 23 metrics; backward_v7's sections have no L2
        # traffic, and their tensor-pipe metric reads "n/a" (skipped);
        # its d = 64 kernels and the fused one were profiled with dQ's
        # traffic as well: L2 reductions and throughput (and DRAM's for
        # the two kernels)
        # (backward_v8's two kernels, profiled in one session: those of
        # the dK/dV kernel, and the share of cycles that issue)
        # (v8's three forward sections, profiled in one session with
        # the backward's 28 and its tensor pipe's active cycles: 29)
        count = 23
        if name.startswith(("v8 bf16", "v8 e4m3")):
            count = 29
        elif name.startswith("backward_v8"):
            count = 28
        elif name.startswith("backward"):
            count = 22 + (4 if "fused" in name else 5 if " d64 " in name
                          else 0)
        assert profile[name] == want and len(want) == count
    first = next(iter(profile.values()))
    stalls = viz.stall_reasons(first)
    wait = "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
    assert "selected" not in stalls and stalls["wait"] == first[wait]
    assert len(stalls) == 18  # 19 stall metrics less "selected"


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


def test_mbarrier_model_completes_a_phase_on_arrivals_and_bytes():
    bar = viz.MBarrier(1)
    # fresh: the phase "before 0" (parity 1) counts as completed
    assert bar.try_wait(1) and not bar.try_wait(0)
    assert bar.ready(1) == (0.0, None) and bar.ready(0) is None
    bar.arrive(1.0, "producer", expect_tx=300)  # the arrival is in ...
    bar.complete_tx(100, 2.0, "TMA")
    assert not bar.try_wait(0)  # ... but 200 bytes are still missing
    bar.complete_tx(200, 1.5, "TMA")
    assert bar.phase == 1 and bar.try_wait(0) and not bar.try_wait(1)
    assert bar.ready(0) == (2.0, "TMA")  # when its last byte landed
    consumers = viz.MBarrier(256)
    consumers.arrive(3.0, "warpgroup 1", arrivals=128)
    assert consumers.phase == 0
    consumers.arrive(2.0, "warpgroup 0", arrivals=128)
    assert consumers.ready(0) == (3.0, "warpgroup 1")
    consumers.arrive(4.0, arrivals=200)
    with pytest.raises(ValueError, match="arrivals"):
        consumers.arrive(4.0, arrivals=100)


@pytest.mark.parametrize("d", [64, 128])
def test_v8_program_reads_the_kernels_stages_and_parities(d):
    from flashlab.gpu import forward_v8

    tiles = 6
    program = viz.v8_program(tiles, d)
    names = viz.v8_barrier_names()
    groups = forward_v8.groups(d, d)  # consumer warpgroups
    assert set(program) == {"producer"} | {f"warpgroup {g}"
                                           for g in range(groups)}
    for steps in program.values():  # one block barrier, before any wait
        kinds = [s.what for s in steps]
        assert kinds.count("barrier") == 1
        assert kinds.index("barrier") < kinds.index("wait")
    producer = program["producer"]
    inits = {names[s.bar]: s.value for s in producer if s.what == "init"}
    assert len(inits) == 9 and inits["Q full"] == inits["K full 1"] == 1
    assert inits["V empty 0"] == 128 * groups  # every consumer thread
    panels = d // forward_v8.PANEL
    for tensor, n in (("Q", 1), ("K", tiles), ("V", tiles)):
        loads = [s for s in producer if s.what == "load"
                 and s.value[0] == tensor]
        assert len(loads) == n * panels
    # every expect_tx counts the bytes of the boxes that follow it
    expects = [k for k, s in enumerate(producer) if s.what == "expect"]
    for a, b in zip(expects, expects[1:] + [len(producer)]):
        boxes = [s for s in producer[a + 1:b] if s.what == "load"]
        assert sum(s.value[1] for s in boxes) == producer[a].value
        assert {s.bar for s in boxes} == {producer[a].bar}
    # tile n: stage n % 2; consumers wait on phase (n // 2) % 2 of its
    # full barrier, the producer on the other parity of its empty one
    waits = [(names[s.bar], s.value) for s in producer if s.what == "wait"]
    assert waits == [(f"{x} empty {n % 2}", 1 - (n // 2) % 2)
                     for n in range(tiles) for x in "KV"]
    for g in range(2):
        steps = program[f"warpgroup {g}"]
        waits = [(names[s.bar], s.value) for s in steps
                 if s.what == "wait" and names[s.bar].startswith("K")]
        assert waits == [(f"K full {n % 2}", (n // 2) % 2)
                         for n in range(tiles)]
        issued = [s.value for s in steps if s.what == "issue S"]
        assert issued == [n % 2 for n in range(tiles)]
        assert [names[s.bar] for s in steps if s.what == "arrive"][:3] == [
            "K empty 0", "K empty 1", "V empty 0"]


@pytest.mark.parametrize("costs", [None, {"box": 2.0}, {"softmax": 2.5},
                                   {"S": 0.5, "PV": 2.0, "box": 0.1}])
def test_v8_timeline_keeps_the_handoffs(costs):
    tiles = 5
    spans, handoffs = viz.v8_timeline(viz.v8_program(tiles), costs)
    copies = {(s.what, s.tile): s for s in spans if s.who == "TMA"}
    assert set(copies) == {("Q", 0)} | {(x, j) for x in "KV"
                                        for j in range(tiles)}
    for unit in ("TMA", "tensor cores"):  # each unit runs one at a time
        busy = sorted((s for s in spans if s.who == unit),
                      key=lambda s: s.start)
        for a, b in zip(busy, busy[1:]):
            assert b.start >= a.end - 1e-12
    products = {(s.what, s.group, s.tile): s for s in spans
                if s.who == "tensor cores"}
    groups = forward_v8.groups(64, 64)  # v8_program's head dims
    assert len(products) == 2 * groups * tiles
    for g in range(groups):
        for j in range(tiles):
            # a product starts after its tiles landed ...
            assert products["S", g, j].start >= copies["K", j].end - 1e-12
            assert products["S", g, j].start >= copies["Q", 0].end - 1e-12
            assert products["PV", g, j].start >= copies["V", j].end - 1e-12
            if j >= 2:  # ... and a copy after both products of the stage
                # it overwrites are done reading it
                assert copies["K", j].start >= products["S", g, j - 2].end
                assert copies["V", j].start >= products["PV", g,
                                                         j - 2].end
    assert all(h.resumed >= h.ready for h in handoffs)
    for h in handoffs:  # full: TMA hands over; empty: the consumers
        if h.source is not None:
            assert (h.source == "TMA") == ("full" in h.bar)
            assert (h.waiter == "producer") == ("empty" in h.bar)


def _overwritten(spans):
    """(tensor, tile, warpgroup): a copy of `tile` started before that
    warpgroup's product of the tile two before (same stage) had ended."""
    copies = {(s.what, s.tile): s for s in spans if s.who == "TMA"}
    products = {(s.what, s.group, s.tile): s for s in spans
                if s.who == "tensor cores"}
    early = []
    for (tensor, j), copy in copies.items():
        what = "S" if tensor == "K" else "PV"
        for (w, g, tile), p in products.items():
            if (w, tile) == (what, j - 2) and copy.start < p.end - 1e-12:
                early.append((tensor, j, g))
    return early


@pytest.mark.parametrize("stops", [{0: 1, 1: 3}, {0: -1, 1: 0, 2: 2},
                                   {0: 4}])
def test_v8_warpgroups_that_stop_early_hand_every_stage_back(stops):
    # under a causal mask a warpgroup stops at its own last tile and
    # hands the block's later ones back after each lands: the producer
    # still copies every tile, each warpgroup multiplies only its own,
    # and no copy overwrites a stage a product still reads
    tiles = 5
    program = viz.v8_program(tiles, stops=stops)
    spans, handoffs = viz.v8_timeline(program)
    copied = {(s.what, s.tile) for s in spans if s.who == "TMA"}
    assert copied == {("Q", 0)} | {(x, j) for x in "KV"
                                   for j in range(tiles)}
    for g in range(forward_v8.groups(64, 64)):
        last = stops.get(g, tiles - 1)
        for what in ("S", "PV"):
            mine = [s.tile for s in spans if s.who == "tensor cores"
                    and (s.what, s.group) == (what, g)]
            assert mine == list(range(last + 1)), (g, what)
    assert not _overwritten(spans)
    assert all(h.resumed >= h.ready for h in handoffs)


def test_v8_model_catches_a_stage_handed_back_before_it_lands():
    # a warpgroup that stops early and arrives on "empty" without first
    # waiting for "full" counts towards the stage's earlier tile, and the
    # producer overwrites it under another warpgroup's product
    program = viz.v8_program(5, stops={0: 1, 1: 3})
    steps = program["warpgroup 0"]
    end = max(k for k, s in enumerate(steps) if s.what == "issue PV")
    program["warpgroup 0"] = steps[:end + 1] + [
        s for s in steps[end + 1:] if s.what != "wait"]
    assert _overwritten(viz.v8_timeline(program)[0])


def test_v8_model_stops_on_a_wrong_parity():
    # the producer waiting on the parity of its consumers: its first
    # wait needs the consumers to free a stage they never got
    program = viz.v8_program(3)
    steps = program["producer"]
    k = next(k for k, s in enumerate(steps) if s.what == "wait")
    steps[k] = steps[k]._replace(value=1 - steps[k].value)
    with pytest.raises(ValueError, match="producer waits on K empty 0 "
                                         "parity 0"):
        viz.v8_timeline(program)


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
                    "hopper_ladder_h200.json")),
                viz.v8_figure(*viz.v8_timeline(viz.v8_program()))):
        assert fig.axes
        plt.close(fig)


@pytest.fixture
def ping_pong(monkeypatch):
    """forward_v8 as built with its consumers' turns (PING_PONG)."""
    monkeypatch.setattr(forward_v8, "PING_PONG", True)


@pytest.mark.parametrize("d, stops", [(128, {}), (64, {}),
                                      (64, {0: -1, 1: 0, 2: 2}),
                                      (64, {0: 1, 1: 3})])
def test_v8_consumers_take_every_turn_once(d, stops, ping_pong):
    # ping-pong: a consumer waits for its turn before a tile's products
    # and passes it on after them, once per tile after the first, even
    # for the tiles it only hands back; consumer 0 gives itself the first
    # turn, so every turn waited for is passed exactly once
    tiles = 5
    program = viz.v8_program(tiles, d, stops=stops)
    groups = forward_v8.groups(d, d)
    waited, passed = {}, {}
    for g in range(groups):
        steps = program[f"warpgroup {g}"]
        turns = [s.bar for s in steps if s.what == "turn"]
        assert turns == [forward_v8.TURN + g] * (tiles - 1), (g, turns)
        for s in steps:
            if s.what == "pass":
                passed[s.bar] = passed.get(s.bar, 0) + 1
        waited[forward_v8.TURN + g] = len(turns)
    first = forward_v8.TURN
    assert passed == {b: n + (b == first) for b, n in waited.items()}
    viz.v8_timeline(program)  # and nobody waits forever


def test_v8_model_has_no_turns_where_the_kernel_has_none(monkeypatch):
    monkeypatch.setattr(forward_v8, "PING_PONG", False)
    program = viz.v8_program(4, 128)
    assert not [s for steps in program.values() for s in steps
                if s.what in ("turn", "pass")]
    viz.v8_timeline(program)


def test_v8_model_stops_without_the_first_turn(ping_pong):
    # consumer 0 must give itself the first turn: without that arrival
    # its named barrier never completes and no consumer issues again
    program = viz.v8_program(4, 128)
    steps = program["warpgroup 0"]
    k = next(k for k, s in enumerate(steps) if s.what == "pass")
    del steps[k]
    with pytest.raises(ValueError, match="waits for turn"):
        viz.v8_timeline(program)


def test_v8_model_stops_when_an_early_stopper_skips_its_turns(ping_pong):
    # a warpgroup that stops at its own last tile still takes the turns
    # of the tiles it hands back: without them the next one waits forever
    program = viz.v8_program(5, stops={0: 1})
    steps = program["warpgroup 0"]
    last_pv = max(k for k, s in enumerate(steps) if s.what == "issue PV")
    program["warpgroup 0"] = steps[:last_pv + 1] + [
        s for s in steps[last_pv + 1:] if s.what not in ("turn", "pass")]
    with pytest.raises(ValueError, match="waits for turn"):
        viz.v8_timeline(program)


def test_v8_block_that_visits_no_tile_waits_for_nothing():
    # rows that a bottom-right mask leaves without keys: tile_range gives
    # (tiles, tiles - 1) and each warpgroup's own_last is -1. The block
    # copies nothing, so its consumers must wait on no barrier (counting
    # handed-back tiles from own_last + 1 = 0 waited on copies that never
    # came: the kernel hung)
    program = viz.v8_program(6, empty=True)
    for role, steps in program.items():
        assert [s.what for s in steps if s.what not in (
            "init", "barrier")] == [], role
    viz.v8_timeline(program)

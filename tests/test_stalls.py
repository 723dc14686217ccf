"""flashlab.stalls: ncu's source-level stall samples summed per opcode and
per class of work, on a report written here in ncu's own layout, and on
the stored one that chapter 12 reads."""

import pytest

from flashlab import stalls

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Instructions Executed",'
          + ",".join(f'"stall_{r}"' for r in stalls.REASONS)
          + ',"stall_wait (Not Issued)"')


def line(address, sass, samples, executed, **reasons):
    """One instruction's row: samples split over `reasons`."""
    assert sum(reasons.values()) == samples
    cols = [str(reasons.get(r, 0)) for r in stalls.REASONS]
    return ",".join([f'"{address}"', f'"      {sass}"', f'"{samples}"',
                     f'"{executed}"', *(f'"{c}"' for c in cols), '"0"'])


REPORT = "\n".join([
    '"Kernel Name","forward_v8[abi:v1](Array<short>)"',
    HEADER,
    line("0x10", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ", 10, 4,
         wait=6, selected=4),
    line("0x20", "MUFU.EX2 R8, R8", 30, 64, wait=20, mio=5, selected=5),
    line("0x30", "MUFU.EX2 R9, R9", 10, 64, wait=10),
    line("0x40", "FFMA R1, R2, R3, -R4", 20, 64, selected=20),
    line("0x50", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5", 2, 8,
         selected=2),
    line("0x60", "@!P0  BRA 0x90", 18, 8, long_sb=18),
    line("0x70", "@P1   BRA 0x10", 10, 8, branch_resolving=10),
    "",
    '"Kernel Name","forward_v8_e4m3[abi:v2](Array<unsigned char>)"',
    HEADER,
    line("0x10", "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR24], RZ", 5,
         2, wait=5),
    line("0x20", "UIADD3 UR25, UP1, -UR5, UR37, URZ", 15, 6, wait=15),
])


def test_opcode_drops_predicate_and_modifiers():
    assert stalls.opcode("@!P0  BRA 0x7f17837c68d0") == "BRA"
    assert stalls.opcode("MUFU.EX2 R43, R43") == "MUFU"
    with pytest.raises(ValueError, match="sass"):
        stalls.opcode("   ")


def test_reduce_sums_each_opcode_of_each_kernel():
    rows = stalls.reduce(REPORT, "before")
    got = {(r["kernel"], r["opcode"]): r for r in rows}
    assert set(got) == {("bf16", "HGMMA"), ("bf16", "MUFU"),
                        ("bf16", "FFMA"), ("bf16", "SYNCS"),
                        ("bf16", "WAIT_BRA"), ("bf16", "BRA"),
                        ("e4m3", "QGMMA"), ("e4m3", "UIADD3")}
    mufu = got["bf16", "MUFU"]
    assert (mufu["samples"], mufu["executed"]) == (40, 128)
    assert (mufu["wait"], mufu["mio"], mufu["selected"]) == (30, 5, 5)
    # the branch after a try-wait is the wait's; the loop's own is not
    assert got["bf16", "WAIT_BRA"]["long_sb"] == 18
    assert got["bf16", "BRA"]["branch_resolving"] == 10
    assert all(r["build"] == "before" for r in rows)


def test_by_class_shares_sum_to_one():
    rows = stalls.reduce(REPORT, "after")
    shares = stalls.by_class(rows, "after", "bf16")
    assert set(shares) == set(stalls.CLASSES)
    assert shares["exponentials"][0] == pytest.approx(40 / 100)
    assert shares["tensor cores"][0] == pytest.approx(10 / 100)
    assert shares["tile handover"][0] == pytest.approx(20 / 100)
    assert shares["integer and control"][0] == pytest.approx(10 / 100)
    assert shares["other float"][1] == pytest.approx(64 / 220)
    for i in (0, 1):
        assert sum(s[i] for s in shares.values()) == pytest.approx(1)
    reasons = stalls.reason_shares(rows, "after", "e4m3")
    assert reasons["wait"] == pytest.approx(1)
    with pytest.raises(ValueError, match="no rows"):
        stalls.by_class(rows, "before", "bf16")


def test_reduce_refuses_text_that_is_not_a_source_page():
    with pytest.raises(ValueError, match="source page"):
        stalls.reduce("gpu__time_duration.sum ms 3.41\n", "before")


def test_stored_samples_cover_both_builds_and_kinds():
    rows = stalls.stored()
    for build in ("before", "after"):
        for kernel in ("bf16", "e4m3"):
            shares = stalls.by_class(rows, build, kernel)
            assert sum(s[0] for s in shares.values()) == pytest.approx(1)
            # every sample is one of the kept reasons, but for a few
            # rarer ones (drain, sleeping, tex, ...)
            covered = sum(stalls.reason_shares(rows, build, kernel)
                          .values())
            assert 0.9 < covered <= 1
    # the change that chapter 12 describes: less integer and branch work
    for kernel in ("bf16", "e4m3"):
        before, after = (stalls.by_class(rows, b, kernel)
                         ["integer and control"][0]
                         for b in ("before", "after"))
        assert after < before


def test_main_writes_each_builds_rows_into_one_file(tmp_path):
    for build in ("before", "after"):
        (tmp_path / f"{build}.csv").write_text(REPORT)
    out = tmp_path / "stalls.csv"
    rows = stalls.main([str(out), f"before={tmp_path / 'before.csv'}",
                        f"after={tmp_path / 'after.csv'}"])
    assert {r["build"] for r in rows} == {"before", "after"}
    text = out.read_text().splitlines()
    assert text[0].startswith("build,kernel,opcode,samples,executed")
    assert len(text) == 1 + len(rows) == 1 + 2 * 8
    with pytest.raises(SystemExit, match="usage"):
        stalls.main([str(out), "before.csv"])

"""flashlab.block_times on timelines worked out by hand."""

import pytest

from flashlab import block_times


def test_two_sms_by_hand():
    # SM 0: block A 0..10 µs, then block B 11..15; SM 1: block C 0..12,
    # which visits no tile; times in ns
    blocks = dict(sm=[0, 0, 1], start=[0, 11000, 0],
                  take=[1000, 11500, 2000], first=[3000, 12500, -1],
                  loop_end=[8000, 14000, 9000], end=[10000, 15000, 12000])
    got = block_times.summarize(blocks)
    assert got["blocks"] == 3 and got["sms"] == 2
    assert got["span_us"] == 15.0
    assert got["to_take_us"] == 1.0  # median of 1, 0.5, 2
    assert got["to_first_us"] == 1.5  # blocks A and B: 2 and 1
    assert got["loop_us"] == 3.25  # 5 and 1.5
    assert got["epilogue_us"] == 2.0  # 2, 1, 3
    # prologues 3 + 1.5 + 9 (C: to its loop's end), over two SMs
    assert got["sm_prologue_us"] == pytest.approx(13.5 / 2)
    assert got["sm_loop_us"] == pytest.approx(6.5 / 2)
    assert got["sm_epilogue_us"] == pytest.approx(6 / 2)
    assert got["sm_gaps_us"] == pytest.approx(1 / 2)  # A's end to B's
    assert got["sm_tail_us"] == pytest.approx(3 / 2)  # C ends at 12
    parts = ("sm_prologue_us", "sm_loop_us", "sm_epilogue_us",
             "sm_gaps_us", "sm_tail_us")
    assert sum(got[p] for p in parts) == pytest.approx(got["span_us"])


def test_bad_blocks_are_named():
    with pytest.raises(ValueError, match="missing"):
        block_times.summarize(dict(sm=[0], start=[0]))
    with pytest.raises(ValueError, match="one length"):
        block_times.summarize(dict(sm=[0], start=[0, 1], take=[0],
                                   first=[0], loop_end=[0], end=[0]))
    with pytest.raises(ValueError, match="at least one block"):
        block_times.summarize({p: [] for p in block_times.PARTS})

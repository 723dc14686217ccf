"""Chapter 9's version figures: their counts are the kernels' own."""

import matplotlib
import numpy as np
import pytest

from flashlab import viz
from flashlab.exercises import solution
from flashlab.gpu import device

matplotlib.use("Agg")


class Counted:
    """An SRAM array stand-in that counts the reads a device function makes."""

    def __init__(self, values):
        self.values, self.reads = values, 0

    def __getitem__(self, index):
        self.reads += 1
        return self.values[index]


@pytest.mark.parametrize("d", [16, 64, 128])
def test_loads_per_multiply_add_are_those_of_the_device_functions(rng, d):
    tl = device.tiles(d, d)
    counts = viz.kernel_counts(3, d, d)
    assert counts == viz.kernel_counts(4, d, d)._replace(
        softmax_threads=counts.softmax_threads, exps=counts.exps)
    q_s = Counted(rng.standard_normal((tl.BR, tl.DP)).astype(np.float32))
    k_s = Counted(rng.standard_normal((tl.BC, tl.DP)).astype(np.float32))
    s = np.zeros((tl.RM, tl.CN), np.float32)
    device.score_piece.py_func(s, np.zeros(tl.RM, np.float32), q_s, k_s,
                               tl.RM, tl.CN, tl.RM, tl.CN, d)
    want = q_s.values[tl.RM:2 * tl.RM, :d] @ k_s.values[tl.CN:2 * tl.CN,
                                                        :d].T
    assert np.max(np.abs(s - want)) < 1e-4 * d  # the piece it claims
    fmas = tl.RM * tl.CN * d
    assert (q_s.reads + k_s.reads) / fmas == counts.loads_s
    p_s = Counted(rng.random((tl.BR, tl.BCP)).astype(np.float32))
    v_s = Counted(rng.standard_normal((tl.BC, d)).astype(np.float32))
    acc = np.zeros((tl.RM, tl.OC), np.float32)
    device.output_piece.py_func(
        acc, np.zeros_like(acc), np.zeros(tl.OC, np.float32),
        np.ones(tl.RM, np.float32), p_s, v_s, 0, 1, tl.RM, tl.OC, tl.BC,
        tl.TX)
    fmas = tl.RM * tl.OC * tl.BC
    assert (p_s.reads + v_s.reads) / fmas == counts.loads_pv


def test_v1_and_v2_counts_follow_their_shapes():
    v1, v2 = viz.kernel_counts(1), viz.kernel_counts(2)
    assert (v1.rows, v1.keys, v1.hbm_reads) == (128, 1, 1.0)
    assert (v2.rows, v2.keys) == (64, 32)
    assert v2.hbm_reads == 1 / 64  # one staging per block of 64 rows
    assert v2.exps == 33  # a tile's 32 terms and one alpha


@pytest.mark.parametrize("d", [64, 128])
def test_owner_maps_cover_the_tile_as_the_kernels_split_it(d):
    tl = device.tiles(d, d)
    owners = viz.score_owners(3, d, d)
    piece = solution("thread_piece")
    for t in range(device.THREADS):
        rows, cols = piece(t, tl.TX, tl.RM, tl.CN)
        want = np.zeros(owners.shape, bool)
        want[np.ix_(rows, cols)] = True
        assert np.array_equal(owners == t, want)
    out = viz.output_owners(d, d)
    assert np.all(np.bincount(out.ravel()) == tl.RM * tl.OC)
    assert np.array_equal(out[0, :tl.TX], np.arange(tl.TX))  # strided
    v3, v4 = viz.softmax_owners(3, d, d), viz.softmax_owners(4, d, d)
    assert len(np.unique(v3)) == tl.BR == viz.kernel_counts(3, d,
                                                            d).softmax_threads
    assert len(np.unique(v4)) == device.THREADS
    assert np.bincount(v4.ravel()).max() == viz.kernel_counts(
        4, d, d).exps - tl.RM  # RM x CN terms per thread, plus RM alphas


def test_stage_owners_are_the_threads_device_stage_uses(rng):
    rows, cols, threads = 32, 64, 64
    src = rng.standard_normal((1, rows, cols)).astype(np.float32)
    writer = np.full((rows, cols), -1)

    class Recorded:
        def __init__(self, t):
            self.t = t

        def __setitem__(self, index, value):
            assert writer[index] == -1  # each element copied once
            writer[index] = self.t

    for t in range(threads):
        device.stage.py_func(Recorded(t), src, 0, 0, rows, cols,
                             np.float32(1), t, threads)
    assert np.array_equal(writer, viz.stage_owners(rows, cols, threads))


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_each_version_figure_draws_its_counts(version):
    import matplotlib.pyplot as plt

    now = viz.kernel_counts(version)
    before = viz.kernel_counts(max(version - 1, 1))
    want = {1: [64, 64, 2],  # q_i, u_i, (m_i, l_i) at d = d_v = 64
            2: [before.hbm_reads, now.hbm_reads],
            3: [before.loads_s, now.loads_s, before.loads_pv,
                now.loads_pv],
            4: [before.softmax_threads, now.softmax_threads, before.exps,
                now.exps]}[version]
    fig = viz.kernel_version(version)
    assert len(fig.axes) == (2 if version < 3 else 3)
    bars = [p.get_width() for p in fig.axes[-1].patches][::-1]
    assert bars == want
    plt.close(fig)

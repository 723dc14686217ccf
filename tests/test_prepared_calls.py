"""A prepared call's host logic, without a GPU: which inputs
`_ForwardPlan.run` takes as they are, copies or hands back, which
buffers it keeps for each stream, and how flashlab.torch finds a plan by
its own key. The kernels' launches are recorded, not run; CPU tensors
stand in for CUDA ones (their data pointers and strides are real)."""

from collections import namedtuple

import numpy as np
import pytest
import torch

from flashlab import gpu, reference
from flashlab import torch as fl_torch
from flashlab.gpu import host

Rules = namedtuple("Rules", "scale seed use_dropout")


class Packed:
    """A launch.Packed stand-in: its words, and each launch's copy."""

    def __init__(self, n):
        self.words = [0] * n
        self.launches = []
        self.seeds = []

    def launch(self, grid, block, stream):
        self.launches.append((stream, list(self.words)))

    def put(self, arg, field, code, value):
        self.seeds.append(value)


@pytest.fixture
def plan():
    """A forward plan of (2, 5, 8) float32 q, k, v, without its kernels."""
    made = object.__new__(host._ForwardPlan)
    made._capturing = lambda: False
    made.find, made.main = Packed(2), Packed(6)
    made.find_slots, made.main_slots = (0, 1), tuple(range(6))
    made.find_grid, made.grid, made.threads = (1, 2), (1, 2), 384
    made.o_shape, made.lse_shape = (2, 5, 8), (2, 5)
    made.bad_shape = (2, 1, 4)
    made.dtype, made.device = torch.float32, torch.device("cpu")
    made._empty, made._float32 = torch.empty, torch.float32
    made._scratch = {}
    made.rules = Rules(0.5, 0, False)
    made.stream = 7
    made.stream_of = lambda: made.stream
    return made


def qkv():
    return [torch.randn(2, 5, 8) for _ in range(3)]


def test_run_points_the_kernels_at_the_call_s_tensors(plan):
    q, k, v = qkv()
    o, lse = plan.run(q, k, v, None, True)
    (stream, words), = plan.main.launches
    assert stream == 7 and o.shape == (2, 5, 8) and lse.shape == (2, 5)
    assert words == [x.data_ptr() for x in (q, k, v, o, lse)] + [
        plan.find.words[1]]
    assert plan.find.launches == [(7, [v.data_ptr(), words[5]])]


def test_a_split_tail_launches_its_pieces_then_their_merge(plan):
    # the pieces: q, k, v, the halves and their lse, V's flags; then the
    # merge of the halves into this call's o and lse, on the same stream
    plan.tail, plan.halves_shape = 1, (4, 5, 4)
    plan.pieces, plan.merge = Packed(6), Packed(4)
    plan.piece_slots, plan.merge_slots = tuple(range(6)), tuple(range(4))
    plan.piece_grid, plan.merge_grid = (2, 1, 2), (1, 2)
    plan._int32 = torch.int32
    q, k, v = qkv()
    o, lse = plan.run(q, k, v, None, True)
    (stream, main), = plan.main.launches
    (p_stream, pieces), = plan.pieces.launches
    (m_stream, merge), = plan.merge.launches
    assert stream == p_stream == m_stream == 7
    assert pieces[:3] == main[:3] and pieces[5] == main[5]
    assert pieces[3:5] == merge[:2] and len(set(pieces[3:5])) == 2
    assert merge[2:] == [o.data_ptr(), lse.data_ptr()]


def test_flags_and_an_unwanted_lse_are_kept_per_stream(plan):
    q, k, v = qkv()
    o, lse = plan.run(q, k, v, None, False)
    assert lse is None
    flags, spare = plan.main.words[5], plan.main.words[4]
    assert spare != o.data_ptr()
    plan.run(q, k, v, None, False)  # the stream's next call: the same
    assert (plan.main.words[5], plan.main.words[4]) == (flags, spare)
    _, lse = plan.run(q, k, v, None, True)  # wanted: the caller's own
    assert plan.main.words[4] == lse.data_ptr() != spare
    plan.stream = 9  # another stream: buffers of its own
    plan.run(q, k, v, None, False)
    assert plan.main.words[5] != flags and plan.main.words[4] != spare
    assert set(plan._scratch) == {7, 9}
    for stream in range(10, 10 + host.SCRATCH_STREAMS):  # a stream a call
        plan.stream = stream
        plan.run(q, k, v, None, False)
        assert len(plan._scratch) <= host.SCRATCH_STREAMS
    assert stream in plan._scratch


def test_a_graph_s_capture_gets_buffers_of_its_own(plan):
    # a graph replays with the pointers it captured: not the buffers the
    # plan keeps, which a later eager call reuses and a full table frees
    q, k, v = qkv()
    plan.run(q, k, v, None, False)
    kept = dict(plan._scratch)
    plan._capturing = lambda: True
    plan.run(q, k, v, None, False)
    flags, spare = kept[7]
    assert plan.main.words[5] != flags.data_ptr()
    assert plan.main.words[4] != spare.data_ptr()
    assert plan._scratch == kept


def test_poisoned_outputs_keep_no_buffers(plan, monkeypatch):
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)
    o, lse = plan.run(*qkv(), None, True)
    assert torch.isnan(o).all() and torch.isnan(lse).all()
    assert plan._scratch == {}


def test_strided_inputs_are_copied_and_unaligned_ones_handed_back(plan):
    q, k, v = qkv()
    strided = torch.randn(2, 8, 5).transpose(1, 2)
    assert not strided.is_contiguous()
    plan.run(strided, k, v, None, True)
    assert plan.main.words[0] not in (0, strided.data_ptr())
    room = torch.empty(2 * 5 * 8 + 1)
    shifted = room[1:].view(2, 5, 8)  # contiguous, 4 bytes past 16
    assert shifted.data_ptr() % 16
    for args in ((shifted, k, v), (q, shifted, v), (q, k, shifted)):
        assert plan.run(*args, None, True) is None
    assert len(plan.main.launches) == len(plan.find.launches) == 1


def test_dropout_needs_its_seed(plan):
    plan.rules = Rules(0.5, 0, True)
    plan.run(*qkv(), 12345, True)
    assert plan.main.seeds == [12345]
    with pytest.raises(ValueError, match="seed: expected an integer"):
        plan.run(*qkv(), None, True)


class Remembered:
    """A plan flashlab.torch found: what it was asked, what it answers."""

    def __init__(self, answer):
        self.answer, self.asked = answer, []

    def run(self, q, k, v, seed, with_lse):
        self.asked.append((seed, with_lse))
        return self.answer


def remember(monkeypatch, q, k, v, answer, seed=None, **options):
    """A plan in flashlab.torch's table for attention(q, k, v, **options)
    (the keywords attention encodes, at their defaults otherwise)."""
    keywords = dict(block_q=None, block_k=None, scale=None, causal=False,
                    window=None, align=None, dropout_p=0.0, order="fa2",
                    num_splits=1, seed=seed, deterministic=True)
    keywords.update(options)
    found = Remembered(answer)
    monkeypatch.setattr(fl_torch, "_plans", {fl_torch._plan_key(
        fl_torch._encode(keywords), q, k, v): (found, seed)})
    return found


def test_torch_calls_a_remembered_plan_and_nothing_else(monkeypatch):
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    found = remember(monkeypatch, q, k, v, ("o", "lse"), causal=True)
    assert fl_torch.attention(q, k, v, is_causal=True) == "o"
    assert fl_torch.attention(q, k, v, is_causal=True,
                              return_lse=True) == ("o", "lse")
    assert found.asked == [(None, False), (None, True)]
    # another shape, other options, a mask: the plan is not asked
    fl_torch.attention(q[..., :8, :], k, v, is_causal=True)
    fl_torch.attention(q, k, v)
    fl_torch.attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=bool))
    assert len(found.asked) == 2


def test_torch_falls_back_when_the_plan_declines(monkeypatch):
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64)
               for _ in range(3))
    found = remember(monkeypatch, q, k, v, None)
    out = fl_torch.attention(q, k, v)
    assert found.asked == [(None, False)]
    want = reference.attention(*(x.numpy() for x in (q, k, v)))
    assert np.abs(out.numpy() - want).max() <= 1e-12


def test_torch_gives_the_plan_the_call_s_seed(monkeypatch):
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    found = remember(monkeypatch, q, k, v, ("o", "lse"), seed=5,
                     dropout_p=0.5)
    fl_torch.attention(q, k, v, dropout_p=0.5, seed=5)
    assert found.asked == [(5, False)]
    found = remember(monkeypatch, q, k, v, ("o", "lse"), dropout_p=0.5)
    torch.manual_seed(0)
    fl_torch.attention(q, k, v, dropout_p=0.5)  # drawn from torch's
    torch.manual_seed(0)
    drawn = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    assert found.asked == [(drawn, False)]


def test_large_buffers_and_many_plans_are_not_kept(plan, monkeypatch):
    # a plan keeps a stream's buffers only while they are small, and the
    # table of plans empties itself when full: many shapes (every prompt
    # length of a model) cannot hold GPU memory without end
    monkeypatch.setattr(host, "SCRATCH_BYTES", 2 * 5 * 4 - 1)  # < lse
    plan.run(*qkv(), None, False)
    assert plan._scratch == {}
    monkeypatch.setattr(host, "_plans", {})
    for key in range(host.PLANS + 3):
        assert host._new_plan(key, plan) is plan
        assert len(host._plans) <= host.PLANS
    assert host.PLANS + 2 in host._plans


def test_forward_plan_takes_the_keywords_flashlab_torch_decodes():
    # flashlab.torch asks for the plan a CUDA call used with the keywords
    # it decoded: every one of them is gpu.attention's (no plan on a CPU)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    fl_torch.attention(q, k, v, is_causal=True, dropout_p=0.1, seed=3)
    options = next(text for text in fl_torch._decoded
                   if '"seed": 3' in text)
    kw = fl_torch._decode(options, None, None, None)
    splits = kw.pop("num_splits")
    del kw["deterministic"]
    assert host.forward_plan(q, k, v, num_splits=splits, **kw) is None

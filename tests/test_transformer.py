"""A small transformer trained with SDPA and with flashlab: same losses."""

import pytest
import torch
import torch.nn.functional as F

from flashlab import torch as fl_torch
from flashlab import transformer


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_training_is_identical_in_float64(n_kv_heads):
    # 30 Adam steps: any difference in a forward or a gradient would
    # grow through the updates, so 1e-10 on every loss is a strict check
    want = transformer.train(F.scaled_dot_product_attention, steps=30,
                             n_kv_heads=n_kv_heads)
    got = transformer.train(fl_torch.attention, steps=30,
                            n_kv_heads=n_kv_heads)
    assert want[-1] < want[0] - 0.2  # it learns something
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-10


@pytest.mark.gpu
def test_training_on_the_gpu_within_float32():
    # float32 on the H200 (head dim 16: flashlab.gpu's v3 and float32
    # backward); SDPA's own float32 kernels differ from float64 by the
    # same order, so the budget is relative: 1e-4 of the loss
    shape = dict(width=64, n_heads=4, n_kv_heads=4)
    want = transformer.train(F.scaled_dot_product_attention, steps=30,
                             dtype=torch.float32, device="cuda", **shape)
    got = transformer.train(fl_torch.attention, steps=30,
                            dtype=torch.float32, device="cuda", **shape)
    exact = transformer.train(F.scaled_dot_product_attention, steps=30,
                              **shape)
    for a, b, c in zip(want, got, exact):
        assert abs(b - c) <= max(4 * abs(a - c), 1e-4 * c)


def test_stepper_takes_bf16_weights_and_adamw():
    # the GPT bench's configuration on the CPU (SDPA: flashlab's CPU path
    # takes float32 and float64): the loss is computed in float32 from
    # the bf16 logits, and the first one (before any update, same seed)
    # is float64's within bf16's rounding: 2^-8 of a loss of ~3.6 is
    # 0.014, and the rounding errors of the layers mostly cancel
    step = transformer.stepper(F.scaled_dot_product_attention,
                               dtype=torch.bfloat16,
                               optimizer=torch.optim.AdamW, lr=1e-3)
    tokens = transformer.batches(1)[0]
    loss = step(tokens)
    assert loss.dtype == torch.float32
    exact = transformer.train(F.scaled_dot_product_attention, steps=1)[0]
    assert abs(float(loss) - exact) < 0.02
    assert torch.isfinite(step(tokens))  # AdamW's update keeps it finite

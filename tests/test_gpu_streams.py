"""Several CUDA streams at once give one-at-a-time results, bit for bit.

flashlab's kernels use no atomics, so a call's output and gradients are
the same bits however often it runs; what concurrency could break is
what calls share: the launch path's cached plans and packed parameters,
constants copied to the device once, v8's tensor-map slots. Each stream
gets its own inputs (so any cross-talk shows) and runs the forward and
the backward of flashlab.torch.attention, first alone on the default
stream, then all streams launched before any is waited on, from one
thread and from one thread per stream. Needs -m gpu.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from flashlab import torch as fl_torch

pytestmark = pytest.mark.gpu

# (dtype, batch and heads of q, of k and v, Nq, Nk, d, options): the
# float32 and 16-bit kernels, masks, dropout and grouped heads
CASES = [
    (torch.float32, (2, 4), (2, 4), 300, 300, 64, dict(is_causal=True)),
    (torch.float32, (1, 4), (1, 2), 200, 333, 96,
     dict(enable_gqa=True)),
    (torch.bfloat16, (2, 8), (2, 8), 1000, 1000, 128,
     dict(is_causal=True)),
    (torch.bfloat16, (1, 4), (1, 4), 513, 700, 64,
     dict(dropout_p=0.2, seed=5)),
    (torch.float16, (2, 2), (2, 2), 257, 129, 64, dict()),
    (torch.float16, (1, 8), (1, 2), 640, 640, 128,
     dict(enable_gqa=True, is_causal=True)),
]


def inputs(rng, case):
    """q, k, v and dO of one case on the GPU, drawn from rng."""
    dtype, hq, hkv, nq, nk, d, _ = case

    def draw(*shape):
        x = torch.tensor(rng.standard_normal(shape), dtype=torch.float32)
        return x.to(device="cuda", dtype=dtype)

    return draw(*hq, nq, d), draw(*hkv, nk, d), draw(*hkv, nk, d), \
        draw(*hq, nq, d)


def run(case, q, k, v, do):
    """Output and (dq, dk, dv) of one case, on the current stream."""
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    o = fl_torch.attention(*xs, **case[-1])
    return [o.detach(), *torch.autograd.grad(o, xs, do)]


def on_stream(stream, case, data):
    """run() on `stream` once the default stream has made the inputs."""
    stream.wait_stream(torch.cuda.default_stream())
    with torch.cuda.stream(stream):
        return run(case, *data)


def check_same(alone, together):
    """Every output and gradient of every case equal, bit for bit."""
    for c, (want, got) in enumerate(zip(alone, together)):
        for name, w, g in zip(("o", "dq", "dk", "dv"), want, got):
            assert torch.equal(w, g), (c, name)


@pytest.fixture
def cases(rng):
    data = [inputs(rng, case) for case in CASES]
    alone = [run(case, *x) for case, x in zip(CASES, data)]
    torch.cuda.synchronize()
    return data, alone


def test_streams_from_one_thread(cases):
    data, alone = cases
    streams = [torch.cuda.Stream() for _ in CASES]
    for _ in range(3):  # launches of all streams overlap on the GPU
        together = [on_stream(s, case, x)
                    for s, case, x in zip(streams, CASES, data)]
        torch.cuda.synchronize()
        check_same(alone, together)


def test_streams_from_a_thread_each(cases):
    data, alone = cases
    streams = [torch.cuda.Stream() for _ in CASES]
    with ThreadPoolExecutor(len(CASES)) as pool:
        for _ in range(3):
            together = list(pool.map(on_stream, streams, CASES, data))
            torch.cuda.synchronize()
            check_same(alone, together)


def test_the_cases_differ(cases):
    # a test of cross-talk needs outputs that differ between streams
    _, alone = cases
    firsts = [float(out[0].float().flatten()[0]) for out in alone]
    assert len(set(np.round(firsts, 6))) == len(CASES)

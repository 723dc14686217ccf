"""Host time per call: flashlab.torch.attention against torch's SDPA.

What a model pays per attention call on a small problem, where the GPU's
own time is far below the host's: (1, 4, 128, 64) bf16 causal, called
as a user calls each (SDPA with no backend forced), the median of 5
loops of 200 calls after warm-up, one synchronize at each loop's end.
The forward alone (inputs without gradients) and a forward+backward
step (autograd from a fixed random dO). Microseconds per call;
vs_torch = SDPA's / flashlab's. Writes host.csv. See the launch-path
issue and chapter 10.
"""

from flashlab.bench import as_user, timing
from flashlab.bench.runner import Case, Suite

SHAPE = (1, 4, 128, 64)  # (B, H, N, d)
IMPLS = ("flashlab", "torch sdpa")
COLUMNS = ("device", "impl", "pass", "causal", "dtype", "B", "H", "N",
           "d", "calls", "us", "vs_torch")
SHOWN = ("device", "pass", "impl", "causal", "dtype", "N", "d", "calls",
         "us", "vs_torch")


def suite(shape=SHAPE, calls=200, device="cuda", dtype="bfloat16",
          causal=True):
    """The forward and the forward+backward step at one shape."""
    cases = tuple(Case(pass_, *shape, causal, IMPLS, "torch sdpa", calls,
                       dtype=dtype) for pass_ in ("forward", "fwd+bwd"))
    impls = {(pass_, name): as_user.call(name)
             for pass_ in ("forward", "fwd+bwd") for name in IMPLS}
    return Suite("host", cases, as_user.tensors(device), impls,
                 timing.host_loop(device), columns=COLUMNS, shown=SHOWN,
                 flops=None, device="gpu" if device == "cuda" else "cpu",
                 csv="host.csv")

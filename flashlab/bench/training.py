"""Training shapes: flashlab.torch.attention against SDPA's backends.

bf16, as a model calls each: a forward+backward step at B16 H12 N1K d64
causal (autograd from a fixed random dO), a forward at B2 H8 N1K d64, and
forward+backward steps at d128, causal, N from 2K to 8K (B8 H16, B4 H32,
B1 H16), and grouped heads (32 query heads on 8 K/V heads, B2 N4K d128
causal, forward and forward+backward), against torch's flash backend
(the baseline) and cuDNN where this build has it. ms by CUDA events
(host gaps included, as a model pays them), TFLOP/s by costs.flops
(forward plus backward for a step). Writes training.csv. See the
launch-path issue.
"""

from flashlab.bench import as_user, timing
from flashlab.bench.runner import Case, Suite

IMPLS = ("flashlab", "flashlab atomic dq", "torch flash", "torch cudnn")
SHAPES = (("fwd+bwd", 16, 12, 1024, 64, True),
          ("forward", 2, 8, 1024, 64, False),
          # the Hopper issue's training shapes, d = 128, causal
          ("fwd+bwd", 8, 16, 2048, 128, True),
          ("fwd+bwd", 4, 32, 4096, 128, True),
          ("fwd+bwd", 1, 16, 8192, 128, True),
          # grouped heads: H query heads on H_kv = 8 K/V heads (the
          # seventh field; H_kv = H where it is left out)
          ("forward", 2, 32, 4096, 128, True, 8),
          ("fwd+bwd", 2, 32, 4096, 128, True, 8))
COLUMNS = ("device", "impl", "pass", "causal", "dtype", "B", "H", "H_kv",
           "N", "d", "ms", "tflops", "vs_torch")
SHOWN = ("device", "pass", "impl", "causal", "B", "H", "H_kv", "N", "d",
         "ms", "tflops", "vs_torch")


def suite(shapes=SHAPES, reps=20, device="cuda", dtype="bfloat16"):
    """One case per (pass, B, H, N, d, causal[, H_kv]) of `shapes`."""
    cases = tuple(Case(*shape[:6], impls=IMPLS, baseline="torch flash",
                       reps=reps, dtype=dtype,
                       params={"H_kv": (shape + (shape[2],))[6]})
                  for shape in shapes)
    impls = {(pass_, name): as_user.call(name)
             for pass_ in ("forward", "fwd+bwd") for name in IMPLS}
    return Suite("training", cases, as_user.tensors(device), impls,
                 timing.on(device), columns=COLUMNS, shown=SHOWN,
                 device="gpu" if device == "cuda" else "cpu",
                 csv="training.csv", optional=("torch cudnn",))

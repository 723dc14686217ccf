"""One training step of a small GPT: SDPA against flashlab attention.

flashlab.transformer's TinyLM with 4 blocks, C = 512 (8 heads of 64),
T = 1024, B = 8, vocabulary 512, bf16 weights, AdamW: built twice from
one seed, once calling torch's SDPA and once flashlab.torch.attention,
and trained on the same batches. ms per step by the wall clock after
warm-up; vs_torch = SDPA's / flashlab's; loss_diff the largest |loss
difference| to the SDPA run over the first COMPARE steps, which says
the two runs train the same model. Writes gpt.csv.
"""

from flashlab.bench import as_user, timing
from flashlab.bench.runner import Case, Suite

IMPLS = ("flashlab", "torch sdpa")
COMPARE = 10  # steps whose losses are compared
WARM = 3
COLUMNS = ("device", "impl", "pass", "dtype", "B", "H", "N", "C", "layers",
           "ms", "vs_torch", "loss_diff")
SHOWN = ("device", "impl", "dtype", "B", "N", "C", "layers", "ms",
         "vs_torch", "loss_diff")


def suite(batch=8, n=1024, width=512, heads=8, layers=4, vocab=512,
          reps=20, device="cuda", dtype="bfloat16"):
    """One case: the model's shape; N is T, d the head size."""
    case = Case("step", batch, heads, n, width // heads, True, IMPLS,
                "torch sdpa", reps, dtype=dtype,
                params=dict(C=width, layers=layers, vocab=vocab))
    impls = {("step", name): _model(name, device) for name in IMPLS}
    return Suite("gpt", (case,), _inputs(device), impls,
                 timing.steps(device, WARM), columns=COLUMNS, shown=SHOWN,
                 flops=None, device="gpu" if device == "cuda" else "cpu",
                 csv="gpt.csv", extra=_loss_diff)


def _inputs(device):
    def inputs(case):
        """The batches every run trains on, and each run's losses."""
        from flashlab import transformer

        steps = WARM + case.reps
        found = transformer.batches(steps, case.B, case.N,
                                    case.params["vocab"])
        return dict(batches=[t.to(device) for t in found], losses={})
    return inputs


def _model(name, device):
    def make(case, x):
        """A step of the model built from seed 0; its losses kept."""
        import torch

        from flashlab import transformer

        step = transformer.stepper(
            as_user.attention(name), dtype=getattr(torch, case.dtype),
            device=device, optimizer=torch.optim.AdamW, lr=1e-3,
            vocab=case.params["vocab"], width=case.params["C"],
            n_heads=case.H, n_kv_heads=case.H,
            layers=case.params["layers"], context=case.N)
        losses = x["losses"].setdefault(name, [])

        def call():
            batch = x["batches"][len(losses) % len(x["batches"])]
            losses.append(step(batch))
        return call
    return make


def _loss_diff(case, x):
    """{impl: {loss_diff}}: max |loss - SDPA's loss| over COMPARE steps."""
    want = [float(t) for t in x["losses"][case.baseline][:COMPARE]]
    return {name: {"loss_diff": max(abs(float(a) - b) for a, b in
                                    zip(got[:COMPARE], want))}
            for name, got in x["losses"].items()}

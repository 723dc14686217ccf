"""Attention as a model calls it, by name, for the torch-level suites.

"flashlab" is flashlab.torch.attention ("flashlab atomic dq" with
deterministic=False: its backward may add dQ by atomics, which on Hopper
is backward v8's fused kernel);
"torch sdpa"
is torch's scaled_dot_product_attention choosing its own backend;
"torch flash" and "torch cudnn" restrict it to one backend.
"""

import functools

_BACKENDS = {"torch flash": "FLASH_ATTENTION",
             "torch cudnn": "CUDNN_ATTENTION"}


def attention(name):
    """The call `name` names, with SDPA's signature."""
    import torch.nn.functional as F

    from flashlab import torch as fl_torch

    if name == "flashlab":
        return fl_torch.attention
    if name == "flashlab atomic dq":  # the backward's dQ by atomics
        return functools.partial(fl_torch.attention, deterministic=False)
    if name == "torch sdpa":
        return F.scaled_dot_product_attention
    if name not in _BACKENDS:
        raise ValueError(f"name: expected 'flashlab', 'flashlab atomic "
                         f"dq', 'torch sdpa' or one of {tuple(_BACKENDS)}, "
                         f"got {name!r}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, _BACKENDS[name])

    def restricted(*args, **kwargs):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(*args, **kwargs)
    return restricted


def kv_heads(case):
    """The case's K/V heads: params["H_kv"] where given (grouped heads),
    else its H."""
    return case.params.get("H_kv", case.H)


def tensors(device):
    """inputs(case): q, k, v, dO (B, H, N, d) in the case's dtype (k and v
    with kv_heads(case) heads), seeded by the shape; q, k, v are leaves
    with gradients for a fwd+bwd step."""
    def inputs(case):
        import torch

        gen = torch.Generator(device=device).manual_seed(case.N + case.B)
        heads = (case.H, kv_heads(case), kv_heads(case), case.H)
        x = [torch.randn(case.B, h, case.N, case.d, device=device,
                         dtype=getattr(torch, case.dtype), generator=gen)
             for h in heads]
        for t in x[:3]:
            t.requires_grad_(case.pass_ == "fwd+bwd")
        return x
    return inputs


def call(name):
    """impl(case, inputs): the forward, or for a fwd+bwd case the
    forward and autograd's backward from the fixed dO; enable_gqa where
    the case's K/V heads are fewer."""
    def make(case, x):
        import torch

        attend = attention(name)
        if kv_heads(case) != case.H:
            attend = functools.partial(attend, enable_gqa=True)
        q, k, v, do = x
        if case.pass_ == "forward":
            return lambda: attend(q, k, v, is_causal=case.causal)
        return lambda: torch.autograd.grad(
            attend(q, k, v, is_causal=case.causal), (q, k, v), do)
    return make

"""A small causal transformer whose attention call is a parameter.

Train it once with torch's scaled_dot_product_attention and once with
flashlab.torch.attention, from the same seed, and the two runs must give
the same losses: the drop-in changes the kernel and nothing else. Heads
may be grouped (n_kv_heads < n_heads). See chapter 8.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, width, n_heads, n_kv_heads, attention):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = width // n_heads
        kv = 2 * n_kv_heads * self.head_dim
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, width + kv)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.attention = attention

    def forward(self, x):
        b, n, width = x.shape  # (B, N, width)
        q, k, v = self.qkv(self.norm1(x)).split(
            [width, *(self.n_kv_heads * self.head_dim,) * 2], dim=-1)
        q = q.view(b, n, self.n_heads, -1).transpose(1, 2)  # (B, H, N, e)
        k, v = (t.view(b, n, self.n_kv_heads, -1).transpose(1, 2)
                for t in (k, v))  # (B, H_kv, N, e)
        o = self.attention(q, k, v, is_causal=True,
                           enable_gqa=self.n_kv_heads != self.n_heads)
        x = x + self.out(o.transpose(1, 2).reshape(b, n, width))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, blocks, a norm and the logits."""

    def __init__(self, attention, vocab=32, width=32, n_heads=4,
                 n_kv_heads=2, layers=2, context=64):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            Block(width, n_heads, n_kv_heads, attention)
            for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):  # (B, N) -> logits (B, N, vocab)
        x = self.tokens(tokens) + self.positions(
            torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batches(steps, batch=8, n=32, vocab=32, seed=0):
    """Sequences with structure to learn: each repeats a random motif of
    2 to 4 tokens, so after one period every token can be copied from
    earlier ones (which takes attention)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            period = int(torch.randint(2, 5, (), generator=gen))
            motif = torch.randint(0, vocab, (period,), generator=gen)
            rows.append(motif.repeat(n // period + 1)[:n + 1])
        out.append(torch.stack(rows))  # (B, N + 1)
    return out


def stepper(attention, dtype=torch.float64, device="cpu", seed=0,
            optimizer=torch.optim.Adam, lr=1e-2, **shape):
    """A TinyLM built from `seed` and its optimizer, as step(tokens):
    one training step on tokens (B, N + 1), returning the loss."""
    torch.manual_seed(seed)
    model = TinyLM(attention, **shape).to(device=device, dtype=dtype)
    opt = optimizer(model.parameters(), lr=lr)

    def step(tokens):
        logits = model(tokens[:, :-1])  # (B, N, vocab)
        # bf16 logits are lifted to float32 for the softmax of the loss
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def train(attention, steps=30, dtype=torch.float64, device="cpu", seed=0,
          **shape):
    """Losses of `steps` Adam steps of a TinyLM with this attention."""
    step = stepper(attention, dtype, device, seed, **shape)
    return [float(step(tokens.to(device)))
            for tokens in batches(steps, seed=seed)]

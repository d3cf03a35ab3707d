"""A small character-level transformer language model whose top-level children are its layers.

Usage::

    model = CharTransformer(vocab_size=96, dim=128, depth=4, heads=4, seq_len=64)
    logits = model(ids)                # ids (batch, seq) int64 -> (batch, seq, vocab)
    list(dict(model.named_children()))  # ['embed', 'block0', ..., 'block3', 'norm', 'head']

It is an ``nn.Sequential``, so the planner can cut it between any two children and ``span`` can
pipeline it. Every child takes and returns one tensor.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CharTransformer", "Embedding", "Block", "lm_loss", "generate"]


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` ids → ``(B, T, dim)``."""

    def __init__(self, vocab_size: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(seq_len, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[-1]
        if t > self.seq_len:
            raise ValueError(f"input has {t} positions; this model was built for seq_len <= {self.seq_len}")
        pos = torch.arange(t, device=ids.device)
        return self.tokens(ids) + self.positions(pos)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must divide by heads={heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Sequential):
    """``embed``, ``block0`` … ``block{depth-1}``, ``norm``, ``head`` as an ``nn.Sequential``."""

    def __init__(
        self, vocab_size: int, dim: int = 128, depth: int = 4, heads: int = 4, seq_len: int = 64
    ) -> None:
        for name, value in (
            ("vocab_size", vocab_size),
            ("dim", dim),
            ("depth", depth),
            ("heads", heads),
            ("seq_len", seq_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CharTransformer({name}={value!r}) must be an int >= 1")
        layers: OrderedDict[str, nn.Module] = OrderedDict(embed=Embedding(vocab_size, dim, seq_len))
        for i in range(depth):
            layers[f"block{i}"] = Block(dim, heads)
        layers["norm"] = nn.LayerNorm(dim)
        layers["head"] = nn.Linear(dim, vocab_size)
        super().__init__(layers)
        self.seq_len = seq_len
        self.vocab_size = vocab_size


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy; ``logits (B, T, V)``, ``target (B, T)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1).to(logits.device))


@torch.no_grad()
def generate(
    model: nn.Sequential,
    prompt: torch.Tensor,
    length: int,
    *,
    temperature: float = 0.8,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample ``length`` characters after ``prompt`` (1-D ids), running each layer where it lives.

    Works whatever devices the layers were placed on: the activation follows each layer's
    parameters. Returns the new ids (1-D, on the CPU).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    seq_len = getattr(model, "seq_len", prompt.numel())
    ids = prompt.detach().to("cpu").view(-1).tolist()
    out: list[int] = []
    was_training = model.training
    model.eval()
    try:
        for _ in range(length):
            x = torch.tensor([ids[-seq_len:]], dtype=torch.long)
            for layer in model:
                dev = next((p.device for p in layer.parameters()), x.device)
                x = layer(x.to(dev))
            probs = torch.softmax(x[0, -1].float().cpu() / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(nxt)
            out.append(nxt)
    finally:
        model.train(was_training)
    return torch.tensor(out, dtype=torch.long)

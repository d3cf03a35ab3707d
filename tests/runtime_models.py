"""Small models for the runtime tests (a helper module, not a test file)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def sequential(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 3),
    )


class Residual(nn.Module):
    """fx-traceable: residual connections, two inputs, keyword arguments, a model-owned parameter, tuple
    output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.block1 = nn.Linear(16, 16)
        self.block2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(
        self, x: torch.Tensor, extra: torch.Tensor, *, mask: torch.Tensor | None = None, gain: float = 1.0
    ) -> Any:
        h = torch.relu(self.embed(x)) + extra
        r = h
        h = torch.relu(self.block1(h)) * self.scale
        h = self.block2(h) + r + x.sum(-1, keepdim=True)  # x itself crosses every cut
        if mask is not None:
            h = h * mask
        return self.head(h) * gain, h.mean(-1, keepdim=True)


def residual(seed: int = 0) -> Residual:
    torch.manual_seed(seed)
    return Residual()


def residual_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out[0], y) + out[1].pow(2).mean()


class Untraceable(nn.Module):
    """fx cannot trace it: data-dependent control flow; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        if h.abs().sum() > 1e6:  # data-dependent: never true for the test data
            h = h * 0
        h = torch.tanh(self.b(h))
        return {"out": self.c(h), "aux": h}


def untraceable(seed: int = 0) -> Untraceable:
    torch.manual_seed(seed)
    return Untraceable()


def dict_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out["out"], y) + out["aux"].mean()

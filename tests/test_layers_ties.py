"""Tied parameters across layers: structural (one Parameter, several names) and functional (read by another
layer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from torchspan.layers.blocks import find_layers
from torchspan.layers.ties import Alias, find_ties


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class TiedLM(nn.Module):
    """Head defined first, its weight the embedding's; one block reuses another's bias too."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 10, bias=False)
        self.embed = nn.Embedding(10, 8)
        self.head.weight = self.embed.weight
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.blocks[2].fc.bias = self.blocks[0].fc.bias

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_structural_ties_with_aliases_and_layers_in_execution_order() -> None:
    m = TiedLM()
    layers = find_layers(m, torch.randint(0, 10, (2, 4)))
    assert layers.names() == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    ties = find_ties(m, layers)
    assert [(t.name, t.layers) for t in ties] == [
        ("head.weight", ("embed", "head")),
        ("blocks.0.fc.bias", ("blocks.0", "blocks.2")),
    ]
    assert ties[0].aliases == (Alias("head.weight", "head"), Alias("embed.weight", "embed"))
    assert ties[0].numel == 80 and ties[0].nbytes == 320 and ties[0].readers == ()
    # a plain list of layers gives the same structural ties
    assert [t.name for t in find_ties(m, list(layers))] == ["head.weight", "blocks.0.fc.bias"]


def test_no_tie_within_one_layer_and_none_in_an_untied_model() -> None:
    class Inside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    m = nn.Sequential(Inside(), nn.Linear(4, 2))
    assert find_ties(m, find_layers(m, torch.randn(2, 4))) == []
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        find_ties("model", [])  # type: ignore[arg-type]


def test_functional_tie_read_by_another_layer() -> None:
    class Head(nn.Module):
        def forward(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return F.linear(h, w)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = Head()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            for b in self.blocks:
                h = b(h)
            return self.head(h, self.embed.weight)

    m = LM()
    layers = find_layers(m, torch.randint(0, 10, (2, 3)))
    (tie,) = find_ties(m, layers)
    assert (tie.name, tie.layers, tie.readers) == ("embed.weight", ("embed", "head"), ("head",))
    assert tie.aliases == (Alias("embed.weight", "embed"),)
    assert find_ties(m, list(layers)) == []  # without the recording, only structure is known

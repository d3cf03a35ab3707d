"""Model → ordered layers: naming contract, mode choice, fx split at child boundaries."""

from __future__ import annotations

import pytest
import torch
from runtime_models import residual, sequential, untraceable
from torch import nn

from torchspan import layers as split


def test_layer_names_and_execution_order() -> None:
    class Reordered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 2)
            self.body = nn.Linear(4, 4)
            self.unused = nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    m = Reordered()
    assert [n for n, _ in split.top_level_layers(m)] == ["head", "body", "unused"]
    assert split.execution_order(m, torch.randn(2, 4)) == ["body", "head", "unused"]
    assert split.execution_order(sequential()) == [str(i) for i in range(7)]
    bare = nn.Linear(2, 2)  # a model without children is one layer, named "" (issue 10: it was refused)
    assert split.top_level_layers(bare) == [("", bare)]
    # fx finds the same order from the graph, without running the model
    assert split.graph_layer_order(split.trace(m), ["head", "body", "unused"]) == ["body", "head", "unused"]


def test_choose_mode() -> None:
    assert split.choose_mode(sequential())[0] == "sequential"
    assert split.choose_mode(residual())[0] == "fx"
    mode, why, graph = split.choose_mode(untraceable())
    assert mode == "own-forward" and "Untraceable" in why and "TraceError" in why


def test_split_graph_carries_live_values_and_matches_model() -> None:
    m = residual()
    graph = split.trace(m, split.default_concrete_args(m))
    stage_of = {"embed": 0, "block1": 1, "block2": 1, "head": 2}
    mods, root_attrs = split.split_graph(m, graph, stage_of, 3)
    assert root_attrs == {"scale": 1}  # the model's own parameter goes where it is first read
    x, extra = torch.randn(4, 6), torch.randn(4, 16)
    carry = mods[0](x, extra, None, 1.0)
    assert isinstance(carry, tuple) and len(carry) == 2  # h (also the residual r) and x
    carry = mods[1](*carry)
    out = mods[2](*carry)
    ref = m(x, extra)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1])


def test_split_graph_rejects_out_of_order_stages() -> None:
    m = residual()
    graph = split.trace(m, split.default_concrete_args(m))
    with pytest.raises(
        ValueError, match="layer 'block1' \\(stage 0\\) runs after layer 'embed' \\(stage 1\\)"
    ):
        split.split_graph(m, graph, {"embed": 1, "block1": 0, "block2": 1, "head": 1}, 2)


def test_concrete_key_specialises_non_tensors() -> None:
    m = residual()
    x, e = torch.randn(2, 6), torch.randn(2, 16)
    values, concrete, key = split.concrete_key(m, (x, e), {"gain": 2.0})
    assert values[:2] == [x, e] and values[2:] == [None, 2.0]
    assert concrete == {"mask": None, "gain": 2.0}
    _, _, key2 = split.concrete_key(m, (x, e), {"mask": torch.ones(16)})
    assert key != key2
    with pytest.raises(TypeError, match="Residual.forward"):
        split.concrete_key(m, (x,), {})

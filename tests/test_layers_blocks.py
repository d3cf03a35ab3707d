"""Layers that descend: blocks in containers at any depth, execution order, roots, merges, overrides."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from torchspan.layers.blocks import find_layers, param_layers
from torchspan.layers.calltrace import record_calls


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Wrapper(nn.Module):
    """User style: the head is registered before the blocks but runs after them."""

    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.head = nn.Linear(d, 3)
        self.embed = nn.Linear(5, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.scale = nn.Parameter(torch.ones(d))  # the model's own tensor, read after the blocks
        self.drop = nn.Dropout(0.5)  # stateless, used twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(x))
        for block in self.blocks:
            h = block(h)
        return self.head(self.drop(self.norm(h) * self.scale))


def _covers_once(model: nn.Module, layers) -> None:
    """Every qualified parameter name maps to exactly one layer, and the layers' parameters are disjoint."""
    owner = param_layers(model, layers)
    assert sorted(owner) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    assert set(owner.values()) <= set(layers.names())
    seen = Counter(n for layer in layers for n, _ in layer.module.named_parameters())
    assert sum(seen.values()) + len([r for r in layers.roots if r.kind == "parameter"]) == len(
        list(model.named_parameters(remove_duplicate=False))
    )


def test_wrapper_blocks_in_execution_order_with_roots() -> None:
    m = Wrapper()
    layers = find_layers(m, torch.randn(2, 5))
    assert layers.names() == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    assert [layer.index for layer in layers] == list(range(7))
    assert layers.skipped == ("drop",)  # no tensors and runs twice: not a layer
    assert [(r.name, r.kind, r.owner, r.reader) for r in layers.roots] == [("scale", "parameter", "", "norm")]
    assert layers.by_name("head").param_count == 8 * 3 + 3
    assert layers.by_name("head").param_bytes == (8 * 3 + 3) * 4
    assert all(layer.ran and not layer.merged for layer in layers)
    owner = param_layers(m, layers)
    assert owner["blocks.2.fc1.weight"] == "blocks.2" and owner["scale"] == "norm"
    _covers_once(m, layers)


def test_recording_changes_nothing() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2)).train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(6, 4)
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    layers = find_layers(m, x)
    torch.testing.assert_close(torch.rand(3), expected)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert layers.names() == ["0", "1", "2", "3"]  # an nn.Sequential keeps its children


def test_no_container_falls_back_to_top_level_children_in_execution_order() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 2)
            self.body = nn.Sequential(nn.Linear(3, 4))  # a container inside a child would descend...
            self.unused = nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    names = find_layers(Flat(), torch.randn(2, 3)).names()
    assert names == ["body.0", "head", "unused"]  # ...into its blocks; an unused layer comes last

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Linear(4, 2)
            self.a = nn.Linear(3, 4)
            self.act = nn.ReLU()  # never used, holds nothing: not a layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    layers = find_layers(Plain(), torch.randn(2, 3))
    assert layers.names() == ["a", "b"] and [lay.ran for lay in layers] == [True, True]
    assert layers.skipped == ("act",)
    with pytest.raises(ValueError, match="no child modules"):
        find_layers(nn.Linear(2, 2), torch.randn(1, 2))


def test_nested_containers_and_split_points_and_no_split() -> None:
    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(5, 8)
            self.layers = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(8, 2)
            self.body = Body()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.body(x))

    m, x = Model(), torch.randn(2, 5)
    assert find_layers(m, x).names() == ["body.inp", "body.layers.0", "body.layers.1", "body.layers.2", "out"]
    split = find_layers(m, x, split_points=["body.layers.1.fc2"])
    assert split.names() == [
        "body.inp",
        "body.layers.0",
        "body.layers.1.fc1",
        "body.layers.1.fc2",
        "body.layers.2",
        "out",
    ]
    _covers_once(m, split)
    assert find_layers(m, x, no_split=[Body]).names() == ["body", "out"]
    assert find_layers(m, x, no_split=["Body"]).names() == ["body", "out"]
    with pytest.raises(ValueError, match="'body.layers.1.fc3' is not the qualified name.*'body.layers.1.fc"):
        find_layers(m, x, split_points=["body.layers.1.fc3"])
    with pytest.raises(ValueError, match="inside 'body' \\(Body\\), a class listed in no_split"):
        find_layers(m, x, split_points=["body.layers.1"], no_split=[Body])
    with pytest.raises(TypeError, match="no_split entries"):
        find_layers(m, x, no_split=[3])


def test_bypassed_block_forward_descends_into_what_runs() -> None:
    class Bypass(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:  # the block's own forward never runs: its pieces are the layers
                x = b.fc2(b.fc1(x))
            return x

    m = Bypass()
    layers = find_layers(m, torch.randn(2, 8))
    assert layers.names() == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    _covers_once(m, layers)


def test_module_run_twice_is_merged_into_its_enclosing_module_or_refused() -> None:
    class Shared(nn.Module):  # ALBERT style: one block applied three times
        def __init__(self) -> None:
            super().__init__()
            self.groups = nn.ModuleList([Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(3):
                x = self.groups[0](x)
            return x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(5, 8)
            self.encoder = Shared()
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(x)))

    layers = find_layers(Model(), torch.randn(2, 5))
    assert layers.names() == ["embed", "encoder", "head"]
    assert layers.by_name("encoder").merged == "'encoder.groups.0' runs 3 times in one forward"

    class TopLevelReuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[0](self.blocks[1](self.blocks[0](x)))

    # no module short of the whole model encloses both calls: a layer called twice (its stages keep the calls
    # together)
    layers = find_layers(TopLevelReuse(), torch.randn(2, 8))
    assert layers.names() == ["blocks.0", "blocks.1"] and layers.by_name("blocks.0").calls == 2
    assert layers.calls == ("blocks.0", "blocks.1", "blocks.0")


def test_sub_module_called_outside_its_layer_is_merged_or_refused() -> None:
    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return self.blocks[0].fc2(torch.cat([x, x], dim=-1))  # a piece of block 0, after block 1

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Body()
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    layers = find_layers(Model(), torch.randn(2, 8))
    assert layers.names() == ["body", "head"]
    assert layers[0].merged == "'body.blocks.0.fc2' (part of 'body.blocks.0') is called outside every layer"

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[1](self.blocks[0](x)) + self.blocks[0].fc2(torch.cat([x, x], dim=-1))

    with pytest.raises(
        ValueError, match="'blocks.0.fc2' \\(part of 'blocks.0'\\) is called outside every layer"
    ):
        find_layers(Top(), torch.randn(2, 8))


def test_layer_called_inside_another_layer_is_merged() -> None:
    class Inner(nn.Module):
        def __init__(self, helper: nn.Module) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            object.__setattr__(self, "helper", helper)  # a reference, not a child

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.helper(self.fc(x))

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.blocks = nn.ModuleList(Inner(self.norm) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Body()
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    layers = find_layers(Model(), torch.randn(2, 8))
    assert layers.names() == ["body", "head"]
    assert "'body.norm' runs 2 times" in layers[0].merged


def test_meta_model_and_call_trace() -> None:
    with torch.device("meta"):
        m = Wrapper()
        x = torch.randn(2, 5)
    assert find_layers(m, x).names() == [
        "embed",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "norm",
        "head",
    ]
    trace = record_calls(m, (x,), {})
    assert len(trace.outer_calls(m.drop)) == 2 and trace.outer_calls(m.blocks) == []
    (head_call,) = trace.calls_of(m.head)
    assert trace.calls[head_call].parent == trace.calls_of(m)[0]


def test_param_layers_rejects_foreign_layers() -> None:
    with pytest.raises(ValueError, match="layers is empty"):
        param_layers(Wrapper(), [])
    other = find_layers(nn.Sequential(nn.Linear(2, 2)), torch.randn(1, 2))
    with pytest.raises(ValueError, match="parameter 'scale' is in no layer and not a root tensor"):
        param_layers(Wrapper(), other)


def test_functional_read_across_layers_is_recorded() -> None:
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

    layers = find_layers(LM(), torch.randint(0, 10, (2, 3)))
    assert layers.names() == ["embed", "blocks.0", "blocks.1", "head"]
    assert [(r.name, r.owner, r.reader) for r in layers.foreign_reads] == [("embed.weight", "embed", "head")]

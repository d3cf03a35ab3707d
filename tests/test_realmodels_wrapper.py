"""A user-style model with an nn.ModuleList of blocks and a tied head: blocks as layers, split points,
tied parameters across devices kept as one parameter, batch-less inputs and dataclass outputs."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import torchspan
from torchspan.runtime.microbatch import gather, split_batch
from torchspan.runtime.ties import TiedCopies


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        return x + (y * scale if scale is not None else y)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "ok"


class Wrapper(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor, scale: torch.Tensor | None = None, flag: bool = True) -> Out:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, scale)
        return Out(self.head(h), h)


def _span(model: nn.Module, **kw: object) -> torchspan.Spanned:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torchspan.span(model, **kw)  # type: ignore[arg-type]


def _loss(out: Out, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="sum")


IDS = torch.randint(0, 20, (6, 5), generator=torch.Generator().manual_seed(1))


def test_wrapper_blocks_are_layers_and_gradients_match_one_device() -> None:
    torch.manual_seed(0)
    model = Wrapper()
    ref = copy.deepcopy(model)
    scale = torch.full((1, 1, 8), 0.5)  # dim 0 of 1 broadcasts: handed whole to every micro-batch
    spanned = _span(model, devices=["cpu"] * 4, microbatches=3)
    loss = spanned.train_step({"ids": IDS, "scale": scale, "flag": False}, IDS, _loss)
    ref_loss = _loss(ref(IDS, scale, False), IDS)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert [g for _, g in spanned.stages] == [
        ["embed", "blocks.0"],
        ["blocks.1", "blocks.2"],
        ["blocks.3"],
        ["head"],
    ]
    with torch.no_grad():
        out = spanned(IDS, scale)
    assert isinstance(out, Out) and out.logits.shape == (6, 5, 20) and out.note == "ok"


def test_split_points_and_no_split_pass_through_span() -> None:
    spanned = _span(Wrapper(), devices=["cpu", "cpu"], no_split=[nn.ModuleList])
    with pytest.raises(ValueError, match="'blocks.0' \\(part of 'blocks'\\) is called outside every layer"):
        spanned.train_step(IDS, IDS, _loss)  # a ModuleList is never called itself: it cannot be one layer
    spanned = _span(Wrapper(), devices=["cpu", "cpu"], split_points=["blocks.2.fc"])
    spanned.train_step(IDS, IDS, _loss)
    assert "blocks.2.fc" in [n for _, g in spanned.stages for n in g]


def test_a_tie_across_devices_stays_one_parameter_read_through_a_copy() -> None:
    model = Wrapper()
    spanned = _span(model, devices=["cpu", "meta"], balance=[3, 3])
    with torch.no_grad():
        out = spanned(IDS)
    assert out.logits.device.type == "meta"
    # the one parameter lives with its first layer (the embedding, stage 0); the head reads a copy
    assert model.head.weight is model.embed.weight and model.embed.weight.device.type == "cpu"
    assert isinstance(model.head._parameters["weight"], nn.Parameter)  # restored after the call
    copies = spanned._executor.placed.copies
    assert copies.names() == ["head"]
    with copies.swapped("head"):
        assert model.head.weight.device.type == "meta" and not isinstance(model.head.weight, nn.Parameter)
    assert model.head.weight is model.embed.weight


def test_tied_copies_only_where_devices_differ() -> None:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    layers = {"emb": emb, "head": head}
    copies = TiedCopies(layers, {"emb": 0, "head": 1}, [torch.device("cpu"), torch.device("meta")])
    assert copies.names() == ["head"]
    same = TiedCopies(layers, {"emb": 0, "head": 1}, [torch.device("cpu"), torch.device("cpu")])
    assert not same  # stages sharing a device copy nothing


def test_split_batch_passes_batchless_tensors_whole_and_refuses_odd_sizes() -> None:
    x, pos, const = torch.randn(4, 3), torch.arange(3).unsqueeze(0), torch.tensor(2.0)
    chunks = split_batch((x,), {"pos": pos, "c": const, "use_cache": False, "none": None}, 2)
    assert [a[0].shape[0] for a, _ in chunks] == [2, 2]
    assert all(
        k["pos"] is pos and k["c"] is const and k["use_cache"] is False and k["none"] is None
        for _, k in chunks
    )
    with pytest.raises(ValueError, match="NoSplit"):
        split_batch((x,), {"odd": torch.ones(3, 2)}, 2)


def test_gather_rebuilds_dataclasses_and_named_structures() -> None:
    parts = [Out(torch.ones(2, 3), torch.zeros(2, 1)), Out(torch.ones(1, 3), torch.zeros(1, 1))]
    merged = gather(parts)
    assert isinstance(merged, Out) and merged.logits.shape == (3, 3) and merged.hidden.shape == (3, 1)
    merged = gather([{"a": (torch.ones(1), None)}, {"a": (torch.ones(2), None)}])
    assert merged["a"][0].shape == (3,) and merged["a"][1] is None

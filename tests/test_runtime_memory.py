"""The activation meter: what counts as saved activation bytes, and that nothing leaks."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import torchspan
from torchspan.runtime.memory import ActivationMeter


def test_views_of_one_storage_count_once_and_slices_count_as_slices() -> None:
    meter = ActivationMeter(1)
    qkv = torch.randn(4, 6, 12, requires_grad=True) * 1.0  # a fused projection's output
    q, k, v = qkv.chunk(3, dim=-1)  # three interleaved views, each spanning most of the storage
    with meter.saving(0):
        a = q * k  # saves q and k
        b = a * v  # saves a and v
    assert meter.peak[0] == qkv.numel() * 4 + a.numel() * 4  # qkv's storage once, plus a

    meter2 = ActivationMeter(1)
    x = torch.randn(8, 5)
    w = torch.randn(5, 3, requires_grad=True)
    meter2.reset([w])
    outs = []
    with meter2.saving(0):
        for part in x.split(2):  # four disjoint micro-batch slices of one storage
            outs.append(part @ w)
    assert meter2.peak[0] == x.numel() * 4  # four slices of 2x5 floats, not four times the batch
    del outs, a, b
    gc.collect()


def test_forward_without_backward_frees_what_it_saved() -> None:
    meter = ActivationMeter(1)
    layer = nn.Linear(16, 16)
    meter.reset(layer.parameters())
    with meter.saving(0):
        out = torch.tanh(layer(torch.randn(4, 16)))  # tanh saves its own output (a cycle risk)
    assert meter.live[0] > 0
    del out  # no backward: the graph must still be freed
    assert meter.live[0] == 0


def test_spanned_forward_without_backward_does_not_leak() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8), nn.Sigmoid())
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[2, 2], microbatches=2)
    for _ in range(3):
        out = spanned(torch.randn(8, 32))  # e.g. validation without torch.no_grad()
        del out
    assert spanned._meter.live == [0, 0]


class _RootOwned(nn.Module):
    """A root parameter and a root buffer, both first read after layer ``b`` (stage 1).

    The data-dependent branch makes fx fail, so hook mode places them where they are first read.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("shift", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.a(x))
        if h.sum() > -1e9:
            h = h * self.scale + self.shift.sum()
        return h


def test_memory_counts_root_parameters_and_buffers_on_the_stage_they_were_placed_on() -> None:
    with pytest.warns(UserWarning, match="hook placement"):
        spanned = torchspan.span(_RootOwned(), devices=["cpu", "cpu"], balance=[1, 1])
    spanned(torch.randn(2, 4))
    assert spanned._executor.root_attrs == {"scale": 1, "shift": 1}
    mem = spanned.memory()
    layer = (4 * 4 + 4) * 4
    assert [m["params"] for m in mem] == [layer, layer + 4 * 4]  # scale lives on stage 1
    assert [m["buffers"] for m in mem] == [0, 3 * 4]  # shift too

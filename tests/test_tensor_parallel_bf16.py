"""bf16 with tensor parallel (issue 33 item 2): ``span(model, tp=2, precision="bf16")`` against one device's
bf16.

``precision="bf16"`` is autocast (``runtime.layercall.autocast_for``), as for one process and replicas:
float32 weights and gradients, the layers' matmuls in bf16. The baseline is the user's: the same tied GQA
Llama (float32) under ``torch.autocast("cpu", dtype=torch.bfloat16)`` on the whole batch, ``loss.backward()``.
Split over 2 ranks the row-wise projections add two bf16 partial sums (DTensor's all-reduce) where one device
rounds one sum, so the gradients differ by bf16 rounding, not more: every parameter's gradient
(``.grad.full_tensor()``) within ``REL`` of one device's in relative norm, ``||g_tp - g_1|| <= REL * ||g_1||``
(measured: worst 8.6e-3 through ``train_step``, 8.8e-3 in the plain loop; a gradient zeroed or scaled by 0.8
is 0.2 off), and none as close to one device's float32 gradient (so bf16 did run). Both ``train_step`` (2
micro-batches) and the plain loop (the span's forward autocasts too).
"""

from __future__ import annotations

import copy

import pytest
import torch
from ranks_spawn import join_job, spawn
from test_tensor_parallel import _batch, _llama

import torchspan
from torchspan.runtime.ranks import free_port

transformers = pytest.importorskip("transformers", reason="the Llama case needs the hf extra")

# bf16 keeps 8 bits of mantissa (2**-8 = 3.9e-3 per rounding); the measured worst is printed on failure
REL = 2e-2


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _one_device(model, batch: dict, bf16: bool) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch).loss
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _worker(rank: int, world: int, port: int) -> None:
    join_job(rank, world, port)
    batch = _batch()
    base = _llama().float()
    want = _one_device(base, batch, bf16=True)
    float32 = _one_device(base, batch, bf16=False)
    for loop in ("train_step", "plain"):
        spanned = torchspan.span(
            copy.deepcopy(base), tp=2, precision="bf16", microbatches=2 if loop == "train_step" else None
        )
        if loop == "train_step":
            spanned.train_step(batch)
        else:
            spanned(**batch).loss.backward()  # the span's precision applies to its forward
        got = {n: _full(p.grad) for n, p in spanned.module.named_parameters()}
        assert all(g.dtype == torch.float32 for g in got.values())
        errors = {n: _rel(got[n], want[n]) for n in want}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= REL, (
            f"{loop}: {worst} {errors[worst]:.2e} from one device's bf16 (all: {errors})"
        )
        off = min(_rel(got[n], float32[n]) for n in want)  # bf16 did run: no gradient is float32's
        assert off > 1e-4, (
            f"{loop}: a gradient within {off:.1e} of one device's float32: was autocast applied?"
        )
        if rank == 0:
            print(f"{loop}: worst {worst} {errors[worst]:.2e}, least apart from float32 {off:.2e}")


@pytest.mark.slow
def test_tensor_parallel_bf16_is_one_devices_bf16() -> None:
    spawn(_worker, 2, free_port())

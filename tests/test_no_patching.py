"""torchspan replaces nothing in ``torch``: a library must not change torch for its users' other models.

Each case runs in fresh ``python -c`` processes (this test process may have imported torchspan long ago):
every attribute of ``torch.nn.utils``, ``torch.nn.utils.clip_grad`` and ``torch.Tensor`` is captured
before ``import torchspan``; then a model is spanned, trained one ``train_step`` and clipped, and every
attribute must still be the very object torch had (a submodule that the import loaded is the only
addition allowed). One process (stages on two CPU "devices"), a 2-stage pipeline across two gloo
ranks and that pipeline with each stage sharded over 2 replicas (4 ranks), where torch's own
``clip_grad_norm_`` over a stage's gradients is still refused (it would clip each stage by its own
norm) through those gradients alone: another model's clip in the same process runs untouched, with plain
``torch.Tensor`` gradients, and gives torch's norm. In this process: a stage's marked gradients behave as
plain tensors for everything but torch's total norm (optimizers, copies, saves).
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchspan.runtime.gradients import guard_plain_clip
from torchspan.runtime.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys, types
import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

assert "torchspan" not in sys.modules, "the check needs a process that has not imported torchspan"
WATCHED = {"torch.nn.utils": torch.nn.utils, "torch.nn.utils.clip_grad": torch.nn.utils.clip_grad,
           "torch.Tensor": torch.Tensor}
before = {name: dict(vars(obj)) for name, obj in WATCHED.items()}

import torchspan
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 4)).double()
pipeline = sys.argv[1] != "one"
if pipeline:  # "sharded": each stage's parameters and gradients DTensor shards (FSDP2) over 2 replicas
    spanned = torchspan.span(model, balance=[2, 2], microbatches=2, shard=sys.argv[1] == "sharded")
else:
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=2)
x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
replica, replicas = spanned.data_parallel
x, y = torchspan.shard_batch((x, y), replica, replicas)
opt = torch.optim.SGD(spanned.parameters(), lr=0.1)
result = {"mode": spanned.mode}
for step in range(2):
    opt.zero_grad()
    spanned.train_step(x, y, nn.MSELoss())
    result["norm"] = spanned.clip_grad_norm_(0.5).item()
    opt.step()

grads = [p.grad for p in spanned.parameters() if p.grad is not None]
result["grads_are_tensors"] = bool(grads) and all(isinstance(g, torch.Tensor) for g in grads)
result["sharded_grads"] = any(isinstance(g, torch.distributed.tensor.DTensor) for g in grads)
result["grads_plain"] = all(type(g) is torch.Tensor for g in grads)
try:
    torch.nn.utils.clip_grad_norm_(spanned.parameters(), 1e9)
    result["torch_clip"] = "ran"
except RuntimeError as e:
    result["torch_clip"] = str(e)

other = nn.Linear(3, 2)  # another model in the same process: torch's clip as torch gives it
other(torch.randn(4, 3)).pow(2).sum().backward()
want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in other.parameters()]))
got = torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9)
result["other_clip_right"] = abs(got.item() - want.item()) <= 1e-6 * want.item()
result["other_grads_plain"] = all(type(p.grad) is torch.Tensor for p in other.parameters())

changed = []
for name, obj in WATCHED.items():
    now = vars(obj)
    for key, value in before[name].items():
        if key not in now or now[key] is not value:
            changed.append(f"{name}.{key}")
    for key, value in now.items():
        # a submodule import
        loaded = isinstance(value, types.ModuleType) and value.__name__ == f"{name}.{key}"
        if key not in before[name] and not loaded:
            changed.append(f"{name}.{key} (added)")
result["changed"] = changed
if pipeline:
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
print("RESULT " + json.dumps(result))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _result(proc: subprocess.Popen, label: str) -> dict:
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{label} did not finish in 180 s\n{out}\n{err}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{label} failed (exit {proc.returncode})\n{out}\n{err}"
    return json.loads(lines[-1][len("RESULT ") :])


def _start(mode: str, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", SCRIPT, mode]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_one_process_leaves_torch_as_it_was() -> None:
    r = _result(_start("one"), "one process")
    assert r["mode"] != "data-parallel" and r["norm"] > 0
    assert r["changed"] == [], f"torchspan replaced torch's own objects: {r['changed']}"
    assert r["grads_plain"], "in one process the gradients are plain tensors"
    assert r["torch_clip"] == "ran", (
        "in one process torch's clip sees every gradient and is right: not refused"
    )
    assert r["other_clip_right"] and r["other_grads_plain"]


@pytest.mark.slow
@pytest.mark.parametrize("mode,world", [("pipeline", 2), ("sharded", 4)])
def test_pipeline_ranks_leave_torch_as_it_was_and_still_refuse_torch_clip_on_a_stage(
    mode: str, world: int
) -> None:
    """2 stages on 2 ranks, or 2 stages x 2 replicas each sharding its stage (gradients are DTensor shards) on
    4."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(_start(mode, **env))
    try:
        results = [_result(p, f"rank {rank}") for rank, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, r in enumerate(results):
        stage = rank % 2  # rank = replica * stages + stage
        assert r["changed"] == [], f"rank {rank}: torchspan replaced torch's own objects: {r['changed']}"
        assert r["sharded_grads"] == (mode == "sharded"), f"rank {rank}: {r}"
        assert r["grads_are_tensors"] and not r["grads_plain"], (
            f"rank {rank}: a stage's gradients carry the refusal themselves"
        )
        assert (
            f"rank {rank} sees only the gradients of stage {stage} of a 2-stage pipeline" in r["torch_clip"]
        ), r["torch_clip"]
        assert "spanned.clip_grad_norm_(max_norm, norm_type)" in r["torch_clip"]
        assert r["other_clip_right"] and r["other_grads_plain"], (
            f"rank {rank}: another model's clip was touched"
        )
    assert len({r["norm"] for r in results}) == 1, "every rank returns the whole model's norm"


class _FakeStage:
    """What ``guard_plain_clip`` reads of a ``RankStage``: this rank's parameters, its rank, stage and the
    stage count."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.info, self.stage, self.mesh = (
            model,
            SimpleNamespace(rank=1),
            1,
            SimpleNamespace(stages=2),
        )

    def local_parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())


def test_a_stage_gradient_behaves_as_a_plain_tensor_except_for_torch_total_norm() -> None:
    """The refusal lives in the gradients alone: accumulation keeps it; optimizers, ``clip_grad_value_``,
    copies, pickles and ``torch.save`` see plain tensors (optimizer state stays plain, a saved gradient loads
    with ``weights_only``); torch's ``clip_grad_norm_`` / ``get_total_norm`` raise before scaling anything."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    stage = _FakeStage(model)
    guard_plain_clip(stage)
    before = [p.grad.clone() for p in model.parameters()]
    assert all(type(b) is torch.Tensor for b in before)
    with pytest.raises(
        RuntimeError, match=r"on rank 1 sees only the gradients of stage 1 of a 2-stage pipeline"
    ):
        nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    if hasattr(nn.utils, "get_total_norm"):
        with pytest.raises(RuntimeError, match=r"spanned\.clip_grad_norm_"):
            nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters())), (
        "a refused clip scaled nothing"
    )
    assert torch.equal(model[0].weight.grad.norm(), before[0].norm()), (
        "a gradient's own norm is not torch's clip"
    )
    model(torch.randn(5, 4)).sum().backward()  # accumulates into the same tensors: still refused
    with pytest.raises(RuntimeError, match="spanned"):
        nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    nn.utils.clip_grad_value_(model.parameters(), 1e-2)  # elementwise: right on one stage
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 1e-2
    for opt in (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        torch.optim.Adam(model.parameters(), foreach=True),
    ):
        opt.step()
        assert {type(v) for state in opt.state.values() for v in state.values()} == {torch.Tensor}, type(
            opt
        ).__name__
    grad = model[0].weight.grad
    buf = io.BytesIO()
    torch.save({"grad": grad}, buf)
    buf.seek(0)
    for copied in (
        torch.load(buf, weights_only=True)["grad"],
        pickle.loads(pickle.dumps(grad)),
        copy.deepcopy(grad),
    ):
        assert type(copied) is torch.Tensor and torch.equal(copied, grad)
    assert repr(grad).startswith("tensor(")
    assert type(grad * 2) is torch.Tensor

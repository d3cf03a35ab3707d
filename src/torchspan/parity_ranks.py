"""One training step under several strategies, each compared with one device, parameter by parameter.

``compare_strategies`` builds the reference gradient once (a plain copy of the model, the whole
batch, ``loss_fn(model(x), y).backward()``) and runs one step of each named strategy from the same
initial weights and the same global batch:

- ``single``: a fresh plain copy on one device (the reference itself: a determinism check);
- ``local-pipeline``: ``span(model, devices=..., balance=..., microbatches=...)`` in this process;
- ``dp``: ``nproc`` gloo processes, ``span(model)`` (one data-parallel replica) each, the batch sharded
unevenly
  (``shard_batch``: 7 rows over 2 ranks are 4 + 3);
- ``rank-pipeline``: ``nproc`` processes, one pipeline stage each (``span`` in a launched job);
- ``hybrid``: ``dp * pp`` processes, ``pp`` stages (``len(balance)``, default 2) replicated
  ``dp`` times, each replica on its shard;
- ``fsdp``: as ``dp``, with ``span(model, shard=True)``: parameters, gradients and optimizer state
  sharded by FSDP2 (each rank writes the full gradients, ``.grad.full_tensor()``);
- ``fsdp-offload``: ``span(model, shard=True, offload="cpu")``, one process per GPU (nccl); refused
  (``ValueError``) where there is no GPU;
- ``tp``: ``span(model, tp=nproc)``: every layer split over the processes by DTensor (the model's own
tensor-parallel
  plan or ``tp_plan``), every rank the whole batch; ``tp-fsdp``: ``span(model, tp=2, shard=True)``, FSDP2 over
  the other ``nproc / 2`` (each tp pair one replica's rows).

Multi-process strategies run in spawned gloo processes on 127.0.0.1 (a free port; the strategies
needing the same process count share one spawn). Every rank rebuilds the model with ``build``
(picklable: a module-level function or ``functools.partial``), loads the parent's initial weights,
runs its step and writes the gradients of the parameters it holds, by qualified name, to a
temporary folder; the parent compares the full model (per name, the worst rank). A rank that raises
or dies, or a spawn still running after ``timeout`` seconds, ends that spawn (every rank killed,
never a hang) and marks its strategies failed with a message naming the rank.

Usage::

    results = compare_strategies(model, x, y, F.mse_loss, ["single", "local-pipeline", "dp"],
                                 build=functools.partial(make_model), nproc=2,
                                 options=StepOptions(loss_reduction="mean"))
    for r in results: print(r.name, r.ok, r.error or r.parity.failures())
"""

from __future__ import annotations

import copy
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._pytree import tree_map

from .parity import GradDiff, Parity, grad_difference
from .parity_strategies import LOCAL, RANKED, RankStep, RankStrategy, StepOptions
from .parity_strategies import forward as _forward
from .runtime.ranks import free_port, init_distributed

__all__ = [
    "StepOptions",
    "RankStrategy",
    "StrategyResult",
    "RankFailure",
    "LOCAL",
    "RANKED",
    "compare_strategies",
    "processes_for",
]


@dataclass(frozen=True)
class StrategyResult:
    """One strategy's comparison: ``parity`` (per-parameter differences, both losses) or the ``error`` that
    stopped it."""

    name: str
    processes: int
    parity: Parity | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.parity is not None and self.parity.ok


class RankFailure(RuntimeError):
    """A rank of a spawned strategy raised, died or outlived the timeout; ``rank`` names it (``None``:
    several)."""

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class _Job:
    """What every rank gets (pickled into the spawned processes)."""

    build: Callable[[], nn.Module]
    state: dict[str, Any]
    inputs: Any
    target: Any
    loss_fn: Callable[..., Any]
    options: StepOptions
    steps: list[tuple[int, RankStep]] = field(default_factory=list)  # (index into the result list, step)
    backend: str = "gloo"


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one device holds it: a sharded one (``DTensor``) gathered from every rank (a collective),
    its shard first moved to the mesh's device where it was offloaded to the CPU."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return grad
    mesh, local = grad.device_mesh, grad.to_local()
    if local.device.type != mesh.device_type:
        local = local.to(
            torch.device(mesh.device_type, torch.cuda.current_device())
            if mesh.device_type == "cuda"
            else mesh.device_type
        )
        grad = DTensor.from_local(
            local, mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
        )
    return grad.full_tensor()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """The gradients of the parameters this process holds (meta ones are other ranks'), by every name they
    have; sharded ones whole (every rank gathers them, in the same order)."""
    return {
        n: (_full(p.grad.detach()).cpu().clone() if p.grad is not None else None)
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.device.type != "meta"
    }


def processes_for(
    strategies: Sequence[str], nproc: int, options: StepOptions | None = None
) -> dict[str, int]:
    """Each strategy's process count (0: runs in this process); ``ValueError`` for an unknown name or an
    ``nproc`` it cannot use.

    Usage: ``processes_for(["dp", "hybrid"], 4)`` -> ``{"dp": 4, "hybrid": 4}``.
    """
    opts = options or StepOptions()
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be an int >= 1, e.g. --nproc-per-node 2")
    known = [*LOCAL, *RANKED]
    out: dict[str, int] = {}
    for name in strategies:
        if name in LOCAL:
            out[name] = 0
        elif name in RANKED:
            out[name] = RANKED[name].processes(nproc, opts)
        else:
            raise ValueError(
                f"strategy {name!r} is unknown; choose from {', '.join(known)} (e.g. --strategies single,dp)"
            )
    return out


# ---------------------------------------------------------------------------------------- processes
def _rank_main(rank: int, world: int, port: int, folder: str, job: _Job, timeout: float) -> None:
    """One spawned rank: join the group, run every step of this spawn, write gradients and loss per step."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        init_distributed(backend=job.backend, timeout=timeout)
        for index, step in job.steps:
            model = job.build()
            model.load_state_dict(job.state)
            loss = step(model, job.inputs, job.target, job.loss_fn, job.options, rank, world)
            torch.save({"grads": _grads(model), "loss": float(loss)}, Path(folder, f"s{index}.rank{rank}.pt"))
        dist.barrier()
    except BaseException as exc:
        Path(folder, f"rank{rank}.err").write_text("".join(traceback.format_exception(exc)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def _preload() -> None:
    """Ranks fork from one forkserver that has torch and torchspan imported already: one import, not one per
    rank."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchspan.parity_ranks"])


def _spawn(job: _Job, world: int, folder: str, timeout: float) -> None:
    """Run ``job.steps`` on ``world`` spawned ranks; ``RankFailure`` naming the rank on an error, a death or
    the timeout."""
    _preload()
    try:
        ctx = mp.start_processes(
            _rank_main,
            args=(world, free_port(), folder, job, timeout),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(
            f"the model factory, loss or batch cannot be sent to spawned ranks ({_last_line(str(exc))}); "
            "pass a module-level function (or functools.partial of one) as build= and a module-level loss_fn"
        ) from exc
    except RuntimeError as exc:
        if "serialize non-leaf tensor" not in str(exc):
            raise
        raise ValueError(
            "the batch or target holds a tensor with autograd history (e.g. a transformers output's cache, "
            "an object tree_map does not enter), which cannot be sent to spawned ranks; build the target "
            "from detached tensors, and a transformers model with use_cache=False"
        ) from exc
    start = time.monotonic()
    try:
        while not ctx.join(timeout=0.25):
            if time.monotonic() - start > timeout:
                running = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                raise RankFailure(
                    f"rank(s) {', '.join(map(str, running))} of {world} still running after {timeout:g} s "
                    "(killed); a collective waits for a rank that never comes",
                    running[0] if len(running) == 1 else None,
                )
    except mp.ProcessRaisedException as exc:
        err = Path(folder, f"rank{exc.error_index}.err")
        why = _last_line(err.read_text()) if err.exists() else _last_line(str(exc))
        raise RankFailure(f"rank {exc.error_index} of {world} failed: {why}", exc.error_index) from None
    except mp.ProcessExitedException as exc:
        raise RankFailure(
            f"rank {exc.error_index} of {world} died "
            f"({exc.exit_code if exc.signal_name is None else exc.signal_name})",
            exc.error_index,
        ) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(5)


def _merge(
    per_rank: list[dict[str, Any]], reference: nn.Module, reference_loss: float, atol: float, rtol: float
) -> Parity:
    """Per name the worst rank holding it; a name no rank holds compares as a missing gradient; the loss
    farthest off."""
    grads: list[GradDiff] = []
    for name, ref_p in reference.named_parameters(remove_duplicate=False):
        found = [
            grad_difference(name, r["grads"][name], ref_p.grad, atol=atol, rtol=rtol)
            for r in per_rank
            if name in r["grads"]
        ]
        if not found:
            found = [grad_difference(name, None, ref_p.grad, atol=atol, rtol=rtol)]
        worst = max(found, key=lambda d: d.max_abs)
        grads.append(
            GradDiff(name, worst.max_abs, max(d.max_rel for d in found), all(d.within for d in found))
        )
    loss = max((float(r["loss"]) for r in per_rank), key=lambda v: abs(v - reference_loss))
    return Parity(tuple(grads), loss, reference_loss, atol, rtol)


@dataclass(frozen=True)
class _Compare:
    """The one-device reference a strategy's gradients and loss are compared with, and the tolerances."""

    reference: nn.Module
    loss: float
    atol: float
    rtol: float

    def parity(self, per_rank: list[dict[str, Any]]) -> Parity:
        return _merge(per_rank, self.reference, self.loss, self.atol, self.rtol)


def _run_local(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., Any],
    strategies: Sequence[str],
    counts: dict[str, int],
    opts: StepOptions,
    compare: _Compare,
) -> dict[int, StrategyResult]:
    """The strategies that run in this process, each on a fresh copy of ``model``, by index in
    ``strategies``."""
    results: dict[int, StrategyResult] = {}
    for i, name in enumerate(strategies):
        if counts[name] == 0:
            start = time.monotonic()
            local = copy.deepcopy(model)
            try:
                loss = LOCAL[name](local, inputs, target, loss_fn, opts)
            except Exception as exc:  # a strategy that refuses the model is that strategy's failure
                results[i] = StrategyResult(name, 0, error=f"{type(exc).__name__}: {_last_line(str(exc))}")
                continue
            parity = compare.parity([{"grads": _grads(local), "loss": float(loss)}])
            results[i] = StrategyResult(name, 0, parity, seconds=time.monotonic() - start)
    return results


def _run_spawn(
    job: _Job, world: int, strategies: Sequence[str], timeout: float, compare: _Compare
) -> dict[int, StrategyResult]:
    """One spawn of ``world`` ranks running ``job``'s steps; each step's result (or the spawn's error) by
    index."""
    results: dict[int, StrategyResult] = {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torchspan-verify-") as folder:
        error = None
        try:
            _spawn(job, world, folder, timeout)
        except RankFailure as exc:
            error = str(exc)
        seconds = time.monotonic() - start
        for i, _ in job.steps:
            files = [Path(folder, f"s{i}.rank{r}.pt") for r in range(world)]
            if all(f.exists() for f in files):
                per_rank = [torch.load(f, weights_only=False) for f in files]
                results[i] = StrategyResult(strategies[i], world, compare.parity(per_rank), seconds=seconds)
            else:
                results[i] = StrategyResult(
                    strategies[i], world, error=error or "a rank wrote no gradients", seconds=seconds
                )
    return results


def compare_strategies(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    strategies: Sequence[str],
    *,
    build: Callable[[], nn.Module] | None = None,
    nproc: int = 2,
    options: StepOptions | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    timeout: float = 120.0,
) -> list[StrategyResult]:
    """One step of each strategy against one device (see the module docstring); results in ``strategies``'
    order.

    ``model`` keeps its weights (copies are trained); ``target`` may be a function of the reference's
    output. ``build`` rebuilds the model in spawned ranks (needed by multi-process strategies).
    ``timeout``: seconds one spawn may run. Unknown names, an ``nproc`` a strategy cannot use, or a
    missing ``build`` raise ``ValueError`` before anything runs.
    """
    opts = options or StepOptions()
    counts = processes_for(strategies, nproc, opts)
    if any(counts.values()) and build is None:
        raise ValueError(
            "multi-process strategies rebuild the model in each rank: pass build=<picklable function "
            "returning the model>"
        )
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds, e.g. timeout=120")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model)
    out = _forward(reference, inputs)
    if callable(target) and not isinstance(target, torch.Tensor):
        target = target(out)
    ref_loss_t = loss_fn(out, target)
    ref_loss_t.backward()
    compare = _Compare(reference, float(ref_loss_t.detach()), atol, rtol)
    results = _run_local(model, inputs, target, loss_fn, strategies, counts, opts, compare)
    detached = tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, (inputs, target))
    for world, backend in sorted({(c, RANKED[n].backend) for n, c in counts.items() if c}):
        steps = [
            (i, RANKED[n].step)
            for i, n in enumerate(strategies)
            if counts[n] == world and RANKED[n].backend == backend
        ]
        assert build is not None
        job = _Job(build, state, detached[0], detached[1], loss_fn, opts, steps, backend)
        results.update(_run_spawn(job, world, strategies, timeout, compare))
    return [results[i] for i in range(len(strategies))]

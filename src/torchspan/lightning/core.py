"""What the Lightning strategies share, without importing Lightning: checks, joining the job, spanning, rows.

``trainer.SpanStrategy`` (``lightning.pytorch.Trainer``) and ``fabric.SpanFabricStrategy``
(``lightning.fabric.Fabric``) both span one module with ``torchspan.span(module, **span_kwargs)`` and
give each rank its rows of every global batch (``shard_batch``: 7 rows over 2 ranks are 4 + 3, never
padded by repeats as ``DistributedSampler`` pads). A pipeline across ranks is run by ``lightning.staged`` (a
sharded one refused: ``refuse_rank_pipeline``). Plain torch and torchspan.

Usage (inside a strategy)::

    check_span_kwargs("SpanStrategy", kwargs)
    join_job(rank, world, local)                  # the process group, torchspan's way
    spanned = span_module(module, kwargs, "SpanStrategy")
    batch = rows(batch)                           # this rank's rows of the global batch
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import Spanned, span
from ..runtime.ranks import init_distributed, shard_batch
from ..runtime.ranks.mesh import launched_stages

__all__ = [
    "SPAN_KEYS",
    "check_span_kwargs",
    "check_precision",
    "join_job",
    "world",
    "rank",
    "span_module",
    "refuse_rank_pipeline",
    "stages_asked",
    "rank_pipeline",
    "rows",
    "spanned_in",
    "swap_parameters",
    "full_optimizer_state",
    "load_full_optimizer_state",
    "check_devices",
]

SPAN_KEYS = tuple(k for k in inspect.signature(span).parameters if k != "model")
_FP16 = ("16-mixed", "16", "16-true", "fp16", "half")


def check_span_kwargs(owner: str, kwargs: dict[str, Any]) -> None:
    """Every keyword is one of ``torchspan.span``'s, or one ``ValueError`` naming it and the ones there
    are."""
    unknown = [k for k in kwargs if k not in SPAN_KEYS]
    if unknown:
        raise ValueError(
            f"{owner}({unknown[0]}=...): {unknown[0]!r} is not an argument of torchspan.span; the strategy "
            f"passes its keywords to span(model, ...), which takes {', '.join(SPAN_KEYS)}"
        )
    if kwargs.get("precision") in _FP16:
        check_precision(owner, str(kwargs["precision"]), "span precision")


def check_precision(owner: str, precision: str, what: str = "precision") -> None:
    """fp16 is refused: its loss scaler cannot be shared exactly by the plain loop on replicas; bf16 needs
    none."""
    if str(precision) in _FP16:
        raise ValueError(
            f"{owner} with {what}={precision!r}: fp16 trains with a gradient scaler, which the plain loop "
            "on torchspan's replicas refuses (each rank would decide on skipped steps from its own "
            "gradients); use precision='bf16-mixed' (no scaler, the same exponent range as float32) or "
            "'32-true'"
        )


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def join_job(global_rank: int, world_size: int, local_rank: int, timeout: Any = None) -> None:
    """Open the job's process group with ``torchspan.init_distributed`` (kept if one is open): torchrun's and
    ``torchspan launch``'s variables as they are, Lightning's own launcher's (no ``RANK``) completed first."""
    if dist.is_available() and dist.is_initialized():
        if (
            "RANK" in os.environ
        ):  # Lightning's environments unset WORLD_SIZE at teardown; torchspan reads both
            os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        return
    if world_size < 2 and "WORLD_SIZE" not in os.environ:
        return
    os.environ.setdefault("RANK", str(global_rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    init_distributed(timeout=timeout)


def check_devices(owner: str, processes: int, where: str = "Trainer") -> None:
    """The process count Lightning was given agrees with the job's (``devices=1``/``'auto'`` under a launcher
    too)."""
    size = world()
    if processes not in (1, size):
        raise ValueError(
            f"{where}(devices={processes}) with {owner}: this job has {size} process(es) "
            f"(WORLD_SIZE={size}); Lightning's devices= is the number of processes: pass devices={size}, "
            "or devices='auto' and let torchspan launch / torchrun set it (the model's devices go to the "
            f"strategy: {owner}(devices=['cpu', 'cpu']))"
        )


def refuse_rank_pipeline(owner: str, kwargs: dict[str, Any]) -> None:
    """A sharded pipeline across ranks (``shard=True`` with stages, launched) is not run under Lightning's
    loops."""
    stages = stages_asked(kwargs)
    if stages < 2 or world() < 2 or not kwargs.get("shard"):
        return
    given = ", ".join(
        f"{k}=..." for k in ("plan", "devices", "balance", "shard") if kwargs.get(k) is not None
    )
    raise ValueError(
        f"{owner}({given}) in a job of {world()} processes is a sharded pipeline across ranks ({stages} "
        f"stages), which {owner} does not run under Lightning's loop: drop shard=True "
        f"({owner}(devices=...) pipelines across ranks, with replicas of the pipeline when the job has "
        "more ranks than stages), or write the loop yourself with torchspan.span(..., shard=True).train_step"
    )


def stages_asked(kwargs: dict[str, Any]) -> int:
    """How many pipeline stages the span's keywords ask for (its plan's, ``balance``'s or ``devices``'
    length)."""
    return launched_stages(kwargs.get("plan"), kwargs.get("devices"), kwargs.get("balance"))


def rank_pipeline(spanned: Spanned | None) -> bool:
    """Whether ``spanned`` is a pipeline across ranks (this process holds one of its stages)."""
    return spanned is not None and world() > 1 and len(spanned.stages) > 1


def span_module(module: nn.Module, kwargs: dict[str, Any], owner: str) -> Spanned:
    """``torchspan.span(module, **kwargs)`` once every check passed (a pipeline across ranks is the caller's
    to run: ``staged.defer_training``)."""
    refuse_rank_pipeline(owner, kwargs)
    return span(module, **kwargs)


def rows(batch: Any) -> Any:
    """This rank's rows of a global batch (the whole batch in a world of one)."""
    if world() < 2:
        return batch
    return shard_batch(batch, rank(), world())


def spanned_in(module: Any) -> Spanned | None:
    """The ``Spanned`` that ``module`` is, wraps (a Fabric module) or holds as a child."""
    if isinstance(module, Spanned):
        return module
    inner = getattr(module, "_forward_module", None)
    if isinstance(inner, Spanned):
        return inner
    if isinstance(module, nn.Module):
        return next((m for m in module.modules() if isinstance(m, Spanned)), None)
    return None


def swap_parameters(optimizer: torch.optim.Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """An optimizer built before spanning holds the parameters a sharded span replaced: put in the new ones by
    name."""
    now = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [now.get(names.get(id(p), ""), p) for p in group["params"]]


def _sharded(spanned: Spanned | None) -> bool:
    return spanned is not None and spanned.mode == "sharded"


def full_optimizer_state(spanned: Spanned | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict; sharded: full tensors keyed by parameter name on every rank (a
    collective)."""
    if not _sharded(spanned):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    assert spanned is not None
    return get_optimizer_state_dict(spanned.module, optimizer, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(
    spanned: Spanned | None, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """``optimizer.load_state_dict(state)``; sharded: each rank keeps its shard of the full state."""
    if not _sharded(spanned):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    assert spanned is not None
    set_optimizer_state_dict(spanned.module, optimizer, state, options=StateDictOptions(full_state_dict=True))


class Placement:
    """Where this process stands, for both strategies (Lightning's and Fabric's): its device, the job's ranks
    from the process group once it exists; mixed in before Lightning's ``ParallelStrategy``."""

    parallel_devices: Any
    local_rank: int
    _num_nodes: int

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if self.local_rank < len(devices):
            return devices[self.local_rank]
        if devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return devices[0]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 1

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else super().global_rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else super().world_size

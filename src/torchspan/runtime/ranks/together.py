"""What the ranks of an own-forward pipeline exchange as a group, and failing together.

Every exchange among the ranks of one pipeline inside a forward goes through ``Together.gather``
(``all_gather_object``): the route of a new call (``routes``), how each rank made a value the glue
combined (``glue``), the outputs of a layer that cannot run on ``meta`` (``metacalls.Described``),
and the end of a forward reached for the first time. A rank that fails (its own layer raises, the
model's code between layers cannot run on its ``meta`` values, the loss is refused) while the
other ranks are heading for such an exchange joins it with the failure (``Failed``) instead of
leaving them waiting: every rank raises, naming the rank, the micro-batch and the error. Errors
every rank raises at once are marked (``every_rank``) and not exchanged again.

Usage (``RankOwnForwardExecutor`` does this)::

    together = Together(stages=2, rank_of=transport.peer, group=None)
    views = together.gather(Seen(...))     # index = stage; raises if a rank sent a Failed
    together.join(exc, stage=1, mb=0)      # this rank failed: the others learn it at their next exchange
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from .taint import is_meta

__all__ = ["Together", "Failed", "every_rank", "raised_everywhere", "explained"]

_EVERY_RANK = "_torchspan_every_rank"


def every_rank(exc: BaseException) -> BaseException:
    """``exc``, marked as raised by every rank of the pipeline at the same point (not exchanged again)."""
    setattr(exc, _EVERY_RANK, True)
    return exc


def raised_everywhere(exc: BaseException) -> bool:
    return bool(getattr(exc, _EVERY_RANK, False))


def explained(exc: Exception, stage: int, mb: int) -> Exception:
    """A torch error about ``meta`` tensors in the model's own code, as a torchspan error saying why; others
    as they are."""
    text = str(exc)
    if "meta" not in text or text.startswith("torchspan:"):
        return exc
    return RuntimeError(
        f"torchspan: stage {stage} cannot run the model's own code at micro-batch {mb}: "
        f"{type(exc).__name__}: {text}. On this rank the values other stages compute are meta (shapes "
        "only): the model's code between layers must not read them (.item(), if x.any():, .tolist()) nor "
        "write them in place into its own tensors. Move the cut so that this code reads values of one "
        "stage only, or run the model in one process (span with devices=[...])"
    )


class Failed:
    """A rank's failure, sent in the exchange its peers are heading for."""

    def __init__(self, rank: int, stage: int, mb: int, exc: BaseException) -> None:
        self.rank, self.stage, self.mb = rank, stage, mb
        self.text = f"{type(exc).__name__}: {exc}"[:1500]

    def error(self) -> RuntimeError:
        return RuntimeError(
            f"torchspan: rank {self.rank} (stage {self.stage}) failed in micro-batch {self.mb}'s forward, "
            f"and every rank of the pipeline stops with it (see that rank's traceback): {self.text}"
        )


class _Missing:
    """An output the last stage holds as ``meta``, filled from an earlier stage."""


class Together:
    """The exchanges of one pipeline's ranks (see the module docstring). ``rank_of(stage)``: the global
    rank of a stage; ``group``: the pipeline's process group (``None``: the default group); ``before``: run
    before every exchange (the step's same-batch verdict, which may raise on every rank)."""

    def __init__(
        self, stages: int, rank_of: Callable[[int], int], group: Any, before: Callable[[], None] | None = None
    ) -> None:
        self.stages, self.rank_of, self.group, self.before = stages, rank_of, group, before

    def gather(self, mine: Any) -> list[Any]:
        """Every stage's ``mine`` (index = stage); raises the failure any rank sent instead."""
        if self.before is not None:
            self.before()
        views: list[Any] = [None] * self.stages
        dist.all_gather_object(views, mine, group=self.group)
        failed = [v for v in views if isinstance(v, Failed)]
        if failed:
            raise every_rank(failed[0].error())
        return views

    def join(self, exc: BaseException, stage: int, mb: int) -> None:
        """This rank failed with ``exc`` where every other rank is heading for an exchange: send it there
        (``exc`` is then marked as raised on every rank; the caller raises it)."""
        try:
            self.gather(Failed(self.rank_of(stage), stage, mb, exc))
        except RuntimeError:
            pass  # the others raise now; this rank raises its own error
        every_rank(exc)

    def outputs(
        self, outs: list[Any], last: bool, share: Callable[[Any], list[Any]], device: torch.device
    ) -> list[Any]:
        """The last stage's outputs on every rank (``share``: the last stage's broadcast), where a value the
        last stage holds as ``meta`` (only earlier stages' layers read it, as an encoder's output past the
        last decoder block) comes from the latest stage that holds it. One that no stage holds (the model's
        code combined several stages' values, as an MoE model's aux_loss over every block's router logits) is
        ``None``."""
        marked = [tree_map(lambda v: _Missing() if is_meta(v) else v, o) for o in outs] if last else None
        shared = share(marked)
        missing = [
            (mb, j)
            for mb, o in enumerate(shared)
            for j, v in enumerate(tree_flatten(o)[0])
            if isinstance(v, _Missing)
        ]
        if not missing:
            return shared
        mine = [tree_flatten(o)[0] for o in outs]
        views = self.gather({(mb, j): mine[mb][j].cpu() for mb, j in missing if not is_meta(mine[mb][j])})
        filled, nobody = [], []
        for mb, o in enumerate(shared):
            paths = [keystr(p) for p, _ in tree_flatten_with_path(o)[0]]
            leaves, spec = tree_flatten(o)
            for j, v in enumerate(leaves):
                if isinstance(v, _Missing):
                    found = [view[(mb, j)] for view in views if (mb, j) in view]
                    leaves[j] = found[-1].to(device) if found else None
                    nobody += [] if found or paths[j] in nobody else [paths[j]]
            filled.append(tree_unflatten(leaves, spec))
        if nobody:
            warnings.warn(
                f"torchspan: the model's output{'s' if len(nobody) > 1 else ''} {', '.join(nobody)} "
                f"{'combine' if len(nobody) > 1 else 'combines'} values of several "
                "pipeline stages (e.g. an MoE model's aux_loss over every block's router logits), which no "
                "rank holds: returned as None. Compute the loss from outputs the last stage computes "
                "(logits)",
                stacklevel=3,
            )
        return filled

"""A pipeline whose workers hold several stages each, placed looped: Megatron's interleaved 1F1B can run on
it.

``Pipeline`` runs each worker's stages in the clock order of the schedule (``schedule.merged_order``). Every
schedule but ``interleaved-1f1b`` is clocked as if each stage had a worker of its own; the interleaved one is
clocked per *worker* (a process's pipeline rank, or a device's thread), so it needs to know how many there
are and that stage ``s`` runs on worker ``s % P``. ``LoopedPipeline`` finds both: from the transport across
processes (``positions``: the pipeline ranks, ``runtime.ranks.looped``), else from its worker groups, and
refuses an interleaved schedule on stages that are not looped (naming the devices that would be).

Usage::

    pipe = LoopedPipeline(devices, recompute="never", precision="32", recorder=Recorder(),
                          meter=ActivationMeter(4))
    loss = pipe.train(stage_fns, mb_inputs, mb_targets, loss_fn, weights, "interleaved-1f1b")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ... import schedule as sched
from .pipeline import Pipeline

__all__ = ["LoopedPipeline", "looped_workers"]

INTERLEAVED = "interleaved-1f1b"


def looped_workers(groups: Sequence[Sequence[int]], stages: int) -> int | None:
    """``P`` when the worker ``groups`` (stage indices per worker) hold stage ``s`` on worker ``s % P``, else
    ``None``.

    Usage: ``looped_workers([[0, 2], [1, 3]], 4) == 2``.
    """
    p = len(groups)
    if any(sorted(g) != list(range(k, stages, p)) for k, g in enumerate(sorted(groups, key=min))):
        return None
    return p


class LoopedPipeline(Pipeline):
    """A ``Pipeline`` that builds ``interleaved-1f1b`` for its workers (see the module docstring)."""

    prepost = True  # interleaved across processes: post the step's receives at its start (``train``)

    def _plan(self, schedule: str, m: int, n: int) -> list[list[sched.Action]]:
        if schedule != INTERLEAVED:
            return super()._plan(schedule, m, n)
        key = (schedule, m, n)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = sched.build(schedule, m, n, ranks=self.workers(n))
        return plan

    def train(self, fns: Sequence[Any], inputs: Sequence[Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """``Pipeline.train``; an interleaved step across processes first posts every receive it will take
        (``expect_step``: a sender's payload then goes out inside its send, no wake-up of gloo's thread
        later)."""
        schedule = args[3] if len(args) > 3 else kwargs.get("schedule")
        prepost = getattr(self.transport, "expect_step", None)
        if schedule == INTERLEAVED and prepost is not None and self.prepost:
            prepost(len(fns), len(inputs))
        return super().train(fns, inputs, *args, **kwargs)

    def workers(self, n: int) -> int:
        """The pipeline's workers (ranks) for ``n`` stages; ``ValueError`` where the stages are not looped on
        them."""
        positions = getattr(self.transport, "positions", None)
        if positions is not None:
            return int(positions)
        p = looped_workers(self.groups, n)
        if p is None:
            devices = [str(d) for d in self.devices]
            distinct = list(dict.fromkeys(devices))
            looped = [distinct[s % len(distinct)] for s in range(n)] if n % len(distinct) == 0 else None
            fix = f"pass devices={looped}" if looped else "give each device the same number of stages"
            raise ValueError(
                f"schedule='interleaved-1f1b' runs stage s on worker s % P (looped); devices={devices} do "
                f"not place the {n} stages so: {fix}, or use schedule='1f1b'"
            )
        return p

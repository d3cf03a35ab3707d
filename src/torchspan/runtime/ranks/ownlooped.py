"""Several stages per rank for the model's own forward across ranks (``ownforward``), and its backward.

Placed looped (stage ``s`` on rank ``s % P``), a rank's stages are one group of layers to the own-forward
executor: every rank still runs the model's whole forward once per micro-batch, its own layers for real, and
a value now goes around the ring (stage 0 on rank 0, 1 on rank 1, 2 on rank 0 again). A forward of a micro-
batch therefore waits for every rank's part of it, and so does its backward: under GPipe and 1F1B every rank
runs the micro-batches in one common order (the first stage's of ``schedule.build`` on ``P`` stages: GPipe,
or 1F1B with ``P - 1`` forwards ahead), since two ranks running one micro-batch's whole forward and another's
backward would wait on each other. ``schedule="interleaved-1f1b"`` pauses each micro-batch's forward between
a rank's chunks instead, and runs each rank's actions in Megatron's order (``owninterleaved``); zero-bubble
and merged-weights are refused (``check_looped``). The backward runs in segments, latest first: the gradients
of the values received after a send go out before that send's gradient is awaited (one autograd call for
everything would wait for a gradient that the other rank can only compute from one this rank has not sent
yet).

Usage (``RankOwnForwardExecutor`` does this)::

    groups = rank_groups(stage_groups, ranks=2)   # stages 0 and 2 on rank 0
    plan = common_plan("1f1b", microbatches=4, ranks=2)
    pending = stage_backward(st, messages, device, looped=True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ... import schedule as sched
from ..splitgrad import Pending, input_backward
from .forwardstate import Forward
from .ownmessages import ForwardMessages

__all__ = ["LOOPED_SCHEDULES", "check_looped", "common_plan", "rank_groups", "stage_backward"]

LOOPED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def check_looped(
    stages: int, ranks: int, schedule: str, recompute: str | None, shard: bool, microbatches: int = 0
) -> None:
    """``ValueError`` unless ``stages`` own-forward stages can run looped on ``ranks`` pipeline ranks
    (``microbatches``: checked for interleaved 1F1B's rounds when given)."""
    fix = f"pass balance= with {ranks} entries (one stage per rank)"
    if stages % ranks:
        raise ValueError(
            f"{stages} stages on pp({ranks}) ranks: looped placement needs a multiple of {ranks}; {fix}"
        )
    if schedule not in LOOPED_SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} with {stages} stages on pp({ranks}) ranks and the model's own forward: "
            "each micro-batch's forward runs through all of a rank's stages in one call, which splits no "
            f"backward in two; pass schedule='interleaved-1f1b', '1f1b' or 'gpipe', or {fix}"
        )
    if schedule == "interleaved-1f1b" and microbatches:
        sched.looped_ranks(microbatches, stages, ranks)  # rounds of ``ranks`` micro-batches
    where = (
        f"with {stages} stages on pp({ranks}) ranks and the model's own forward is not supported (its "
        "backward "
    )
    if shard:
        raise ValueError(f"shard=True {where}runs in segments); {fix}, or pipeline without shard=True")
    if recompute not in (None, "never"):
        raise ValueError(
            f"recompute={recompute!r} {where}runs in segments); {fix}, or pass recompute='never'"
        )


def rank_groups(groups: Sequence[Sequence[str]], ranks: int) -> list[list[str]]:
    """Stage groups placed looped as one group per rank: its stages' layers, in stage order."""
    merged: list[list[str]] = [[] for _ in range(ranks)]
    for s, group in enumerate(groups):
        merged[s % ranks].extend(group)
    return merged


def common_plan(schedule: str, microbatches: int, ranks: int) -> list[list[sched.Action]]:
    """Every rank's actions: the first stage's of ``schedule`` on ``ranks`` stages, the same on each, its
    actions renumbered to each rank's stage."""
    first = sched.build(schedule, microbatches, ranks)[0]
    return [[dataclasses.replace(a, stage=r) for a in first] for r in range(ranks)]


def stage_backward(
    st: Forward,
    messages: ForwardMessages,
    device: torch.device,
    *,
    looped: bool,
    split: bool = False,
    merge: bool = False,
) -> Pending | None:
    """The backward of ``st`` on this rank: gradients of what it sent come back, those of what it received go
    out. ``looped``: in segments (the module docstring); else one autograd call (``split``: input gradients
    first, the weights' ``Pending``; ``merge``: merged-weights)."""
    if looped:
        _segments(st, messages, device)
        return None
    outs: list[torch.Tensor] = []
    grads: list[torch.Tensor | None] = []
    for t, stage in st.sent:
        outs.append(t)
        grads.append(messages.take(torch.empty_like(t, device=device), stage))
    if st.loss is not None and st.loss.requires_grad:
        outs.append(st.loss)
        grads.append(None)
    if split:
        found, pending = input_backward(outs, grads, [t for t, _ in st.inbound], merge=merge)
    else:
        if outs:
            torch.autograd.backward(outs, grads)
        found, pending = [t.grad for t, _ in st.inbound], None
    for (t, stage), g in zip(st.inbound, found):
        messages.post(g if g is not None else torch.zeros_like(t), stage)
    return pending


def _segments(st: Forward, messages: ForwardMessages, device: torch.device) -> None:
    """Latest first: a received value's gradient is whole once the values sent after it (and the loss) have
    their gradients' backward run; it goes out before any earlier send's gradient is awaited. Each link's
    messages go in reverse order of the forward's on both sides."""
    sends = [(t, stage, after) for (t, stage), after in zip(st.sent, st.sent_after)]
    hi = len(st.inbound)
    if st.loss is not None and st.loss.requires_grad:
        torch.autograd.backward([st.loss], retain_graph=bool(sends))
    while sends:
        k = sends[-1][2]
        _post(st, messages, k, hi)
        hi = k
        outs, grads = [], []
        while sends and sends[-1][2] == k:
            t, stage, _ = sends.pop()
            outs.append(t)
            grads.append(messages.take(torch.empty_like(t, device=device), stage))
        torch.autograd.backward(outs, grads, retain_graph=bool(sends))
    _post(st, messages, 0, hi)


def _post(st: Forward, messages: ForwardMessages, lo: int, hi: int) -> None:
    for t, stage in reversed(st.inbound[lo:hi]):
        messages.post(t.grad if t.grad is not None else torch.zeros_like(t), stage)

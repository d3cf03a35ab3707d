"""Pipeline schedules as pure data: which stage runs which micro-batch, forward or backward, when.

A schedule is a list with one entry per stage: that stage's actions in the order it runs them.
Each action carries the *clock* (time slot, in units of one action) it would run at if every
action took the same time; the runtime uses it to interleave stages that share one worker.

- ``gpipe(m, n)``: every stage runs all forwards, then all backwards (activations of all ``m``
  micro-batches are alive at once on every stage).
- ``one_f_one_b(m, n)``: after a warm-up of ``n - s - 1`` forwards, stage ``s`` alternates one
  forward with one backward, so at most ``n - s`` micro-batches' activations are alive on it.
- ``zero_bubble(m, n)`` (ZB-H1): 1F1B's order with each backward split in two: ``backward_input``
  (the gradient of the stage's inputs, what the previous stage waits for) and ``backward_weight``
  (the parameters' gradients). Stage ``s`` runs each ``backward_weight`` ``s`` backwards late, so the
  deferred ones fill the cool-down bubble: with forward, input and weight backwards of one unit each
  a step takes ``3m + n - 1`` units against 1F1B's ``3m + 3(n - 1)``. A micro-batch stays alive until its
  weight backward, so every stage keeps at most ``min(n, m)`` (1F1B's stage 0 bound).
- ``merged_weights(m, n)``: split backwards, every ``backward_weight`` at the end of the step, one
  after another: the runtime runs such a run of weight backwards as one pass, each linear layer's
  weight gradient one matrix product over all the micro-batches (``runtime.linearw``) instead of one
  product and one add per micro-batch. Input backwards are all the other stages wait for, so the
  weights come off the critical path too; the price is memory: each stage keeps what the weight
  gradients need (linear layers' inputs and output gradients) for all ``m`` micro-batches. Since every
  micro-batch is held anyway, every stage but the last runs all its forwards first (GPipe's order,
  no more memory than that): the last stage alternates forward and input backward from its first
  micro-batch on and never waits for a forward that 1F1B's order would hold back behind an input
  backward on the way up (a round trip between ranks per micro-batch), and nothing waits for an
  earlier stage's input backwards but its own weight pass at the end.
- ``interleaved_one_f_one_b(m, n, ranks)`` (Megatron's interleaved 1F1B): ``n = v * ranks`` stages placed
looped,
  stage ``s`` on rank ``s % ranks``, each rank holding ``v`` of them. Each rank runs forwards of its stages in
  rounds of ``ranks`` micro-batches (a round through chunk 0, then chunk 1, ...), a warm-up of
  ``2 (ranks - r - 1) + (v - 1) ranks`` forwards, then one forward / one backward: the bubble shrinks to
  ``(ranks - 1) / (v m)`` of the step, at ``v`` times the point-to-point messages. Its clocks count one unit
  per action *per rank* (the ranks are the workers), so ``merged_order`` of a rank's stages is Megatron's
  order. ``microbatches`` must be a multiple of ``ranks`` (refused otherwise); with one stage per rank it is
  1F1B.

The vocabulary a plan and a run are written in lives here too, once: ``SCHEDULES`` (the schedule
names ``build`` knows), ``RECOMPUTE_MODES`` (activation recompute, "activation checkpointing": ``never``;
``except_last``, every micro-batch but a stage's last in flight recomputes its forward in backward;
``always``) and ``PRECISIONS`` (``"32"``, ``"bf16"``, ``"fp16"``: the autocast precision of a run).

Usage: ``for a in gpipe(4, 2)[0]: print(a.clock, a.kind, a.microbatch)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Action",
    "FORWARD",
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "SCHEDULES",
    "RECOMPUTE_MODES",
    "PRECISIONS",
    "gpipe",
    "one_f_one_b",
    "zero_bubble",
    "merged_weights",
    "interleaved_one_f_one_b",
    "looped_ranks",
    "merges_weights",
    "weight_run_ends",
    "forwards_first",
    "early_receives",
    "forward_only",
    "build",
    "merged_order",
    "max_live",
]

FORWARD = "forward"
BACKWARD = "backward"
BACKWARD_INPUT = "backward_input"  # gradient w.r.t. the stage's inputs only (zero-bubble's B)
BACKWARD_WEIGHT = (
    "backward_weight"  # the parameters' gradients of that micro-batch, run later (zero-bubble's W)
)
SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "merged-weights", "interleaved-1f1b")
RECOMPUTE_MODES = ("never", "except_last", "always")
PRECISIONS = ("32", "bf16", "fp16")


@dataclass(frozen=True)
class Action:
    """Run ``kind`` (``"forward"``, ``"backward"``, ``"backward_input"``, ``"backward_weight"``) of
    ``microbatch`` on ``stage`` at ``clock``."""

    clock: int
    stage: int
    microbatch: int
    kind: str


def _check(microbatches: int, stages: int) -> None:
    for name, value in (("microbatches", microbatches), ("stages", stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


def _with_clocks(orders: list[list[tuple[str, int]]]) -> list[list[Action]]:
    """Give each (kind, microbatch) of each stage's order its earliest clock (one worker per stage).

    Dependencies: forward(s, i) needs forward(s-1, i); backward(s, i) needs forward(s, i) and
    backward(s+1, i); backward_input likewise (on backward_input(s+1, i)); backward_weight(s, i) needs
    backward_input(s, i). Raises ``ValueError`` if the orders can never complete (a cycle).
    """
    return _clocked([[(k, s, i) for k, i in order] for s, order in enumerate(orders)], len(orders))


def _deps(kind: str, s: int, i: int, n: int) -> list[tuple[str, int, int]]:
    if kind == FORWARD:
        return [(FORWARD, s - 1, i)] if s > 0 else []
    if kind == BACKWARD_WEIGHT:
        return [(BACKWARD_INPUT, s, i)]
    return [(FORWARD, s, i)] + ([(kind, s + 1, i)] if s < n - 1 else [])


def _clocked(workers: list[list[tuple[str, int, int]]], n: int) -> list[list[Action]]:
    """Earliest clocks of each worker's ``(kind, stage, microbatch)`` order over ``n`` stages (one action per
    worker per clock; dependencies as ``_with_clocks``); returns each stage's actions in clock order."""
    clock: dict[tuple[str, int, int], int] = {}
    pos, last = [0] * len(workers), [-1] * len(workers)
    remaining = sum(len(o) for o in workers)
    while remaining:
        progressed = False
        for w, order in enumerate(workers):
            while pos[w] < len(order):
                key = order[pos[w]]
                deps = _deps(*key, n)
                if any(d not in clock for d in deps):
                    break
                clock[key] = last[w] = max([last[w] + 1] + [clock[d] + 1 for d in deps])
                pos[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("schedule orders have a dependency cycle; they can never complete")
    stages: list[list[Action]] = [[] for _ in range(n)]
    for order in workers:
        for k, s, i in order:
            stages[s].append(Action(clock[(k, s, i)], s, i, k))
    return [sorted(actions, key=lambda a: a.clock) for actions in stages]


def gpipe(microbatches: int, stages: int) -> list[list[Action]]:
    """GPipe: all forwards (micro-batch 0 first), then all backwards, on every stage."""
    _check(microbatches, stages)
    m = microbatches
    orders = [[(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)] for _ in range(stages)]
    return _with_clocks(orders)


def one_f_one_b(microbatches: int, stages: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): warm-up forwards, then one forward / one backward, then cool-down."""
    _check(microbatches, stages)
    m, n = microbatches, stages
    orders: list[list[tuple[str, int]]] = []
    for s in range(n):
        warmup = min(n - s - 1, m)
        order = [(FORWARD, i) for i in range(warmup)]
        f, b = warmup, 0
        while f < m:
            order.append((FORWARD, f))
            f += 1
            order.append((BACKWARD, b))
            b += 1
        order.extend((BACKWARD, i) for i in range(b, m))
        orders.append(order)
    return _with_clocks(orders)


def zero_bubble(microbatches: int, stages: int) -> list[list[Action]]:
    """ZB-H1: 1F1B with split backwards; stage ``s`` runs each weight backward ``s`` input backwards late.

    Usage: ``[a.kind for a in zero_bubble(4, 2)[1]]``.
    """
    _check(microbatches, stages)
    m, n = microbatches, stages
    orders: list[list[tuple[str, int]]] = []
    for s in range(n):
        warmup, lag = min(n - s - 1, m), s
        order = [(FORWARD, i) for i in range(warmup)]
        f, b, w = warmup, 0, 0
        while b < m:
            if f < m:
                order.append((FORWARD, f))
                f += 1
            order.append((BACKWARD_INPUT, b))
            b += 1
            if b - w > lag:
                order.append((BACKWARD_WEIGHT, w))
                w += 1
        order.extend((BACKWARD_WEIGHT, i) for i in range(w, m))
        orders.append(order)
    return _with_clocks(orders)


def merged_weights(microbatches: int, stages: int) -> list[list[Action]]:
    """Split backwards, every stage's weight backwards last, in micro-batch order (run as one): every stage
    but the last runs all its forwards, then its input backwards; the last alternates forward and input
    backward.

    Usage: ``[a.kind for a in merged_weights(4, 2)[0]]``.
    """
    _check(microbatches, stages)
    m = microbatches
    weights = [(BACKWARD_WEIGHT, i) for i in range(m)]
    first = [(FORWARD, i) for i in range(m)] + [(BACKWARD_INPUT, i) for i in range(m)]
    last = [(kind, i) for i in range(m) for kind in (FORWARD, BACKWARD_INPUT)]
    return _with_clocks([(first if s < stages - 1 else last) + weights for s in range(stages)])


def looped_ranks(microbatches: int, stages: int, ranks: int) -> int:
    """``v``, the stages each of ``ranks`` holds when ``stages`` are placed looped (stage ``s`` on rank ``s %
    ranks``), checked for Megatron's interleaved 1F1B: ``stages`` a multiple of ``ranks``, and
    ``microbatches`` too when ``v > 1``. Raises ``ValueError`` naming the fix.

    Usage: ``looped_ranks(4, 4, 2) == 2``.
    """
    _check(microbatches, stages)
    _check(1, ranks)
    if stages % ranks:
        raise ValueError(
            f"schedule='interleaved-1f1b' places stage s on rank s % {ranks}: {stages} stages on {ranks} "
            f"pipeline ranks is not a whole number of stages per rank; pass balance= (or devices=) with "
            f"{stages // ranks * ranks or ranks} or {(stages // ranks + 1) * ranks} stages"
        )
    v = stages // ranks
    if v > 1 and microbatches % ranks:
        lower = microbatches // ranks * ranks
        fix = f"microbatches={lower} or {lower + ranks}" if lower else f"microbatches={ranks}"
        raise ValueError(
            f"schedule='interleaved-1f1b' runs micro-batches in rounds of the {ranks} pipeline ranks: "
            f"microbatches={microbatches} is not a multiple of {ranks}; pass {fix} (or schedule='1f1b')"
        )
    return v


def interleaved_one_f_one_b(microbatches: int, stages: int, ranks: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B over ``stages`` placed looped on ``ranks`` (see the module docstring): each
    stage's actions, clocked per rank. One stage per rank: ``one_f_one_b``.

    Usage: ``[(a.stage, a.kind) for a in merged_order(interleaved_one_f_one_b(4, 4, 2), [0, 2])]``.
    """
    v = looped_ranks(microbatches, stages, ranks)
    if v == 1:
        return one_f_one_b(microbatches, stages)
    m, p = microbatches, ranks
    total = m * v

    def step(k: int, r: int, kind: str) -> tuple[str, int, int]:
        chunk = (k // p) % v
        chunk = chunk if kind == FORWARD else v - 1 - chunk
        return kind, chunk * p + r, (k // (p * v)) * p + k % p

    workers: list[list[tuple[str, int, int]]] = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [step(k, r, FORWARD) for k in range(warmup)]
        for i in range(total - warmup):
            order += [step(warmup + i, r, FORWARD), step(i, r, BACKWARD)]
        order += [step(k, r, BACKWARD) for k in range(total - warmup, total)]
        workers.append(order)
    return _clocked(workers, stages)


def merges_weights(name: str) -> bool:
    """Whether the schedule called ``name`` runs each stage's consecutive weight backwards as one pass."""
    return name == "merged-weights"


def weight_run_ends(actions: list[Action]) -> set[int]:
    """The micro-batches whose ``backward_weight`` ends a run of consecutive ones in one stage's ``actions``:
    where a schedule that ``merges_weights`` takes the run as one pass.

    Usage: ``weight_run_ends(merged_weights(4, 2)[0]) == {3}``.
    """
    nexts = [*actions[1:], None]
    return {
        a.microbatch
        for a, b in zip(actions, nexts)
        if a.kind == BACKWARD_WEIGHT and (b is None or b.kind != BACKWARD_WEIGHT)
    }


def forwards_first(actions: Sequence[Action]) -> bool:
    """Whether one stage's ``actions`` run every forward before anything else (GPipe; merged-weights but on
    the last stage): the stage sends all its forwards at once, so the next stage can take them in as they
    come.

    Usage: ``forwards_first(merged_weights(4, 2)[0]) is True``.
    """
    kinds = [a.kind == FORWARD for a in actions]
    return kinds == sorted(kinds, reverse=True)


def early_receives(
    plan: Sequence[Sequence[Action]], stage: int, senders: Iterable[int]
) -> list[tuple[int, list[int]]]:
    """``(sender, micro-batches)`` for each of ``senders`` that runs its forwards first: ``stage`` may post
    the receives of its forwards from it at once (they come as the sender runs them, nothing held back).

    Usage: ``early_receives(merged_weights(4, 2), 1, [0]) == [(0, [0, 1, 2, 3])]``.
    """
    mbs = [a.microbatch for a in plan[stage] if a.kind == FORWARD]
    return [(src, mbs) for src in senders if forwards_first(plan[src])]


def forward_only(microbatches: int, stages: int) -> list[list[Action]]:
    """Forwards only (inference, or a forward whose backward the caller runs)."""
    _check(microbatches, stages)
    return _with_clocks([[(FORWARD, i) for i in range(microbatches)] for _ in range(stages)])


def build(name: str, microbatches: int, stages: int, ranks: int | None = None) -> list[list[Action]]:
    """The schedule called ``name`` (one of ``SCHEDULES``). ``ranks``: the workers (pipeline ranks) the stages
    are placed on, looped (``interleaved-1f1b`` only; default one per stage, where it is 1F1B)."""
    if name == "gpipe":
        return gpipe(microbatches, stages)
    if name == "1f1b":
        return one_f_one_b(microbatches, stages)
    if name == "zero-bubble":
        return zero_bubble(microbatches, stages)
    if name == "merged-weights":
        return merged_weights(microbatches, stages)
    if name == "interleaved-1f1b":
        return interleaved_one_f_one_b(microbatches, stages, stages if ranks is None else ranks)
    raise ValueError(f"schedule={name!r} is not one of {', '.join(SCHEDULES)}; pick one of those")


def merged_order(schedule: list[list[Action]], stages: list[int]) -> list[Action]:
    """The actions of several ``stages`` run by one worker, in clock order (ties: lower stage first).

    Every dependency of an action has a strictly smaller clock, so running each worker's merged
    list in this order never deadlocks.
    """
    picked = [a for s in stages for a in schedule[s]]
    return sorted(picked, key=lambda a: (a.clock, a.stage))


def max_live(actions: list[Action]) -> int:
    """Most micro-batches whose forward has run but whose backward has not, over ``actions``.

    A split backward frees a micro-batch at its ``backward_weight`` (what the input backward kept for
    the weights' gradients is still held until then).
    """
    live: set[int] = set()
    peak = 0
    for a in actions:
        if a.kind == FORWARD:
            live.add(a.microbatch)
            peak = max(peak, len(live))
        elif a.kind != BACKWARD_INPUT:
            live.discard(a.microbatch)
    return peak

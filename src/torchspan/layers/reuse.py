"""Modules called more than once in a forward: which stages can run them exactly, and a balance that can.

A layer called several times in one forward (``self.block(self.block(x))``, ALBERT-style weight
sharing ``for _ in range(2): for blk in self.blocks``) runs on the stage that holds it at every
call. A micro-batch walks the stages in order and never comes back, so every layer called between
a reused layer's first and last call must sit in that same stage: the stages may not cut that
*span*. ``check_stages`` raises ``ValueError`` before any compute when they do, naming the module,
where it is called and a balance that keeps each span in one stage (``keeping_balance``).

(``nn.Sequential(a, b, a)`` is another case: each entry is its own layer sharing ``a``'s
parameters, a tie the runtime keeps exact across stages; see ``layers.discovery.top_level_layers``.)

Pure data: names in, names and counts out. Usage::

    check_stages(["a", "block", "b", "block", "head"], [["a", "block"], ["b", "head"]], model="Net")
    # ValueError: ... 'block' is called 2 times ... balance=[1, 3] ...
    keeping_balance(4, [(1, 2)], [2, 2])   # [1, 3]: no cut between positions 1 and 2
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["reused", "spans", "keeping_balance", "check_stages", "balance_advice"]


def reused(calls: Sequence[str]) -> dict[str, int]:
    """Layers called more than once, with how many times, in order of their first call."""
    counts: dict[str, int] = {}
    for name in calls:
        counts[name] = counts.get(name, 0) + 1
    return {name: n for name, n in counts.items() if n > 1}


def spans(calls: Sequence[str]) -> dict[str, list[str]]:
    """For each reused layer, the layers called from its first call to its last (itself included), in call
    order."""
    out: dict[str, list[str]] = {}
    for name in reused(calls):
        first = calls.index(name)
        last = len(calls) - 1 - list(reversed(calls)).index(name)
        out[name] = list(dict.fromkeys(calls[first : last + 1]))
    return out


def keeping_balance(
    layers: int, together: Sequence[tuple[int, int]], wanted: Sequence[int]
) -> list[int] | None:
    """The balance of ``len(wanted)`` stages over ``layers`` positions, closest to ``wanted`` (cut by cut),
    that cuts none of the ``together`` ranges (inclusive positions); ``None`` when none exists."""
    stages = len(wanted)
    blocked = {c for lo, hi in together for c in range(lo + 1, hi + 1)}  # a cut at c: stage boundary before c
    allowed = [c for c in range(1, layers) if c not in blocked]
    if stages == 1:
        return [layers]
    if len(allowed) < stages - 1:
        return None
    targets = [sum(wanted[: i + 1]) for i in range(stages - 1)]
    # cost[i][j]: least distance placing cuts 0..i with cut i at allowed[j]
    inf = float("inf")
    cost = [[inf] * len(allowed) for _ in targets]
    back = [[-1] * len(allowed) for _ in targets]
    for j, c in enumerate(allowed):
        cost[0][j] = abs(c - targets[0])
    for i in range(1, len(targets)):
        best, arg = inf, -1
        for j, c in enumerate(allowed):
            if j > 0 and cost[i - 1][j - 1] < best:
                best, arg = cost[i - 1][j - 1], j - 1
            if arg >= 0:
                cost[i][j], back[i][j] = best + abs(c - targets[i]), arg
    j = min(range(len(allowed)), key=lambda k: cost[-1][k])
    if cost[-1][j] == inf:
        return None
    cuts = []
    for i in range(len(targets) - 1, -1, -1):
        cuts.append(allowed[j])
        j = back[i][j]
    cuts = [0, *reversed(cuts), layers]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def balance_advice(layers: int, together: Sequence[tuple[int, int]], wanted: Sequence[int]) -> str:
    """What to pass to ``span`` instead: ``"balance=[1, 3] with the same devices"`` (the balance closest to
    ``wanted`` keeping each range in one stage), else the most stages that can (``"2 devices and balance=[3,
    2]"``)."""
    for stages in range(len(wanted), 0, -1):
        counts = list(wanted[: stages - 1]) + [sum(wanted[stages - 1 :])]
        found = keeping_balance(layers, together, counts)
        if found is None:
            continue
        if stages == len(wanted):
            return f"balance={found} with the same devices"
        if stages == 1:
            return "one stage (devices=[one device], no balance)"
        return f"{stages} devices and balance={found} (no balance with {len(wanted)} stages can)"
    return "one stage (devices=[one device], no balance)"  # pragma: no cover - one stage always can


def check_stages(
    calls: Sequence[str],
    groups: Sequence[Sequence[str]],
    *,
    model: str = "the model",
    kinds: Mapping[str, str] | None = None,
) -> None:
    """Raise ``ValueError`` when a layer called several times in ``calls`` (every layer call of one forward,
    in order) has calls that ``groups`` (layer names per stage, in execution order) would run on another
    stage than the one holding it. ``model``: how to name the model; ``kinds``: layer name -> class name."""
    stage_of = {name: s for s, g in enumerate(groups) for name in g}
    order = [name for g in groups for name in g]
    position = {name: i for i, name in enumerate(order)}
    found = {name: span for name, span in spans(calls).items() if all(n in stage_of for n in span)}
    together = [(min(position[n] for n in span), max(position[n] for n in span)) for span in found.values()]
    for name, span in found.items():
        home = stage_of[name]
        away = [n for n in span if stage_of[n] != home]
        if not away:
            continue
        after = [calls[i - 1] if i > 0 else None for i, n in enumerate(calls) if n == name]
        where = ", ".join(f"after {a!r}" if a is not None else "first" for a in after)
        stages = sorted({stage_of[n] for n in span})
        raise ValueError(
            f"torchspan: module {name!r}{f' ({kinds[name]})' if kinds and name in kinds else ''} is called "
            f"{len(after)} times in one forward of {model} ({where}), and the layers between its first and "
            f"last call ({', '.join(map(repr, span))}) lie in stages {stages}: it is held in stage {home}, "
            f"so a micro-batch would have to come back to stage {home} after "
            f"{away[0]!r} (stage {stage_of[away[0]]}). Every call of a module runs in the stage holding "
            "it, so those layers must share one stage: pass "
            f"{balance_advice(len(order), together, [len(g) for g in groups])} (it keeps every reused "
            "module's calls in one stage), or give each call its own module holding the same nn.Parameter "
            "objects (torchspan keeps tied parameters exact across stages)"
        )

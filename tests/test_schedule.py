"""Schedules are pure data: checked without devices."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchspan import schedule as sched
from torchspan.schedule import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD


def _check_valid(plan: list[list[sched.Action]], m: int, n: int) -> None:
    assert len(plan) == n
    clock = {(a.kind, a.stage, a.microbatch): a.clock for s in plan for a in s}
    assert len(clock) == 2 * m * n  # every forward and backward exactly once
    for s, actions in enumerate(plan):
        assert all(a.stage == s for a in actions)
        clocks = [a.clock for a in actions]
        assert clocks == sorted(clocks) and len(set(clocks)) == len(clocks)  # one action per clock
        for a in actions:
            if a.kind == FORWARD and s > 0:
                assert a.clock > clock[(FORWARD, s - 1, a.microbatch)]
            if a.kind == BACKWARD:
                assert a.clock > clock[(FORWARD, s, a.microbatch)]
                if s < n - 1:
                    assert a.clock > clock[(BACKWARD, s + 1, a.microbatch)]


def test_gpipe_shape_two_stages() -> None:
    plan = sched.gpipe(3, 2)
    assert [(a.kind[0], a.microbatch, a.clock) for a in plan[0]] == [
        ("f", 0, 0),
        ("f", 1, 1),
        ("f", 2, 2),
        ("b", 0, 5),
        ("b", 1, 6),
        ("b", 2, 7),
    ]
    assert [(a.kind[0], a.microbatch, a.clock) for a in plan[1]] == [
        ("f", 0, 1),
        ("f", 1, 2),
        ("f", 2, 3),
        ("b", 0, 4),
        ("b", 1, 5),
        ("b", 2, 6),
    ]


def test_1f1b_order_two_stages() -> None:
    plan = sched.one_f_one_b(4, 2)
    assert [(a.kind[0], a.microbatch) for a in plan[0]] == [
        ("f", 0),
        ("f", 1),
        ("b", 0),
        ("f", 2),
        ("b", 1),
        ("f", 3),
        ("b", 2),
        ("b", 3),
    ]
    assert [(a.kind[0], a.microbatch) for a in plan[1]] == [
        ("f", 0),
        ("b", 0),
        ("f", 1),
        ("b", 1),
        ("f", 2),
        ("b", 2),
        ("f", 3),
        ("b", 3),
    ]


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 12), n=st.integers(1, 6))
def test_both_schedules_valid_and_1f1b_bounds_live_activations(m: int, n: int) -> None:
    g, f = sched.gpipe(m, n), sched.one_f_one_b(m, n)
    _check_valid(g, m, n)
    _check_valid(f, m, n)
    for s in range(n):
        assert sched.max_live(g[s]) == m
        assert sched.max_live(f[s]) <= min(n - s, m)
    # both finish in the same number of clocks (same bubble), 1f1b only reorders
    assert max(a.clock for s in g for a in s) == max(a.clock for s in f for a in s) == 2 * (m + n - 1) - 1


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 8), n=st.integers(1, 5), name=st.sampled_from(["gpipe", "1f1b", "zero-bubble"]))
def test_merged_order_respects_dependencies(m: int, n: int, name: str) -> None:
    plan = sched.build(name, m, n)
    order = sched.merged_order(plan, list(range(n)))  # one worker runs every stage
    done: set[tuple[str, int, int]] = set()
    for a in order:
        if a.kind == FORWARD and a.stage > 0:
            assert (FORWARD, a.stage - 1, a.microbatch) in done
        if a.kind in (BACKWARD, BACKWARD_INPUT):
            assert (FORWARD, a.stage, a.microbatch) in done
            if a.stage < n - 1:
                assert (a.kind, a.stage + 1, a.microbatch) in done
        if a.kind == BACKWARD_WEIGHT:
            assert (BACKWARD_INPUT, a.stage, a.microbatch) in done
        done.add((a.kind, a.stage, a.microbatch))


def _timed_length(plan: list[list[sched.Action]], units: dict[str, int]) -> int:
    """Length of a step when each kind of action takes ``units[kind]`` time, run as early as allowed."""
    end: dict[tuple[str, int, int], int] = {}
    free = [0] * len(plan)
    for a in sorted((a for s in plan for a in s), key=lambda a: (a.clock, a.stage)):
        deps = []
        if a.kind == FORWARD and a.stage > 0:
            deps.append((FORWARD, a.stage - 1, a.microbatch))
        if a.kind in (BACKWARD, BACKWARD_INPUT):
            deps.append((FORWARD, a.stage, a.microbatch))
            if a.stage < len(plan) - 1:
                deps.append((a.kind, a.stage + 1, a.microbatch))
        if a.kind == BACKWARD_WEIGHT:
            deps.append((BACKWARD_INPUT, a.stage, a.microbatch))
        start = max([free[a.stage]] + [end[d] for d in deps])
        end[(a.kind, a.stage, a.microbatch)] = free[a.stage] = start + units[a.kind]
    return max(free)


def test_zero_bubble_two_stages() -> None:
    plan = sched.zero_bubble(4, 2)
    assert [(a.kind[:10], a.microbatch) for a in plan[0]] == [
        ("forward", 0),
        ("forward", 1),
        ("backward_i", 0),
        ("backward_w", 0),
        ("forward", 2),
        ("backward_i", 1),
        ("backward_w", 1),
        ("forward", 3),
        ("backward_i", 2),
        ("backward_w", 2),
        ("backward_i", 3),
        ("backward_w", 3),
    ]
    assert [(a.kind[:10], a.microbatch) for a in plan[1]] == [
        ("forward", 0),
        ("backward_i", 0),
        ("forward", 1),
        ("backward_i", 1),
        ("backward_w", 0),
        ("forward", 2),
        ("backward_i", 2),
        ("backward_w", 1),
        ("forward", 3),
        ("backward_i", 3),
        ("backward_w", 2),
        ("backward_w", 3),
    ]
    assert sched.build("zero-bubble", 4, 2) == plan


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 12), n=st.integers(1, 6))
def test_zero_bubble_valid_smaller_bubble_same_live_bound(m: int, n: int) -> None:
    plan, base = sched.zero_bubble(m, n), sched.one_f_one_b(m, n)
    assert len(plan) == n
    seen = [(a.kind, a.stage, a.microbatch) for s in plan for a in s]
    assert sorted(seen) == sorted(
        (k, s, i) for k in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) for s in range(n) for i in range(m)
    )
    for s, actions in enumerate(plan):
        clocks = [a.clock for a in actions]
        assert clocks == sorted(clocks) and len(set(clocks)) == len(clocks)
        clock = {(a.kind, a.stage, a.microbatch): a.clock for t in plan for a in t}
        for a in actions:
            if a.kind == FORWARD and s > 0:
                assert a.clock > clock[(FORWARD, s - 1, a.microbatch)]
            if a.kind == BACKWARD_INPUT:
                assert a.clock > clock[(FORWARD, s, a.microbatch)]
                if s < n - 1:
                    assert a.clock > clock[(BACKWARD_INPUT, s + 1, a.microbatch)]
            if a.kind == BACKWARD_WEIGHT:
                assert a.clock > clock[(BACKWARD_INPUT, s, a.microbatch)]
        # a micro-batch is live until its weight backward: never more than 1F1B's largest (stage 0's)
        assert sched.max_live(actions) <= max(sched.max_live(b) for b in base) == min(n, m)
        assert actions[-1] == sched.Action(actions[-1].clock, s, m - 1, BACKWARD_WEIGHT)
    # forward, input and weight backward of one unit each (a whole backward two): the bubble shrinks from
    # 3(n-1) to n-1
    assert _timed_length(base, {FORWARD: 1, BACKWARD: 2}) == 3 * m + 3 * (n - 1)
    length = _timed_length(plan, {FORWARD: 1, BACKWARD_INPUT: 1, BACKWARD_WEIGHT: 1})
    assert length == 3 * m + (n - 1) if m >= n else length < 3 * m + 3 * (n - 1)


def test_max_live_counts_until_the_weight_backward() -> None:
    a = [
        sched.Action(0, 0, 0, FORWARD),
        sched.Action(1, 0, 1, FORWARD),
        sched.Action(2, 0, 0, BACKWARD_INPUT),
        sched.Action(3, 0, 2, FORWARD),
        sched.Action(4, 0, 0, BACKWARD_WEIGHT),
        sched.Action(5, 0, 3, FORWARD),
    ]
    assert sched.max_live(a) == 3


def test_forward_only_and_errors() -> None:
    plan = sched.forward_only(2, 3)
    assert [a.clock for a in plan[2]] == [2, 3] and all(a.kind == FORWARD for s in plan for a in s)
    with pytest.raises(ValueError, match="schedule='zigzag'"):
        sched.build("zigzag", 2, 2)
    with pytest.raises(ValueError, match="microbatches=0"):
        sched.gpipe(0, 2)
    with pytest.raises(ValueError, match="stages=True"):
        sched.one_f_one_b(2, True)  # type: ignore[arg-type]


def test_the_plan_and_run_vocabulary_has_one_definition() -> None:
    """Planner and runtime check names against schedule.py's tuples themselves, not copies that could
    drift."""
    from torchspan import planner
    from torchspan.planner import plans
    from torchspan.runtime import build as spanned

    # the runtime validates span()'s settings in build (the pipeline no longer re-exports them)
    assert plans.SCHEDULES is planner.SCHEDULES is spanned.SCHEDULES is sched.SCHEDULES
    assert (
        plans.RECOMPUTE_MODES is planner.RECOMPUTE_MODES is spanned.RECOMPUTE_MODES is sched.RECOMPUTE_MODES
    )
    assert spanned.PRECISIONS is sched.PRECISIONS
    assert sched.SCHEDULES == (
        "gpipe",
        "1f1b",
        "zero-bubble",
        "merged-weights",
        "interleaved-1f1b",
    ) and sched.RECOMPUTE_MODES == ("never", "except_last", "always")


def _rank_order(plan: list[list[sched.Action]], rank: int, ranks: int) -> list[tuple[str, int, int]]:
    return [
        (a.kind[0], a.stage, a.microbatch)
        for a in sched.merged_order(plan, list(range(rank, len(plan), ranks)))
    ]


def test_interleaved_1f1b_is_megatrons_order_per_rank() -> None:
    """4 stages looped on 2 ranks, 4 micro-batches: each rank runs Megatron's order (warm-up 2 (p - r - 1) +
    (v - 1) p forwards in rounds of p micro-batches per chunk, then one forward / one backward), every action
    once."""
    plan = sched.build("interleaved-1f1b", 4, 4, ranks=2)
    assert _rank_order(plan, 0, 2) == [
        ("f", 0, 0),
        ("f", 0, 1),
        ("f", 2, 0),
        ("f", 2, 1),  # warm-up: 2 * (2 - 0 - 1) + (2 - 1) * 2 = 4
        ("f", 0, 2),
        ("b", 2, 0),
        ("f", 0, 3),
        ("b", 2, 1),
        ("f", 2, 2),
        ("b", 0, 0),
        ("f", 2, 3),
        ("b", 0, 1),
        ("b", 2, 2),
        ("b", 2, 3),
        ("b", 0, 2),
        ("b", 0, 3),
    ]
    assert _rank_order(plan, 1, 2)[:3] == [
        ("f", 1, 0),
        ("f", 1, 1),
        ("f", 3, 0),
    ]  # warm-up (2 - 1) * 2 = 2, then 1F1B
    for s, actions in enumerate(
        plan
    ):  # every stage: each micro-batch's forward, then its backward, in micro-batch order
        assert [a.stage for a in actions] == [s] * 8
        assert [(a.kind, a.microbatch) for a in actions if a.kind == sched.BACKWARD] == [
            (sched.BACKWARD, i) for i in range(4)
        ]
    # a rank's clocks are distinct: merged_order of its stages is exactly the order above
    for r in range(2):
        clocks = [a.clock for a in sched.merged_order(plan, [r, r + 2])]
        assert len(set(clocks)) == len(clocks)


def test_interleaved_1f1b_shrinks_the_bubble() -> None:
    """Counted in 1F1B stage actions (an interleaved stage action is half of one, v = 2): 2 ranks, 8
    micro-batches take 17 against 1F1B's 2 (m + p - 1) = 18: the bubble is (p - 1) / (v m) of the step, not (p
    - 1) / m."""
    span = lambda plan: max(a.clock for actions in plan for a in actions) + 1  # noqa: E731
    inter = span(sched.build("interleaved-1f1b", 8, 4, ranks=2)) / 2  # stages half the size
    assert inter == 17 < span(sched.one_f_one_b(8, 2)) == 2 * (8 + 2 - 1)
    assert sched.build("interleaved-1f1b", 4, 2, ranks=2) == sched.one_f_one_b(
        4, 2
    )  # one stage per rank: 1F1B


def test_interleaved_1f1b_refuses_counts_it_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"microbatches=5 is not a multiple of 2; pass microbatches=4 or 6"):
        sched.build("interleaved-1f1b", 5, 4, ranks=2)
    with pytest.raises(ValueError, match=r"5 stages on 2 pipeline ranks .* balance="):
        sched.build("interleaved-1f1b", 4, 5, ranks=2)

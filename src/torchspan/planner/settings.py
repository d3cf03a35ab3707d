"""The settings a search visits: micro-batch counts, schedules and recompute modes, validated.

Dominated settings are skipped under ``"auto"``: GPipe (1F1B has its time with no more memory, merged-weights
its memory with no more time), and ``always`` (``except_last`` has its memory saving at less recompute;
``tests/test_planner_search.py`` checks both against brute force over every setting). Under ``"auto"`` the
schedule is 1F1B or merged-weights, 1F1B first in preference order: merged-weights when it is predicted faster
and fits, 1F1B (fewer micro-batches in flight) when memory is tight.

Usage: ``settings_grid(32, "auto", "auto", "auto")`` → ``[(1, "1f1b", "never"), (2, "1f1b", "never"), ...,
(1, "merged-weights", "never"), ...]``.
"""

from __future__ import annotations

import math

from ..schedule import RECOMPUTE_MODES, SCHEDULES

__all__ = ["Setting", "microbatch_candidates", "settings_grid", "sharded_schedule"]

Setting = tuple[int, str, str]  # (microbatches, schedule, recompute)


def microbatch_candidates(batch_size: int) -> list[int]:
    """Micro-batch counts tried under ``microbatches="auto"``: divisors and powers of two up to the batch."""
    out = {d for d in range(1, int(math.isqrt(batch_size)) + 1) if batch_size % d == 0}
    out |= {batch_size // d for d in out}
    p = 1
    while p <= batch_size:
        out.add(p)
        p *= 2
    return sorted(out)


def sharded_schedule(schedule: str) -> str:
    """The schedule a pipeline of FSDP2-sharded stages searches: ``"auto"`` is 1F1B there (a sharded stage
    runs whole backwards, so a split schedule gains nothing and would be priced for what it does not run); a
    fixed one as given.

    Usage: ``settings_grid(b, m, sharded_schedule(schedule), recompute)``.
    """
    return "1f1b" if schedule == "auto" else schedule


def settings_grid(batch_size: int, microbatches: int | str, schedule: str, recompute: str) -> list[Setting]:
    """``(microbatches, schedule, recompute)`` settings to search, validated, in preference order."""
    if microbatches == "auto":
        ms = microbatch_candidates(batch_size)
    elif isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be 'auto' or an int >= 1")
    elif microbatches > batch_size:
        raise ValueError(
            f"microbatches={microbatches} is more than the batch size {batch_size}; use at most "
            f"{batch_size} or 'auto'"
        )
    else:
        ms = [microbatches]
    if schedule == "auto":
        # GPipe is never faster in the model and never uses less memory. Merged-weights (GPipe's memory, no
        # per-micro-batch gradient accumulation) was measured on 2 gloo ranks on a CPU at 0.67-0.74x torch's
        # Schedule1F1B step (heavy model) and at parity (small): chosen when predicted faster and it fits.
        # Zero-bubble is priced (faster across devices, more memory on later stages) but stays opt-in
        schedules = ["1f1b", "merged-weights"]
    elif schedule in SCHEDULES:
        schedules = [schedule]
    else:
        raise ValueError(f"schedule={schedule!r} is not one of auto, {', '.join(SCHEDULES)}")
    if recompute == "auto":
        recomputes = ["never", "except_last"]  # 'always' saves no more memory than except_last, at more time
    elif recompute in RECOMPUTE_MODES:
        recomputes = [recompute]
    else:
        raise ValueError(f"recompute={recompute!r} is not one of auto, {', '.join(RECOMPUTE_MODES)}")
    return [(m, s, c) for c in recomputes for s in schedules for m in ms]

"""Why a launched job failed, in a few lines: the summary ``torchspan launch`` prints first.

Inputs are torchrun's failures (one per rank that ended badly: exit code or signal, pid, the error
file's message) and what the workers left in the job's folder (``heartbeat``: each rank's last beat,
and the errors the worker entry recorded). The rank named first is, in order:

1. a rank that raised an error of its own (not one that only lost a peer or timed out waiting);
2. a rank killed by a signal other than the launcher's SIGTERM (SIGKILL from the OOM killer, SIGSEGV),
   or that exited with a code and no error recorded;
3. where every failure only waited (timed out, lost a peer) or was stopped by the launcher: the rank
   the others waited for, a rank that stopped answering, from the heartbeats (a frozen one first, then
   one not waiting inside ``torch.distributed``, then the one that had issued the fewest collectives),
   with what it was doing;
4. else the earliest failure.

Usage: ``failure_report(exc.failures, job_folder, "train.py", max_restarts)`` (a ``ChildFailedError``'s
failures).
"""

from __future__ import annotations

import math
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .heartbeat import INTERVAL_S, read_beats, read_errors, waited_for_peer

__all__ = ["failure_report", "last_attempt"]

_STALE_S = 3 * INTERVAL_S + 2  # a beat older than this when the job ended: the process had frozen
_ESCALATION_S = 25  # torchrun's agent sends SIGKILL 30 s after the SIGTERM a worker did not end on


@dataclass
class _End:
    """How one rank ended: torchrun's failure, and what its worker left (an error record, a last beat)."""

    rank: int
    failure: Any  # torch.distributed.elastic ProcessFailure, or None for a rank only seen beating
    error: dict[str, Any] | None
    beat: dict[str, Any] | None

    @property
    def where(self) -> str:
        local = (
            self.failure.local_rank if self.failure is not None else (self.beat or {}).get("local_rank", "?")
        )
        pid = self.failure.pid if self.failure is not None else (self.beat or {}).get("pid", "?")
        return f"rank {self.rank} (local rank {local}, pid {pid})"

    @property
    def raised(self) -> bool:
        """It recorded an exception (the worker entry's record, or torchrun's error file)."""
        return self.error is not None or (self.failure is not None and isinstance(self.failure.message, dict))

    @property
    def how(self) -> str:
        if self.failure is None:
            return "stopped"
        code = self.failure.exitcode
        if (
            code < 0 and self.raised
        ):  # the launcher's SIGTERM reached it while it exited: it exits 1 on an exception
            return "exit code 1"
        return self.failure.signal_name() if code < 0 else f"exit code {code}"

    @property
    def waited(self) -> bool:
        """It only timed out or lost a peer (from its recorded error, else torchrun's message)."""
        if self.error is not None:
            return bool(self.error.get("waited"))
        message = _message(self.failure)
        return bool(message) and waited_for_peer("", message)

    escalated: bool = False  # killed by the agent's SIGKILL after its SIGTERM went unanswered for 30 s

    @property
    def stopped_by_launcher(self) -> bool:
        if self.failure is None or self.raised:
            return False
        return self.failure.exitcode == -int(signal.SIGTERM) or (
            self.escalated and self.failure.exitcode == -int(signal.SIGKILL)
        )


def last_attempt(job: str | os.PathLike[str]) -> Path:
    """The folder of the job's latest attempt (``attempt<N>``, the highest ``N``)."""
    attempts = [p for p in Path(job).glob("attempt*") if p.name[7:].isdigit()]
    return max(attempts, key=lambda p: int(p.name[7:])) if attempts else Path(job) / "attempt0"


def _message(failure: Any) -> str:
    if failure is None:
        return ""
    message = failure.message
    if isinstance(message, dict):
        return str(message.get("message", ""))
    text = str(message or "")
    return "" if text.startswith("To enable traceback see") else text  # torchrun's words for "no error file"


def _first_line(text: str, limit: int = 300) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


# Noise in a waiting rank's error once the rank it waited for is known: gloo's source locations, a guess.
_NOISE = (
    re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] "),
    re.compile(r"\s*Rank \d+ probably failed or was killed: see its traceback[^.]*"),
)


def _error_line(end: _End) -> str:
    if end.error is None:
        return _first_line(_message(end.failure)) or end.how
    text = f"{end.error.get('type')}: {end.error.get('message')}"
    for pattern in _NOISE:
        text = pattern.sub("", text)
    return _first_line(text)


def _time(end: _End) -> float:
    if end.error is not None:
        return float(end.error.get("time", math.inf))
    return float(getattr(end.failure, "timestamp", math.inf) or math.inf)


def _raised(ends: dict[int, _End]) -> _End | None:
    own = [e for e in ends.values() if e.failure is not None and not e.waited and not e.stopped_by_launcher]
    errors = [e for e in own if e.raised]
    if errors:
        return min(errors, key=lambda e: (_time(e), e.rank))
    return min(own, key=lambda e: (_time(e), e.rank)) if own else None


def _stuck(ends: dict[int, _End], end_time: float) -> _End | None:
    """The rank the others waited for: beating but not waiting itself (a frozen one first)."""
    suspects = [
        e for e in ends.values() if e.beat is not None and (e.failure is None or e.stopped_by_launcher)
    ]
    if not suspects:
        return None

    def key(e: _End) -> tuple[Any, ...]:
        beat = e.beat or {}
        stale = end_time - float(beat.get("time", 0)) > _STALE_S
        seq = beat.get("seq")
        return (
            not stale,
            bool(beat.get("waiting")),
            math.inf if seq is None else seq,
            float(beat.get("since", 0)),
            e.rank,
        )

    return min(suspects, key=key)


def _doing(beat: dict[str, Any], end_time: float) -> str:
    """One line: what a rank was doing at its last beat, for how long, and whether it had frozen."""
    last = float(beat.get("time", end_time))
    held = max(0.0, last - float(beat.get("since", last)))
    text = f"{beat.get('doing', 'unknown')}" + (f" (for {held:.0f} s)" if held >= 1 else "")
    quiet = end_time - last
    if quiet > _STALE_S:
        return (
            f"its last heartbeat was {quiet:.0f} s before the job ended: the process was frozen (stopped, "
            f"swapping, or in a call holding the GIL); it was then {text}"
        )
    return f"it was {text}"


def _stuck_lines(
    culprit: _End, ends: dict[int, _End], script: str, end_time: float
) -> tuple[list[str], set[int]]:
    """The summary naming ``culprit`` as the rank that stopped answering; also the ranks it names."""
    waiters = sorted((e for e in ends.values() if e.raised and e.waited), key=lambda e: (_time(e), e.rank))
    timed_out = [e for e in waiters if "time" in _error_line(e).lower()]  # not only lost a peer
    waiters = timed_out or waiters
    timeout = next(
        (b.get("timeout") for b in (e.beat for e in [*waiters, culprit]) if b and b.get("timeout")), None
    )
    who = ", ".join(f"rank {e.rank}" for e in waiters)
    if timed_out:
        cause = (
            f"{who} gave up waiting for it{f' after {timeout:g} s' if timeout else ''} and the job was "
            "stopped"
        )
    elif waiters:
        cause = (
            f"{who} lost {'its' if len(waiters) == 1 else 'their'} connection to it and the job was stopped"
        )
    else:
        cause = "the others were waiting for it when the job was stopped"
    if (culprit.beat or {}).get("finished"):
        lines = [
            f"torchspan launch: {culprit.where} of {script} finished its script while "
            f"{who or 'the others'} still waited for it: the ranks ran different collectives (a step, "
            "barrier or checkpoint that only some ranks run)"
        ]
    else:
        lines = [
            f"torchspan launch: {culprit.where} of {script} stopped answering: {cause}",
            f"  {_doing(culprit.beat or {}, end_time)}",
        ]
    for e in waiters:
        lines.append(f"  rank {e.rank} (waiting): {_error_line(e)}")
    if timed_out:
        lines.append(
            f"  if rank {culprit.rank} was only slow (a long checkpoint write or evaluation on one rank "
            "while the others wait), set TORCHSPAN_TIMEOUT to more seconds"
        )
    return lines, {culprit.rank, *(e.rank for e in waiters)}


def _failed_lines(end: _End, script: str, end_time: float) -> list[str]:
    lines = [f"torchspan launch: {end.where} of {script} failed with {end.how}"]
    if end.error is not None:
        lines.append(str(end.error.get("script_frames") or _error_line(end)))
    elif end.failure is not None:
        if _message(end.failure):
            lines.append(_message(end.failure))
        if end.beat is not None:
            lines.append(f"  {_doing(end.beat, end_time)}")
    return lines


def _others(ends: dict[int, _End], named: set[int], after: str) -> list[str]:
    """The ranks the summary did not name: those that failed too, and those the launcher stopped (``after``
    what)."""
    others = [e for r, e in sorted(ends.items()) if r not in named and e.failure is not None]
    failed = [str(e.rank) for e in others if not e.stopped_by_launcher]
    stopped = [str(e.rank) for e in others if e.stopped_by_launcher]
    lines = [f"also failed: rank {', '.join(failed)}"] if failed else []
    if stopped:
        lines.append(
            f"{'ranks' if len(stopped) > 1 else 'rank'} {', '.join(stopped)} "
            f"{'were' if len(stopped) > 1 else 'was'} stopped by the launcher {after}"
        )
    return lines


def failure_report(
    failures: dict[int, Any], job: str | os.PathLike[str], script: str, max_restarts: int = 0
) -> str:
    """The summary of a failed job (see the module docstring for which rank it names first)."""
    folder = last_attempt(job)
    beats, errors = read_beats(folder), read_errors(folder)
    first = min((float(f.timestamp) for f in failures.values()), default=0.0)
    ends = {r: _End(r, failures.get(r), errors.get(r), beats.get(r)) for r in sorted({*failures, *beats})}
    for end in (
        ends.values()
    ):  # torch stamps a signal's failure when it reaps it: the agent's SIGKILL comes 30 s late
        end.escalated = end.failure is not None and float(end.failure.timestamp) - first >= _ESCALATION_S
    end_time = min((_time(e) for e in ends.values() if e.error is not None), default=math.inf)
    if not math.isfinite(end_time):
        end_time = max((float(b.get("time", 0)) for b in beats.values()), default=0.0)
    culprit, what = _raised(ends), "failed"
    if culprit is not None:
        lines = _failed_lines(culprit, script, end_time)
        named = {culprit.rank}
    else:
        culprit, what = _stuck(ends, end_time), "stopped answering"
        if culprit is not None:
            lines, named = _stuck_lines(culprit, ends, script, end_time)
        else:
            culprit, what = (
                min((e for e in ends.values() if e.failure is not None), key=lambda e: (_time(e), e.rank)),
                "failed",
            )
            lines, named = _failed_lines(culprit, script, end_time), {culprit.rank}
    lines += _others(ends, named, f"after rank {culprit.rank} {what}")
    if max_restarts:
        lines.append(f"(after {max_restarts} restart(s), the limit set by --max-restarts)")
    traces = sorted(folder.glob("rank*.traceback.txt"))
    if traces:
        shown = traces[0] if len(traces) == 1 else folder / "rank*.traceback.txt"
        lines.append(
            f"full traceback{'s' if len(traces) > 1 else ''}: {shown} (TORCHSPAN_VERBOSE=1 prints them as "
            "they happen)"
        )
    return "\n".join(lines)

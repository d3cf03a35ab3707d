"""A ``Plan`` as text: ``str(plan)`` (one row per stage, then the cluster lines, peak memory, ties, the
strategies compared, the runner-up and the notes), as ``torchspan plan`` prints it. ``Plan`` inherits these
from :class:`PlanText`, which reads the plan's fields.

Usage: ``print(plan)``; ``plan.comparison_lines()``; ``plan.runner_up_text()``.
"""

from __future__ import annotations

from typing import Any

from ..hardware import format_bytes

__all__ = ["PlanText"]


class PlanText:
    """``Plan``'s text methods (module docstring)."""

    stages: list[Any]
    strategy: str
    microbatches: int
    schedule: str
    recompute: str
    shard: bool
    offload: str | None
    tp: int
    batch_size: int | None
    predicted_step_time: float | None
    peak_memory: dict[str, int]
    notes: list[str]
    runner_up: dict[str, Any]
    comparison: list[dict[str, Any]]
    ties: list[dict[str, Any]]
    stage_ranks: list[list[int]]
    predicted_times: dict[str, float]
    nodes: int
    devices_per_node: int
    data_parallel: int
    interconnect: str
    intra_link: str

    def __str__(self) -> str:
        head = (
            f"Plan ({self.strategy}): {len(self.stages)} stage(s), {self.microbatches} micro-batch(es), "
            f"schedule={self.schedule}, recompute={self.recompute}"
        )
        if self.shard:
            head += ", sharded" + (f" with states offloaded to {self.offload}" if self.offload else "")
        if self.tp > 1:
            head += f", tensor parallel {self.tp}"
        if self.batch_size is not None:
            head += f", batch={self.batch_size}"
        if self.predicted_step_time is not None:
            head += f", predicted step {self.predicted_step_time * 1e3:.2f} ms"
        rows = [
            (
                "stage",
                "device",
                "layers",
                "params",
                "grads",
                "optim",
                "activ.",
                "buffers",
                "work",
                "fwd ms",
                "bwd ms",
            )
        ]
        for i, s in enumerate(self.stages):
            names = (
                s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)})"
            )
            dev = f"{s.device} {s.device_name}".strip()
            rows.append(
                (
                    str(i),
                    dev,
                    names,
                    format_bytes(s.param_bytes),
                    format_bytes(s.grad_bytes),
                    format_bytes(s.optimizer_bytes),
                    format_bytes(s.activation_bytes),
                    format_bytes(s.buffer_bytes),
                    format_bytes(s.workspace_bytes),
                    f"{s.forward_time * 1e3:.2f}",
                    f"{s.backward_time * 1e3:.2f}",
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [head]
        for j, r in enumerate(rows):
            lines.append(
                "  ".join(
                    cell.ljust(w) if c < 3 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths))
                )
            )
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(self._cluster_lines())
        if self.peak_memory:
            peaks = ", ".join(f"{d}: {format_bytes(b)}" for d, b in self.peak_memory.items())
            lines.append(f"peak memory per device: {peaks}")
        lines.extend(self._tie_lines())
        lines.extend(self.comparison_lines())
        if self.runner_up_text():
            lines.append(self.runner_up_text())
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def runner_up_text(self) -> str:
        """``"runner-up: cpu | cuda:0 | cuda:1 (balance 3,4,5; 8 micro-batches), predicted 217.0 ms, within
        measurement noise (5%) ..."``, or ``""`` when no other device order was predicted within noise."""
        r = self.runner_up
        if not r:
            return ""
        where = " | ".join(map(str, r.get("devices", [])))
        balance = ",".join(map(str, r.get("balance", [])))
        step = float(r.get("predicted_step_time", 0.0)) * 1e3
        ours = (
            f" of this plan's {self.predicted_step_time * 1e3:.1f} ms"
            if self.predicted_step_time is not None
            else ""
        )
        why = (
            "this plan is preferred (fewer stages, then devices in listed order, then fewer "
            "micro-batches), so the same command keeps it"
        )
        return (
            f"runner-up: {where} (balance {balance}; {r.get('microbatches', '?')} micro-batch(es)), "
            f"predicted {step:.1f} ms, within measurement noise ({float(r.get('noise', 0.0)):.0%}){ours}: "
            f"{why}"
        )

    def comparison_lines(self) -> list[str]:
        """The strategies the planner weighed, one row each (``comparison``), then why the chosen one: ``[]``
        when none."""
        if not self.comparison:
            return []
        rows = [("strategy", "ranks", "step ms", "memory/device", "host/node", "fits", "")]
        for c in self.comparison:
            step = c.get("predicted_step_time")
            peak, host = c.get("peak_memory"), int(c.get("host_memory") or 0)
            rows.append(
                (
                    str(c.get("strategy", "?")) + (" *" if c.get("chosen") else ""),
                    str(c.get("ranks", "")),
                    "-" if step is None else f"{float(step) * 1e3:.2f}",
                    "-" if peak is None else format_bytes(int(peak)),
                    format_bytes(host) if host else "-",
                    "yes" if c.get("fits") else "no",
                    str(c.get("note", "")),
                )
            )
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        lines = ["strategies compared (* chosen; step: predicted time per step; memory: peak per device):"]
        for j, r in enumerate(rows):
            lines.append(
                "  ".join(
                    cell.rjust(w) if 2 <= k <= 4 else cell.ljust(w)
                    for k, (cell, w) in enumerate(zip(r, widths))
                ).rstrip()
            )
            if j == 0:
                lines.append("  ".join("-" * w for w in widths[:-1]))
        return lines

    def _tie_lines(self) -> list[str]:
        """One line per tied parameter: its layers and their stages; split ones say what that costs."""
        lines = []
        for tie in self.ties:
            where = ", ".join(f"{layer} (stage {self.stage_of(layer)})" for layer in tie.get("layers", []))
            line = f"tie: {tie.get('name')} ({format_bytes(int(tie.get('bytes', 0)))}) shared by {where}"
            if len(tie.get("stages", [])) > 1:
                if "seconds" in tie:  # charged by the planner (``planner.ties``)
                    line += (
                        f": split, {tie.get('charge', 'a copy per device')}: "
                        f"+{float(tie['seconds']) * 1e3:.3f} ms per step"
                    )
                else:
                    line += ": split, so one copy per device, its gradients summed across them every step"
            lines.append(line)
        return lines

    def _cluster_lines(self) -> list[str]:
        """A cluster plan's data x pipeline lines: mesh, links, step split, ranks per stage."""
        if not self.stage_ranks:
            return []
        t = self.predicted_times
        split = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t.items())
        lines = [
            f"cluster: {self.nodes} node(s) x {self.devices_per_node} device(s) = {self.world_size} ranks = "
            f"data parallel {self.data_parallel} x pipeline {len(self.stages)}"
            + (f" x tensor parallel {self.tp}" if self.tp > 1 else "")
            + f"; intra-node {self.intra_link or '-'}, "
            f"interconnect {self.interconnect or '-'}",
        ]
        if split:
            lines.append(f"step split: {split}")
        per = self.devices_per_node or 1
        for s, row in enumerate(self.stage_ranks):
            nodes = sorted({r // per for r in row})
            lines.append(f"stage {s} ranks {_ranges(row)} on node(s) {_ranges(nodes)}")
        return lines


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'`` (runs of consecutive values, in the given order)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)

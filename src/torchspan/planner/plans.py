"""``Plan``: where each layer runs, how the batch is split and scheduled. Pure data, JSON round-trip.

Usage::

    plan = Plan(stages=[StagePlan("cuda:0", ["embed", "blocks"]), StagePlan("cpu", ["head"])],
                microbatches=4, schedule="1f1b")
    Plan.from_json(plan.to_json()) == plan
    spanned = torchspan.span(model, plan)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..files import require_regular_file, write_text
from ..schedule import RECOMPUTE_MODES, SCHEDULES
from .plantext import PlanText

__all__ = ["Plan", "StagePlan", "SCHEDULES", "RECOMPUTE_MODES", "OFFLOADS"]

OFFLOADS = (None, "cpu")  # where a sharded plan keeps its states: the device, or host memory

_FORMAT = "torchspan.plan/1"
_CLUSTER_FIELDS = (
    "data_parallel",
    "nodes",
    "devices_per_node",
    "stage_ranks",
    "interconnect",
    "intra_link",
    "predicted_times",
)


@dataclass
class StagePlan:
    """One pipeline stage: consecutive ``layers`` placed on ``device``.

    Byte figures are predictions for this stage's device under the plan's schedule;
    times are predicted seconds per micro-batch.
    """

    device: str
    layers: list[str]
    device_name: str = ""
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    buffer_bytes: int = 0
    forward_time: float = 0.0
    backward_time: float = 0.0
    workspace_bytes: int = 0  # transfer/working buffers for one micro-batch (planner's estimate)

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device.strip():
            raise ValueError(
                f"StagePlan(device={self.device!r}) must be a device string such as 'cuda:0' or 'cpu'"
            )
        if not isinstance(self.layers, (list, tuple)) or not all(isinstance(n, str) for n in self.layers):
            raise ValueError(
                f"StagePlan(layers={self.layers!r}) on {self.device} must be a list of layer names, e.g. "
                "['embed', 'blocks']"
            )
        self.layers = list(self.layers)
        for name in (
            "param_bytes",
            "grad_bytes",
            "optimizer_bytes",
            "activation_bytes",
            "buffer_bytes",
            "workspace_bytes",
            "forward_time",
            "backward_time",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"StagePlan({name}={value!r}) on {self.device} must be a number")

    @property
    def total_bytes(self) -> int:
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.buffer_bytes
            + self.workspace_bytes
        )


@dataclass
class Plan(PlanText):
    """A placement of a model's layers on devices, with micro-batching, schedule and activation recompute."""

    stages: list[StagePlan]
    microbatches: int = 1
    schedule: str = "gpipe"
    recompute: str = "never"
    batch_size: int | None = None
    predicted_step_time: float | None = None
    peak_memory: dict[str, int] = field(default_factory=dict)
    strategy: str = "torchspan"
    notes: list[str] = field(default_factory=list)
    # Cluster plans (``planner.cluster``): ``data_parallel`` replicas of the pipeline over ``nodes``
    # machines of ``devices_per_node`` devices; ``stage_ranks[s][r]`` is the global rank holding stage
    # ``s`` of replica ``r`` (rank = node * devices_per_node + local device index). Defaults: one process.
    data_parallel: int = 1
    nodes: int = 1
    devices_per_node: int = 0
    stage_ranks: list[list[int]] = field(default_factory=list)
    interconnect: str = ""  # link between nodes (``hardware.links`` key)
    intra_link: str = ""  # link between devices of one node
    predicted_times: dict[str, float] = field(
        default_factory=dict
    )  # step split: compute, allreduce, p2p, ties
    # tied parameters: {"name", "layers", "stages", "bytes"} each; "stages" of more than one = a copy per
    # device, and then (planned with ties) "seconds": what the split adds to the predicted step, "charge":
    # how it is paid
    ties: list[dict[str, Any]] = field(default_factory=list)
    # the fastest plan on another device order predicted within measurement noise of this one
    # (``planner.stable``):
    # {"devices", "balance", "microbatches", "schedule", "recompute", "predicted_step_time", "noise",
    # "within_noise"}
    runner_up: dict[str, Any] = field(default_factory=dict)
    # sharded data parallel (FSDP2 over each stage's data-parallel ranks; ``span(model, plan)`` runs it) and
    # where the sharded states live: None (the device) or "cpu" (FSDP2's CPUOffloadPolicy). JSON: left out
    # at the defaults
    shard: bool = False
    offload: str | None = None
    # every strategy the planner weighed (``planner.strategies``): {"strategy", "ranks", "data_parallel",
    # "stages", "shard", "offload", "predicted_step_time", "peak_memory", "budget", "host_memory",
    # "host_budget",
    # "fits", "chosen", "note"} each; JSON: left out when empty
    comparison: list[dict[str, Any]] = field(default_factory=list)
    # tensor parallel (``planner.tensorparallel``): each layer split over ``tp`` ranks of a node, tp
    # innermost:
    # ``stage_ranks`` then holds ``data_parallel * tp`` ranks per stage, replica r's ``row[r * tp:(r + 1) *
    # tp]``; ``span(model, plan)`` runs it (as ``span(model, tp=..., shard=True)``; shrunk on fewer ranks).
    # JSON:
    # left out at 1
    tp: int = 1

    def __post_init__(self) -> None:
        self.stages = [s if isinstance(s, StagePlan) else StagePlan(**s) for s in self.stages]
        if not self.stages:
            raise ValueError("Plan(stages=[]) is empty; a plan needs at least one stage")
        if (
            isinstance(self.microbatches, bool)
            or not isinstance(self.microbatches, int)
            or self.microbatches < 1
        ):
            raise ValueError(f"Plan(microbatches={self.microbatches!r}) must be an int >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan(schedule={self.schedule!r}) is not one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"Plan(recompute={self.recompute!r}) is not one of {', '.join(RECOMPUTE_MODES)}")
        seen: dict[str, int] = {}
        for i, s in enumerate(self.stages):
            if not s.layers:
                raise ValueError(
                    f"Plan stage {i} on {s.device} has no layers; drop the stage or give it layers"
                )
            for name in s.layers:
                if name in seen:
                    raise ValueError(
                        f"Plan: layer {name!r} is in stage {seen[name]} and stage {i}; each layer belongs "
                        "to one stage"
                    )
                seen[name] = i
        if not isinstance(self.shard, bool):
            raise ValueError(f"Plan(shard={self.shard!r}) must be True or False")
        if self.offload not in OFFLOADS:
            raise ValueError(
                f"Plan(offload={self.offload!r}) must be one of {', '.join(map(repr, OFFLOADS))}"
            )
        if self.offload is not None and not self.shard:
            raise ValueError(
                f"Plan(offload={self.offload!r}) needs shard=True: the offloaded states are the shards "
                "(FSDP2's CPUOffloadPolicy)"
            )
        self._check_cluster()

    def _check_cluster(self) -> None:
        """Validate the cluster fields: ``data_parallel * stages == nodes * devices_per_node`` ranks, each
        once."""
        for name in ("data_parallel", "nodes", "devices_per_node", "tp"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (0 if name == "devices_per_node" else 1)
            ):
                raise ValueError(
                    f"Plan({name}={value!r}) must be an int >= {0 if name == 'devices_per_node' else 1}"
                )
        if not self.stage_ranks:
            if self.data_parallel != 1 or self.nodes != 1 or self.tp != 1:
                raise ValueError(
                    f"Plan(data_parallel={self.data_parallel}, nodes={self.nodes}) needs stage_ranks "
                    "(the rank of each stage in each replica); plan a cluster with torchspan.plan(..., "
                    "nodes=N)"
                )
            return
        S, dp, tp = len(self.stages), self.data_parallel, self.tp
        rows = self.stage_ranks
        if len(rows) != S or any(not isinstance(r, list) or len(r) != dp * tp for r in rows):
            per = f"{dp} rank(s) (one per replica)" if tp == 1 else f"{dp * tp} ranks (tp {tp} per replica)"
            raise ValueError(f"Plan(stage_ranks={rows!r}) must hold {S} list(s) (one per stage) of {per}")
        world = self.nodes * self.devices_per_node
        if dp * S * tp != world:
            what, value = (
                ("data_parallel * stages", f"{dp} * {S}")
                if tp == 1
                else ("data_parallel * stages * tp", f"{dp} * {S} * {tp}")
            )
            raise ValueError(
                f"Plan: {what} = {value} = {dp * S * tp} must equal nodes * devices_per_node = "
                f"{self.nodes} * {self.devices_per_node} = {world} (the world size)"
            )
        flat = [r for row in rows for r in row]
        if sorted(flat) != list(range(world)) or any(isinstance(r, bool) for r in flat):
            raise ValueError(f"Plan(stage_ranks={rows!r}) must name every rank 0..{world - 1} exactly once")

    @property
    def world_size(self) -> int:
        """Processes the plan runs on: ``data_parallel * len(stages) * tp`` (1 for a one-process plan)."""
        return self.data_parallel * len(self.stages) * self.tp if self.stage_ranks else 1

    def rank_role(self, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` that global ``rank`` runs. Raises ``ValueError`` for a rank outside the
        plan."""
        for s, row in enumerate(self.stage_ranks):
            if rank in row:
                return s, row.index(rank) // self.tp
        raise ValueError(f"rank={rank!r} is not in this plan's ranks 0..{self.world_size - 1}")

    # ------------------------------------------------------------------ views
    @property
    def devices(self) -> list[str]:
        """Device of each stage, in stage order."""
        return [s.device for s in self.stages]

    @property
    def balance(self) -> list[int]:
        """Number of layers in each stage (``span(..., balance=...)`` form)."""
        return [len(s.layers) for s in self.stages]

    @property
    def layers(self) -> list[str]:
        return [name for s in self.stages for name in s.layers]

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; a one-process plan leaves the cluster fields out (its JSON is as before)."""
        data = asdict(self)
        if not self.stage_ranks:
            for name in _CLUSTER_FIELDS:
                data.pop(name)
        if not self.ties:
            data.pop("ties")  # a plan without tied parameters: its JSON is as before
        if not self.runner_up:
            data.pop("runner_up")  # nothing within noise: as before
        for name, default in (("shard", False), ("offload", None), ("comparison", []), ("tp", 1)):
            if data[name] == default:
                data.pop(name)  # not sharded, nothing compared: as before
        return {"format": _FORMAT, **data}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise ValueError(
                f"a plan is a JSON object with 'stages', not {type(data).__name__}; write one with Plan.save"
            )
        data = dict(data)
        if "checkpoint" in data:  # the key before recompute was named so (plans saved by older versions)
            if "recompute" in data:
                raise ValueError("plan has both 'recompute' and its old name 'checkpoint'; keep 'recompute'")
            data["recompute"] = data.pop("checkpoint")
        fmt = data.pop("format", _FORMAT)
        if fmt != _FORMAT:
            raise ValueError(
                f"plan format {fmt!r} is not {_FORMAT!r}; re-create the plan with this torchspan version"
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"plan has unknown fields {unknown}; expected only {sorted(known)}")
        stages = data.get("stages", [])
        if not isinstance(stages, list):
            raise ValueError(f"plan 'stages' must be a list of stages, not {type(stages).__name__}")
        stage_fields = set(StagePlan.__dataclass_fields__)
        for i, st in enumerate(stages):
            if not isinstance(st, dict):
                raise ValueError(
                    f"plan stage {i} must be an object with 'device' and 'layers', not {type(st).__name__}"
                )
            if "device" not in st or "layers" not in st:
                raise ValueError(
                    f"plan stage {i} lacks {'device' if 'device' not in st else 'layers'}; every stage "
                    "needs 'device' and 'layers'"
                )
            odd = sorted(set(st) - stage_fields)
            if odd:
                raise ValueError(
                    f"plan stage {i} has unknown fields {odd}; expected only {sorted(stage_fields)}"
                )
        data["stages"] = [StagePlan(**s) for s in stages]
        for name, kind in (
            ("peak_memory", dict),
            ("notes", list),
            ("stage_ranks", list),
            ("predicted_times", dict),
            ("ties", list),
            ("runner_up", dict),
            ("comparison", list),
        ):
            if name in data and not isinstance(data[name], kind):
                raise ValueError(
                    f"plan {name!r} must be a JSON {'object' if kind is dict else 'list'}, not "
                    f"{type(data[name]).__name__}"
                )
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"plan is not valid JSON ({exc}); write one with Plan.save or `torchspan plan --out`"
            ) from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON atomically into ``path`` (or the file its link points to); anything there
        but a regular file is refused (``torchspan.files``)."""
        write_text(path, self.to_json() + "\n", name="path")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        require_regular_file(
            path,
            name="path",
            what="a plan file",
            fix="name the JSON file Plan.save or `torchspan plan --out` wrote",
        )
        with open(path, encoding="utf-8") as fh:
            return cls.from_json(fh.read())

    def stage_of(self, layer: str) -> int | None:
        """The stage index holding ``layer`` (None if no stage does)."""
        return next((i for i, s in enumerate(self.stages) if layer in s.layers), None)

"""A cost model's placements as ``Plan``s and back: ``cm.to_plan(evaluation, strategy)``,
``cm.stages_for(plan)``, and the tied parameters a plan records (``record_ties``: what each split tie adds to
the predicted step). ``CostModel`` inherits these from :class:`PlanConversion`, which reads its profile,
settings and ties.

Usage::

    plan = cm.to_plan(cm.evaluate(stages), "torchspan")
    ev = cm.evaluate(cm.stages_for(plan))          # any Plan over these devices, e.g. a hand-made one
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..profiler.costs import Profile
from .plans import Plan, StagePlan
from .stages import Evaluation, Stage
from .ties import TieCost, split_stages, tie_entry

__all__ = ["PlanConversion"]


class PlanConversion:
    """``CostModel``'s conversions between ``Stage`` lists, ``Evaluation``s and ``Plan``s (module
    docstring)."""

    profile: Profile
    names: list[str]
    M: int
    schedule: str
    recompute: str
    ties: Sequence[TieCost]
    evaluate: Callable[..., Evaluation]  # CostModel.evaluate(stages, ties=None)

    def stages_for(self, plan: Plan) -> list[Stage]:
        """``plan``'s stages as ``Stage``s of this profile (any plan over its devices, by device name).

        Usage: ``cm.evaluate(cm.stages_for(plan))`` predicts a hand-made or ``balance`` plan.
        Raises ``ValueError`` when the plan names a device or layer order this profile lacks.
        """
        by_device: dict[str, int] = {}
        for d, dev in enumerate(self.profile.devices):
            by_device.setdefault(str(dev.device), d)
            by_device.setdefault(self.names[d], d)
        names = [lay.name for lay in self.profile.layers]
        if plan.layers != names:
            raise ValueError(
                f"plan places layers {plan.layers} but the profile has {names} in this order; "
                "profile the same model the plan was made for"
            )
        out, pos = [], 0
        for i, sp in enumerate(plan.stages):
            if sp.device not in by_device:
                raise ValueError(
                    f"plan stage {i} is on {sp.device!r}, which is not among the profile's devices "
                    f"{sorted(by_device)}; profile with that device listed"
                )
            out.append(Stage(by_device[sp.device], pos, pos + len(sp.layers)))
            pos += len(sp.layers)
        return out

    def to_plan(self, ev: Evaluation, strategy: str, notes: Sequence[str] = ()) -> Plan:
        """A ``Plan`` holding this placement and its predictions."""
        devs = self.profile.devices
        names = [lay.name for lay in self.profile.layers]
        stage_plans = []
        for s, f, bw_, m in zip(ev.stages, ev.forward, ev.backward, ev.memory):
            dev = devs[s.device]
            key = str(dev.device)
            stage_plans.append(
                StagePlan(
                    device=key,
                    layers=names[s.start : s.end],
                    device_name=dev.name,
                    param_bytes=m.params,
                    grad_bytes=m.grads,
                    optimizer_bytes=m.optimizer,
                    activation_bytes=m.activations,
                    buffer_bytes=m.buffers,
                    workspace_bytes=m.workspace,
                    forward_time=f,
                    backward_time=bw_,
                )
            )
        peak = dict(zip(ev.devices, ev.device_memory))  # per physical device: the sum of its stages
        plan = Plan(
            stages=stage_plans,
            microbatches=self.M,
            schedule=self.schedule,
            recompute=self.recompute,
            batch_size=self.profile.batch_size,
            predicted_step_time=ev.step_time,
            peak_memory=peak,
            strategy=strategy,
            notes=list(notes),
        )
        self.record_ties(plan, ev.stages)
        return plan

    def record_ties(self, plan: Plan, stages: Sequence[Stage]) -> None:
        """Fill ``plan.ties`` from the model's ties; a split one gets ``seconds``: what it adds to the
        predicted step (the step with that tie charged minus the step with none), and a note."""
        base = self.evaluate(stages, ties=()).step_time if self.ties else 0.0
        names = [lay.name for lay in self.profile.layers]
        for tie in self.ties:
            entry = tie_entry(tie, names, stages)
            if len(split_stages(tie, stages)) > 1:
                entry["seconds"] = self.evaluate(stages, ties=[tie]).step_time - base
                entry["charge"] = "copied to each other device every micro-batch and its gradient back"
                plan.notes.append(
                    f"tied parameter {tie.name} is used on stages {', '.join(map(str, entry['stages']))} "
                    f"({', '.join(entry['layers'])}): span keeps it on stage {entry['stages'][0]}'s device "
                    f"and copies it ({tie.nbytes:,} bytes) to each other device every micro-batch, its "
                    f"gradient back: +{entry['seconds'] * 1e3:.3f} ms per step; put those layers on one "
                    "stage to avoid it"
                )
            plan.ties.append(entry)

"""Plan accuracy: torchspan's predicted step time and memory against what ``span`` measures, one run.

For each model (uneven MLP, transformer stack, conv net) and device list this script

1. makes a plan with its prediction:
   ``['cpu']``: the planner's plan (``torchspan.profile`` on this machine, then
   ``torchspan.planner.search``: what ``torchspan.plan(model, batch, "cpu", optimizer="adam")`` does);
   ``['cpu', 'cpu']`` (the usual way to run a pipeline on a CPU-only machine): the planner itself
   keeps one stage there (both entries are one CPU, so a split cannot be faster), so the two-stage
   pipeline is built explicitly: ``torchspan.profile`` on ``['cpu', 'cpu']``, the cut that balances
   the two stages' compute, 4 micro-batches, 1F1B, scored by the planner's ``CostModel.evaluate``
   (which runs stages that share a device one after another);
2. runs ``torchspan.span(model, plan)`` (default ``workers="device"``: what users get; both
   ``'cpu'`` stages run in one worker) for ``--steps`` training steps after two warm-up steps
   (``optimizer.zero_grad()``, ``train_step`` with an MSE loss, ``Adam.step()``),
3. compares the plan's ``predicted_step_time`` with the median measured ``train_step`` time (the
   planner does not model the optimizer step), and each stage's predicted bytes (parameters,
   gradients, optimizer state, buffers, saved activations: ``StagePlan.total_bytes`` less the
   planner's transient ``workspace_bytes``, which nothing meters) with
   ``spanned.memory(optimizer)`` for that stage (same kinds; activations are the measured peak of
   live saved tensors during the step), and, as a diagnostic, each stage's predicted compute
   (micro-batches x (forward + backward) per micro-batch, plus the gradient accumulation of every
   micro-batch after the first) with the forward/backward blocks of ``spanned.timeline()``: it
   separates the profile's error from the schedule's.

The anchor is the measurement. Each ratio line reports the error factor ``max(p/m, m/p)``
(goal: <= 1.15, i.e. within 15% either way); the text after it gives ``predicted/measured``.
``torch.set_num_threads(--threads)`` (default 1) applies to profiling and running alike: on a
small shared machine, intra-op threads waiting at barriers for a busy core add millisecond stalls.

Prints ``RATIO <name> <value> <goal> <anchor>`` lines (read by ``torchspan bench``).
Usage: ``python benchmarks/plan_accuracy.py [--quick] [--steps N] [--threads T]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import torchspan
from torchspan.hardware import format_bytes
from torchspan.planner.cost import CostModel
from torchspan.planner.optimize import search
from torchspan.planner.plans import Plan
from torchspan.planner.stages import Stage
from torchspan.profiler.costs import Profile

# The conv net's BatchNorm sees micro-batches, not the batch: a numerics note that does not bear on time or
# memory.
warnings.filterwarnings("ignore", message="BatchNorm layer")


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def uneven_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    widths = [512, 1536, 1536, 512, 1024, 256, 1024, 512]
    mods: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        mods += [nn.Linear(a, b), nn.ReLU()]
    mods.append(nn.Linear(widths[-1], 10))
    return nn.Sequential(*mods), torch.randn(128, widths[0]), torch.randn(128, 10)


def transformer_stack() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    d = 128
    blocks = [nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True) for _ in range(4)]
    model = nn.Sequential(nn.Embedding(1000, d), *blocks, MeanPool(), nn.Linear(d, 10))
    return model, torch.randint(0, 1000, (32, 64)), torch.randn(32, 10)


def conv_net() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1, stride=2),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    return model, torch.randn(32, 3, 32, 32), torch.randn(32, 10)


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {
    "mlp": uneven_mlp,
    "transformer": transformer_stack,
    "convnet": conv_net,
}


def build(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return MODELS[name]()


def load() -> float:
    """The 1-minute load average (``nan`` where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def error_factor(predicted: float, measured: float) -> float:
    if predicted <= 0 or measured <= 0:
        return float("inf")
    return max(predicted / measured, measured / predicted)


def two_stage_plan(prof: Profile, microbatches: int = 4) -> Plan:
    """Two stages on ``['cpu', 'cpu']`` at the cut balancing their compute, scored by the cost model."""
    cm = CostModel(prof, microbatches, "1f1b", "never")
    L = len(prof.layers)
    evs = [cm.evaluate([Stage(0, 0, cut), Stage(1, cut, L)]) for cut in range(1, L)]
    ev = min(evs, key=lambda e: max(f + b for f, b in zip(e.forward, e.backward)))
    return cm.to_plan(
        ev, "balanced two-stage split", notes=["built by plan_accuracy.py; scored by CostModel.evaluate"]
    )


def run_case(name: str, devices: list[str], steps: int) -> dict[str, Any]:
    model, x, y = build(name)
    model.train()
    prof = torchspan.profile(model, x, torchspan.devices(devices), optimizer="adam")
    # one device: the planner's own choice (torchspan.plan = profile + search); two entries of the CPU:
    # the planner keeps one stage, so the two-stage pipeline is built by hand and scored by the cost model
    plan = search(prof) if len(devices) == 1 else two_stage_plan(prof)
    cm = CostModel(prof, plan.microbatches, plan.schedule, plan.recompute)
    placed = cm.stages_for(plan)
    again = cm.evaluate(placed).step_time
    if abs(again - float(plan.predicted_step_time or 0.0)) > 1e-9 * again:
        raise RuntimeError(
            f"CostModel.evaluate gives {again} s for the plan, which predicts {plan.predicted_step_time} s"
        )
    # gradient accumulation (micro-batches after the first) runs inside the backward blocks
    accumulate = [float(cm.accumulate[st.device, st.start : st.end].sum()) for st in placed]
    spanned = torchspan.span(model, plan)  # default workers="device"
    opt = torch.optim.Adam(model.parameters())
    loss_fn = nn.functional.mse_loss
    for _ in range(2):
        opt.zero_grad()
        spanned.train_step(x, y, loss_fn)
        opt.step()
    times = []
    busy: list[list[float]] = [[] for _ in plan.stages]  # per stage: forward+backward seconds per step
    for _ in range(steps):
        opt.zero_grad()
        t0 = time.perf_counter()
        spanned.train_step(x, y, loss_fn)
        times.append(time.perf_counter() - t0)
        opt.step()
        for i in range(len(plan.stages)):
            busy[i].append(
                sum(
                    e.duration
                    for e in spanned.timeline()
                    if e.stage == i and e.kind in ("forward", "backward")
                )
            )
    measured_stages = spanned.memory(opt)
    stages = []
    for sp, ms in zip(plan.stages, measured_stages):
        measured = ms["params"] + ms["grads"] + ms["buffers"] + ms["optimizer"] + ms["activations"]
        stages.append(
            {
                "device": sp.device,
                "layers": len(sp.layers),
                "predicted": sp.total_bytes - sp.workspace_bytes,  # the kinds spanned.memory() counts
                "workspace": sp.workspace_bytes,
                "measured": measured,
                "predicted_act": sp.activation_bytes,
                "measured_act": ms["activations"],
                "predicted_busy": plan.microbatches * (sp.forward_time + sp.backward_time)
                + (plan.microbatches - 1) * accumulate[len(stages)],
                "measured_busy": statistics.median(busy[len(stages)]),
            }
        )
    return {
        "plan": plan,
        "predicted_step": float(plan.predicted_step_time or 0.0),
        "measured_step": statistics.median(times),
        "spread": (min(times), max(times)),
        "stages": stages,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and only the MLP")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per case (default 10)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        ap.error("--steps and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    steps = 4 if args.quick else args.steps
    names = ["mlp"] if args.quick else list(MODELS)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, {args.threads} intra-op thread(s), {steps} measured steps per case"
    )
    rows = []
    loads = [load()]
    for name in names:
        single = run_case(name, ["cpu"], steps)
        split = run_case(name, ["cpu", "cpu"], steps)
        loads.append(load())
        for label, res in ((f"{name}/cpu", single), (f"{name}/cpu,cpu", split)):
            plan = res["plan"]
            print(
                f"\n== {label}: {len(plan.stages)} stage(s) {plan.balance}, {plan.microbatches} "
                f"micro-batch(es), {plan.schedule}, recompute={plan.recompute}"
            )
            lo, hi = res["spread"]
            print(
                f"   step: predicted {res['predicted_step'] * 1e3:.2f} ms, measured median "
                f"{res['measured_step'] * 1e3:.2f} ms (min {lo * 1e3:.2f}, max {hi * 1e3:.2f})"
            )
            for i, st in enumerate(res["stages"]):
                print(
                    f"   stage {i} on {st['device']} ({st['layers']} layers): predicted "
                    f"{format_bytes(st['predicted'])} (+ {format_bytes(st['workspace'])} transient "
                    f"workspace, not metered), measured {format_bytes(st['measured'])}; saved activations "
                    f"predicted {format_bytes(st['predicted_act'])}, measured "
                    f"{format_bytes(st['measured_act'])}; compute (fwd+bwd of all micro-batches, from "
                    f"spanned.timeline()) predicted {st['predicted_busy'] * 1e3:.2f} ms, measured "
                    f"{st['measured_busy'] * 1e3:.2f} ms"
                )
            rows.append((label, res))
    print(f"\nload average (1 min) before and after each model: {', '.join(f'{v:.2f}' for v in loads)}")
    print()
    for label, res in rows:
        p, m = res["predicted_step"], res["measured_step"]
        print(
            f"RATIO plan_accuracy/{label}/step_time {error_factor(p, m):.3f} <=1.15 measured train_step "
            f"(predicted/measured {p / m:.3f})"
        )
        for i, st in enumerate(res["stages"]):
            p, m = st["predicted"], st["measured"]
            print(
                f"RATIO plan_accuracy/{label}/memory_stage{i} {error_factor(p, m):.3f} <=1.15 "
                f"spanned.memory() (predicted/measured {p / m:.3f})"
            )
            p, m = st["predicted_busy"], st["measured_busy"]
            print(
                f"RATIO plan_accuracy/{label}/compute_stage{i} {error_factor(p, m):.3f} - spanned.timeline() "
                f"(predicted/measured {p / m:.3f})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

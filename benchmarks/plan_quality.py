"""Plan quality: torchspan's planned throughput over the baselines', on simulated clusters, one run.

For each model (uneven MLP, transformer stack, conv net) and cluster of *described* devices from
``torchspan.catalog`` (so no GPU is needed):

* homogeneous   ``a100-40gb*4``
* mixed         ``h100-80gb,a100-40gb,v100-16gb,t4`` (four GPU generations)
* tight_cpu     ``t4*2,cpu``

The models are small enough to profile here, so budgets are scaled to make them behave like
models that need several devices: the accelerators' budgets are proportional to their datasheet
memory and add up to ``share`` x what the whole model needs on one device at its most frugal
setting (parameters, gradients, Adam state, buffers, and activations with the most micro-batches,
1F1B and recompute: the figure a ``PlanError`` prints): 1.5x on homogeneous and mixed (no
single GPU holds the model, not even the largest), 0.7x on tight_cpu (part of it must live on the
CPU, the situation of ``seeds/000``); but never less than 1.1x the largest layer's need, so that
every device can hold some layer. The CPU keeps its real memory.

the script profiles the model once (``torchspan.profile(..., measure=False)``: FLOP/byte estimates
for the described GPUs, and for this CPU from its measured speed), then plans with
``torchspan.planner.search`` and with each baseline of ``torchspan.planner.baselines`` (uniform
layer counts; DeepSpeed-style parameter balance; accelerate-style greedy fill by parameter bytes;
the same greedy fill counting training state). Every plan is scored by the same cost model and
each baseline gets its own best micro-batch count / schedule / recompute, so the ratios compare
placement alone. A baseline whose placement exceeds a budget (out of memory in training) is shown
as OOM and left out of "best baseline".

It also times the search on a synthetic 1,000-layer profile over 8 devices: 3 types (4 equal
A100s, 3 equal V100s, the CPU), and 8 all-distinct devices (the same, but every GPU with its own
budget, each binding: it holds 16-22% of the model's training state, so no two GPUs admit the same
stages and the search cannot treat any two as one type). For reference it also prints a case with
8 distinct *speeds* and roomy budgets (the widest search: 8 types, stages as long as the bottleneck
allows).

Prints ``RATIO <name> <value> <goal> <anchor>`` lines (read by ``torchspan bench``):
``plan_quality_<model>_<cluster>`` = torchspan's predicted throughput / best fitting baseline's
(goal >= 1.3 on heterogeneous clusters, >= 1.0 on homogeneous ones), and
``plan_search_1000x8_seconds`` and ``plan_search_1000x8_distinct_seconds`` (goal <= 1.0).
Usage: ``python benchmarks/plan_quality.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from collections.abc import Callable

import torch
from torch import nn

import torchspan
from torchspan.hardware import format_bytes
from torchspan.planner import PlanError
from torchspan.planner.baselines import STRATEGIES, baseline
from torchspan.planner.explain import frugal_needs
from torchspan.planner.optimize import search
from torchspan.planner.settings import settings_grid
from torchspan.profiler.costs import LayerCost, Profile

# ----------------------------------------------------------------------------- models


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def uneven_mlp(quick: bool) -> tuple[nn.Module, torch.Tensor]:
    widths = [1024, 4096, 256, 8192, 512, 2048, 128, 4096, 1024]
    if quick:
        widths = [w // 4 for w in widths]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], 10))
    return nn.Sequential(*layers), torch.randn(256, widths[0])


def transformer(quick: bool) -> tuple[nn.Module, torch.Tensor]:
    d, blocks, vocab, seq = (256, 4, 2000, 64) if quick else (512, 12, 8000, 256)
    layers: list[nn.Module] = [nn.Embedding(vocab, d)]
    layers += [nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True) for _ in range(blocks)]
    layers += [nn.LayerNorm(d), nn.Linear(d, vocab)]
    return nn.Sequential(*layers), torch.randint(0, vocab, (16, seq))


def conv_net(quick: bool) -> tuple[nn.Module, torch.Tensor]:
    chans = [3, 32, 64, 128, 256] if quick else [3, 64, 128, 256, 512]
    layers: list[nn.Module] = []
    for a, b in zip(chans, chans[1:]):
        layers += [
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(b, b, 3, padding=1), nn.ReLU()),
            nn.MaxPool2d(2),
        ]
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(chans[-1], 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    ]
    size = 32 if quick else 64
    return nn.Sequential(*layers), torch.randn(64, 3, size, size)


MODELS: dict[str, Callable[[bool], tuple[nn.Module, torch.Tensor]]] = {
    "uneven_mlp": uneven_mlp,
    "transformer": transformer,
    "conv_net": conv_net,
}

CLUSTERS = {  # name: (device spec, accelerators' budgets in total as a share of the training state)
    "homogeneous": ("a100-40gb*4", 1.5),
    "mixed": ("h100-80gb,a100-40gb,v100-16gb,t4", 1.5),
    "tight_cpu": ("t4*2,cpu", 0.7),
}
HETEROGENEOUS = {"mixed", "tight_cpu"}


# ----------------------------------------------------------------------------- one case


def run_case(model_name: str, cluster: str, quick: bool) -> None:
    model, x = MODELS[model_name](quick)
    spec, share = CLUSTERS[cluster]
    devs = torchspan.devices(spec)
    t0 = time.perf_counter()
    prof = torchspan.profile(model, x, devs, optimizer="adam", measure=False)
    t_profile = time.perf_counter() - t0
    # what the whole model needs on one device at its most frugal setting (most micro-batches, 1F1B,
    # recompute): the same figure a PlanError prints
    need, largest, _ = frugal_needs(prof, settings_grid(prof.batch_size, "auto", "auto", "auto"))
    accel = [d for d in prof.devices if d.kind != "cpu"]
    sheet = sum(d.total_memory or 0 for d in accel)
    for d in accel:  # ... but every device holds the largest layer, so that every placement rule has a chance
        d.budget = int(max(share * need * (d.total_memory or 0) / sheet, 1.1 * largest))
    t0 = time.perf_counter()
    try:
        plan = search(prof)
    except PlanError as err:
        print(f"\n== {model_name} on {cluster}: no plan fits these budgets\n{err}")
        return
    t_search = time.perf_counter() - t0
    assert plan.predicted_step_time is not None
    ours = plan.batch_size / plan.predicted_step_time
    print(
        f"\n== {model_name} on {cluster} ({spec}); {len(prof.layers)} layers, batch {prof.batch_size}, "
        f"profile {t_profile:.1f}s, search {t_search * 1e3:.0f} ms"
    )
    budgets = ", ".join(f"{d.device}={format_bytes(d.capacity)}" for d in prof.devices)
    print(f"   budgets: {budgets}")
    print(
        f"   {'strategy':<13} {'samples/s':>11} {'vs torchspan':>12}  {'M':>3} {'sched':>5} {'ckpt':>11}  "
        "balance (devices)"
    )
    print(
        f"   {'torchspan':<13} {ours:>11.1f} {'1.00x':>12}  {plan.microbatches:>3} {plan.schedule:>5} "
        f"{plan.recompute:>11}  {plan.balance} ({', '.join(plan.devices)})"
    )
    best_name, best_tp, any_tp = None, 0.0, 0.0
    for strategy in STRATEGIES:
        bplan, ev = baseline(prof, strategy)
        tp = bplan.batch_size / ev.step_time
        tag = f"{ours / tp:.2f}x" if ev.fits else "OOM"
        print(
            f"   {strategy:<13} {tp:>11.1f} {tag:>12}  {bplan.microbatches:>3} {bplan.schedule:>5} "
            f"{bplan.recompute:>11}  {bplan.balance} ({', '.join(bplan.devices)})"
        )
        any_tp = max(any_tp, tp)
        if ev.fits and tp > best_tp:
            best_name, best_tp = strategy, tp
    print(
        "   (for reference: torchspan / fastest baseline if its budget overruns were allowed = "
        f"{ours / any_tp:.2f}x)"
    )
    goal = ">=1.3" if cluster in HETEROGENEOUS else ">=1.0"
    if best_name is None:
        print("   every baseline runs out of memory; torchspan's plan fits")
        print(f"RATIO plan_quality_{model_name}_{cluster} inf {goal} all baselines OOM")
    else:
        print(
            f"RATIO plan_quality_{model_name}_{cluster} {ours / best_tp:.3f} {goal} best baseline: "
            f"{best_name}"
        )


# ----------------------------------------------------------------------------- search speed


def synthetic_profile(n_layers: int, speeds: list[float] | None = None) -> Profile:
    rng = random.Random(0)
    devs = torchspan.devices("a100-40gb*4,v100-16gb*3,cpu")
    speeds = speeds or [1.0] * 4 + [0.6] * 3 + [0.02]
    layers = []
    for k in range(n_layers):
        j = rng.uniform(0.5, 2.0)
        params = rng.randint(0, 8 * 2**20)
        layers.append(
            LayerCost(
                name=f"l{k}",
                kind="Linear",
                param_bytes=params,
                grad_bytes=params,
                optimizer_bytes=2 * params,
                buffer_bytes=0,
                activation_bytes=rng.uniform(1e4, 1e5),
                output_bytes=rng.uniform(1e3, 5e4),
                flops=1e9,
                forward_fixed=[2e-5] * 8,
                forward_per_sample=[1e-5 * j / s for s in speeds],
                backward_fixed=[4e-5] * 8,
                backward_per_sample=[2e-5 * j / s for s in speeds],
                time_source=["synthetic"] * 8,
            )
        )
    return Profile(layers=layers, devices=devs, batch_size=64, input_bytes=1e4, optimizer="adam")


def distinct_budgets(prof: Profile) -> Profile:
    """Every GPU its own budget, each binding: 16%, 17%, ... 22% of the model's training state."""
    need = sum(lay.state_bytes for lay in prof.layers)
    for k, d in enumerate(prof.devices):
        if d.kind != "cpu":
            d.budget = int(need * (0.16 + 0.01 * k))
    return prof


def time_case(prof: Profile, title: str) -> float:
    """Best-of-3 search time, slowest of (settings fixed, settings on auto); prints both."""
    print(f"\n== search speed: {title}")
    worst = 0.0
    for label, kwargs in [
        ("fixed M=8, 1f1b, never", dict(microbatches=8, schedule="1f1b", recompute="never")),
        ("auto (M, schedule, recompute)", {}),
    ]:
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            plan = search(prof, **kwargs)  # type: ignore[arg-type]
            runs.append(time.perf_counter() - t0)
        best = min(runs)
        worst = max(worst, best)
        print(
            f"   {label:<32} {best:.3f} s (best of 3)  -> M={plan.microbatches}, stages {plan.balance}; "
            f"{plan.notes[-1]}"
        )
    return worst


def time_search() -> None:
    worst = time_case(
        synthetic_profile(1000), "1,000 synthetic layers on 8 devices (4 x A100, 3 x V100, CPU: 3 types)"
    )
    print(
        f"RATIO plan_search_1000x8_seconds {worst:.3f} <=1.0 one-second target (slowest of the two searches)"
    )
    prof = distinct_budgets(synthetic_profile(1000))
    budgets = ", ".join(format_bytes(d.capacity) for d in prof.devices if d.kind != "cpu")
    worst = time_case(prof, f"the same, 8 all-distinct devices (GPU budgets {budgets}, each binding; CPU)")
    print(
        f"RATIO plan_search_1000x8_distinct_seconds {worst:.3f} <=1.0 one-second target (slowest of the "
        "two searches)"
    )
    speeds = [1.0, 0.97, 0.94, 0.91, 0.6, 0.58, 0.56, 0.02]
    worst = time_case(
        synthetic_profile(1000, speeds),
        "for reference: 8 distinct speeds, roomy budgets (8 types, widest search)",
    )
    print(f"   (reference, no goal) plan_search_1000x8_distinct_speeds_seconds {worst:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller models")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print(
        f"plan_quality on {platform.processor() or platform.machine()} ({os.cpu_count()} cores), torch "
        f"{torch.__version__}"
    )
    for model_name in MODELS:
        for cluster in CLUSTERS:
            run_case(model_name, cluster, args.quick)
    time_search()


if __name__ == "__main__":
    main()

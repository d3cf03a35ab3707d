"""torchspan tensor parallelism, as users call it, against raw ``parallelize_module``: same model, plan, data,
processes.

``python benchmarks/distributed.py --tp`` runs this (so does ``python benchmarks/distributed_tp.py``). Two
gloo processes on 127.0.0.1 (or nccl with ``--backend nccl`` on GPUs) each build, per model, identical models
from the same seed and split them over a one-dimensional ``DeviceMesh`` ``("tp",)`` by the same plan:

- **raw parallelize**: ``parallelize_module(model, init_device_mesh(..., mesh_dim_names=("tp",)), plan)`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` written out, and the plain loop ``zero_grad(); loss.backward();
  step()``;
- **span**: ``torchspan.span(model, tp=2)`` (a transformers model's own ``base_model_tp_plan``; the MLP's by
  ``tp_plan=``) through ``train_step`` (goal <= 1.03x raw);
- **span loop**: the same span in the user's plain loop, ``loss.backward()`` on its output (goal <= 1.03x
raw).

Models: a Llama-style ``transformers.LlamaForCausalLM`` (``--hidden`` 256, ``--layers`` 4, 8 heads, 4 KV
heads, MLP width 4x, vocabulary 2048, its own loss; ``--batch`` 8 sequences of ``--seq`` 128 tokens, the same
on both ranks) and an MLP of ``Linear(h, 4h), GELU, Linear(4h, h)`` blocks (columns then rows, MSE loss, 64
rows). Every rank runs the same batch (tensor parallelism splits the layers, not the rows); Adam. Each round
times every variant, the order rotating from round to round, so all see the same machine load; the median of
per-round ratios is printed per model.

Usage::

    python benchmarks/distributed.py --tp         # 2 CPU processes, gloo, 1 thread each, both models
    python benchmarks/distributed_tp.py --rounds 15 --models llama
    python benchmarks/distributed_tp.py --quick   # tiny, 2 rounds of 1 step (torchspan bench --quick)

Prints ``RATIO distributed/tp_vs_raw_parallelize_<model> <median of per-round ratios> <=1.03 ...`` and
``RATIO distributed/tp_plain_loop_vs_raw_parallelize_<model> ...`` per model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, init_distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)
from _ranks import rank_env  # noqa: E402

VARIANTS = ("raw parallelize", "span", "span loop")
MODELS = ("llama", "mlp")
LLAMA_PLAN = {  # LlamaConfig.base_model_tp_plan, written out as parallelize_module takes it
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
MLP_PLAN = {"*.0": "colwise", "*.2": "rowwise"}


def _llama(opts: argparse.Namespace) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=opts.vocab,
        hidden_size=opts.hidden,
        intermediate_size=4 * opts.hidden,
        num_hidden_layers=opts.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max(opts.seq, 8),
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def _mlp(opts: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    h = opts.mlp_hidden
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)) for _ in range(opts.layers)]
    )


def _raw(model: nn.Module, plan: dict[str, str], tp: int) -> nn.Module:
    """What a user writes with torch alone: a ``("tp",)`` mesh and ``parallelize_module`` by the same plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (tp,), mesh_dim_names=("tp",))
    styles = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel() for k, v in plan.items()}
    return parallelize_module(model.to(device), mesh, styles)


def _batch(name: str, opts: argparse.Namespace, device: torch.device) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(1)  # the same on every rank
    if name == "llama":
        ids = torch.randint(0, opts.vocab, (opts.batch, opts.seq), generator=g).to(device)
        return ({"input_ids": ids, "labels": ids},)
    x = torch.randn(opts.mlp_batch, opts.mlp_hidden, generator=g).to(device)
    return x, torch.randn(opts.mlp_batch, opts.mlp_hidden, generator=g).to(device)


def _variants(name: str, opts: argparse.Namespace, device: torch.device) -> dict[str, Callable[[], None]]:
    """Each variant's timed step for model ``name`` (the same weights, plan and batch)."""
    make, plan = (_llama, LLAMA_PLAN) if name == "llama" else (_mlp, MLP_PLAN)
    batch = _batch(name, opts, device)
    mse = nn.MSELoss()

    def loss_of(module: nn.Module) -> torch.Tensor:
        return module(**batch[0]).loss if name == "llama" else mse(module(batch[0]), batch[1])

    raw = _raw(make(opts), plan, opts.nproc)
    raw_opt = torch.optim.Adam(raw.parameters(), lr=1e-4)
    spanned = torchspan.span(make(opts), tp=opts.nproc, tp_plan=None if name == "llama" else MLP_PLAN)
    assert (
        type(
            next(p for n, p in spanned.module.named_parameters() if n.endswith("0.weight") or "q_proj" in n)
        ).__name__
        == "DTensor"
    )
    span_opt = torch.optim.Adam(spanned.parameters(), lr=1e-4)

    def raw_step() -> None:
        raw_opt.zero_grad()
        loss_of(raw).backward()
        raw_opt.step()

    def span_step() -> None:
        span_opt.zero_grad()
        spanned.train_step(*batch) if name == "llama" else spanned.train_step(*batch, mse)
        span_opt.step()

    def loop_step() -> None:
        span_opt.zero_grad()
        loss_of(spanned).backward()
        span_opt.step()

    return dict(zip(VARIANTS, (raw_step, span_step, loop_step)))


def _timed(step: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - start


def _measure(
    steps: dict[str, Callable[[], None]], opts: argparse.Namespace, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Per-round mean step times, every variant first, second and last in turn, the direction alternating."""
    for _ in range(opts.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(opts.rounds):
        names = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for name in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            times[name].append(sum(_timed(steps[name], sync) for _ in range(opts.steps)) / opts.steps)
    return times


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace, results: dict) -> None:  # type: ignore[type-arg]
    rank_env(rank, world, port)
    torch.set_num_threads(opts.threads)
    info = init_distributed(backend=opts.backend, timeout=300)
    sync = (lambda: torch.cuda.synchronize(info.device)) if info.device.type == "cuda" else (lambda: None)
    for name in opts.model_list:
        times = _measure(_variants(name, opts, info.device), opts, sync)
        if rank == 0:
            results[name] = times
    if rank == 0:
        results["device"], results["backend"] = str(info.device), str(dist.get_backend())
    dist.barrier()
    dist.destroy_process_group()


def _label(name: str, opts: argparse.Namespace) -> str:
    if name == "llama":
        return f"llama{opts.hidden}x{opts.layers}"
    return f"mlp{opts.mlp_hidden}x{opts.layers}"


def _report(name: str, times: dict[str, list[float]], opts: argparse.Namespace, backend: str) -> None:
    label = _label(name, opts)
    shown = (
        f"seq {opts.seq} x batch {opts.batch}, vocab {opts.vocab}"
        if name == "llama"
        else f"{opts.mlp_batch} rows"
    )
    print(f"  {label}: {shown}")
    for variant, ts in times.items():
        print(
            f"    {variant:16s} median {statistics.median(ts) * 1e3:8.2f} ms/step  (rounds "
            f"{min(ts) * 1e3:.2f}..{max(ts) * 1e3:.2f} ms)"
        )
    anchor = times["raw parallelize"]
    for variant, tag in (("span", "tp"), ("span loop", "tp_plain_loop")):
        plain = statistics.median(times[variant]) / statistics.median(anchor)
        paired = statistics.median(t / r for t, r in zip(times[variant], anchor))
        print(
            f"    ratio {variant} / raw parallelize: {plain:.3f} (median of per-round ratios {paired:.3f}; "
            "goal <= 1.03)"
        )
        print(
            f"RATIO distributed/{tag}_vs_raw_parallelize_{label} {paired:.3f} <=1.03 raw "
            f"parallelize_module, same plan, {opts.nproc} x {backend}, {opts.threads} thread(s)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", action="store_true", help="(accepted: distributed.py --tp runs this script)")
    p.add_argument("--nproc", type=int, default=2, help="processes, each layer split over all of them")
    p.add_argument("--backend", default=None, help="gloo (default on CPU) or nccl")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {', '.join(MODELS)}")
    p.add_argument("--hidden", type=int, default=256, help="the Llama's hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers / MLP blocks")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (the same on every rank)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--mlp-hidden", type=int, default=512, help="the MLP's width (blocks of h -> 4h -> h)")
    p.add_argument("--mlp-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=1, help="steps per timed round")
    p.add_argument(
        "--rounds",
        type=int,
        default=40,
        help="rounds; each times every variant, the order rotating (a shared machine: many short rounds)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    add_quick(
        p,
        args,
        hidden=32,
        layers=1,
        seq=8,
        batch=2,
        vocab=64,
        mlp_hidden=16,
        mlp_batch=4,
        steps=1,
        rounds=2,
        warmup=1,
    )
    opts = p.parse_args(args)
    opts.model_list = [m.strip() for m in opts.models.split(",") if m.strip()]
    if not opts.model_list or any(m not in MODELS for m in opts.model_list):
        sys.exit(f"--models {opts.models}: choose from {', '.join(MODELS)} (comma-separated)")
    if opts.backend == "nccl" and opts.nproc > torch.cuda.device_count():
        sys.exit(f"--nproc {opts.nproc} > {torch.cuda.device_count()} visible GPUs")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(opts.nproc, free_port(), opts, results), nprocs=opts.nproc)
        res = dict(results)
    print(
        f"{opts.nproc} x {res['backend']} on {res['device']}, tp={opts.nproc}, Adam, {opts.rounds} "
        f"alternating rounds of {opts.steps} steps, {opts.threads} thread(s) per process"
    )
    for name in opts.model_list:
        _report(name, res[name], opts, res["backend"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

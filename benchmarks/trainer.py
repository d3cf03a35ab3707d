"""transformers' ``Trainer`` on torchspan against plain ``Trainer``: the same job, ms per training step.

A small Llama (vocab 1000, hidden 128, 4 layers, 4 heads; about 0.8M parameters) on generated token rows of
``--seq`` tokens, some padded (``attention_mask`` 0, labels -100), AdamW, Trainer's defaults otherwise
(``max_grad_norm=1``, linear schedule), ``report_to=[]``, ``use_cpu=True``, ``save_strategy="no"``, one
intra-op thread per process. Two comparisons, each a series of rounds; a round runs ``trainer.train()`` for
``--warmup + --steps`` steps (``max_steps``) once plain and once on torchspan, the order alternating from
round to round, and a ``TrainerCallback`` times the ``--steps`` steps after the warm-up (construction, the
first steps and the end of ``train()`` excluded):

(a) **replicas**: 2 gloo ranks spawned here (``torchspan.init_distributed()``), ``torchspan.hf.Trainer(...,
    span={})`` (data parallel: every process reads the global batch, each replica its rows) against plain
    ``transformers.Trainer`` on the same processes (its own DDP through accelerate, Trainer's default
    ``ddp_find_unused_parameters``: True for a ``PreTrainedModel``). Both have ``per_device_train_batch_size=
    --batch``: the same global batch of ``--batch x 2`` rows. A step's time is the slower rank's.
    ``--ddp-lean`` adds plain Trainer with ``ddp_find_unused_parameters=False`` (DDP without the graph walk),
    reported beside.
    Goal: torchspan <= 1.0x Trainer's own DDP.
(b) **local pipeline**: one process, ``torchspan.hf.Trainer(..., span={"devices": ["cpu", "cpu"],
    "microbatches": 2})`` against plain ``transformers.Trainer`` on the same ``--batch`` rows. No goal: a
    pipeline of two stages on one CPU process does the same work plus the pipeline's bookkeeping (its point is
    devices that are not there here); the ratio shows that bookkeeping's cost.

Printed: each variant's median ms/step, the median of per-round ratios to plain Trainer, and ``RATIO
trainer/<variant> ...`` lines for ``torchspan bench``.

Usage::

    python benchmarks/trainer.py --rounds 5 --steps 8      # both comparisons
    python benchmarks/trainer.py --only replicas --ddp-lean
    python benchmarks/trainer.py --quick                   # a smoke run (torchspan bench --quick)
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)
from _ranks import rank_env  # noqa: E402

try:
    import accelerate  # noqa: F401  (Trainer needs it)
    import transformers
except ImportError:
    transformers = None

PLAIN, LEAN, SPAN = "Trainer", "Trainer lean DDP", "torchspan"


def _model(opts: argparse.Namespace):  # type: ignore[no-untyped-def]
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=opts.hidden,
        intermediate_size=2 * opts.hidden,
        num_hidden_layers=opts.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class Rows(torch.utils.data.Dataset):
    """``n`` rows of ``seq`` tokens; every third row padded by a quarter, every fifth by half (labels
    -100)."""

    def __init__(self, n: int, seq: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 1000, (n, seq), generator=g)
        self.mask = torch.ones(n, seq, dtype=torch.long)
        self.mask[::3, -seq // 4 :] = 0
        self.mask[1::5, -seq // 2 :] = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": self.mask[i],
            "labels": self.ids[i].masked_fill(self.mask[i] == 0, -100),
        }


class Clock(transformers.TrainerCallback if transformers else object):  # type: ignore[misc]
    """Seconds per step over the steps after ``warmup`` (from the end of step ``warmup`` to the end of the
    last)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end, self.steps = warmup, 0.0, 0.0, 0

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.warmup:
            self.start = time.perf_counter()
        elif state.global_step > self.warmup:
            self.end, self.steps = time.perf_counter(), state.global_step - self.warmup

    def per_step(self) -> float:
        if self.steps <= 0:
            raise RuntimeError(f"no step timed after {self.warmup} warm-up steps: did train() run max_steps?")
        return (self.end - self.start) / self.steps


def _train(name: str, span: dict | None, opts: argparse.Namespace, replicas: int, out: str) -> float:  # type: ignore[type-arg]
    """One ``train()`` of ``--warmup + --steps`` steps; seconds per timed step."""
    import torchspan.hf

    steps = opts.warmup + opts.steps
    more = {"ddp_find_unused_parameters": False} if name == LEAN else {}
    args = transformers.TrainingArguments(
        os.path.join(out, name.replace(" ", "-")),
        per_device_train_batch_size=opts.batch,
        max_steps=steps,
        optim="adamw_torch",
        learning_rate=1e-3,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        **more,
    )
    data = Rows(opts.batch * replicas * steps, opts.seq)
    clock = Clock(opts.warmup)
    if name == SPAN:
        trainer = torchspan.hf.Trainer(
            model=_model(opts), args=args, train_dataset=data, callbacks=[clock], span=span
        )
    else:
        trainer = transformers.Trainer(model=_model(opts), args=args, train_dataset=data, callbacks=[clock])
    trainer.remove_callback(transformers.PrinterCallback)  # disable_tqdm's printer: train()'s closing metrics
    trainer.train()
    return clock.per_step()


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)


def _order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: rotating, reversed every other round (each variant first and last in turn)."""
    order = names[r % len(names) :] + names[: r % len(names)]
    return order if r % 2 == 0 else order[::-1]


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace, results: dict) -> None:  # type: ignore[type-arg]
    rank_env(rank, world, port, LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    _quiet()
    import torch.distributed as dist

    import torchspan

    torchspan.init_distributed(timeout=300)
    names = [PLAIN, SPAN] + ([LEAN] if opts.ddp_lean else [])
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as out:
        for r in range(opts.rounds):
            for name in _order(names, r):
                dist.barrier()
                timed = torch.tensor([_train(name, {} if name == SPAN else None, opts, world, out)])
                dist.all_reduce(timed, op=dist.ReduceOp.MAX)  # a step is as slow as its slower rank
                times[name].append(float(timed))
    if rank == 0:
        results.update(times)
    dist.destroy_process_group()


def _local(opts: argparse.Namespace) -> dict[str, list[float]]:
    """(b) in this process: plain Trainer and a 2-stage local pipeline, alternating."""
    torch.set_num_threads(1)
    _quiet()
    span = {"devices": ["cpu", "cpu"], "microbatches": 2}
    names = [PLAIN, SPAN]
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as out:
        for r in range(opts.rounds):
            for name in _order(names, r):
                times[name].append(_train(name, span if name == SPAN else None, opts, 1, out))
    return times


def _report(times: dict[str, list[float]], ratios: list[tuple[str, str, str, str]]) -> None:
    """Medians, then per ``(anchor, tag, goal, anchor words)`` torchspan's median of per-round ratios to
    it."""
    for name, ts in times.items():
        print(
            f"  {name:16s} median {statistics.median(ts) * 1e3:8.2f} ms/step (rounds "
            f"{min(ts) * 1e3:.2f}..{max(ts) * 1e3:.2f})"
        )
    for anchor, tag, goal, words in ratios:
        if anchor not in times:
            continue
        rounds = [t / a for t, a in zip(times[SPAN], times[anchor])]
        paired = statistics.median(rounds)
        print(
            f"  ratio {SPAN} / {anchor}: {paired:.3f} (median of per-round ratios; of medians "
            f"{statistics.median(times[SPAN]) / statistics.median(times[anchor]):.3f}; goal {goal}; rounds "
            f"{' '.join(f'{x:.2f}' for x in rounds)})"
        )
        print(f"RATIO trainer/{tag} {paired:.3f} {goal} {words}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("replicas", "local"), default=None, help="run one comparison")
    p.add_argument("--nproc", type=int, default=2, help="ranks for (a)")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (rows per replica)")
    p.add_argument("--seq", type=int, default=64, help="tokens per row")
    p.add_argument("--hidden", type=int, default=128, help="the Llama's hidden size (intermediate: twice it)")
    p.add_argument("--layers", type=int, default=4, help="the Llama's layers")
    p.add_argument("--steps", type=int, default=8, help="timed steps per train() (after --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each train()")
    p.add_argument(
        "--rounds", type=int, default=5, help="rounds; each runs every variant once, order alternating"
    )
    p.add_argument(
        "--ddp-lean", action="store_true", help="(a) also plain Trainer with ddp_find_unused_parameters=False"
    )
    add_quick(p, argv, hidden=32, layers=2, seq=16, batch=4, steps=1, warmup=1, rounds=2)
    opts = p.parse_args(argv)
    if transformers is None:
        print(
            "SKIP trainer/replicas_vs_trainer_ddp transformers or accelerate is not installed (pip install "
            "-e '.[hf]')"
        )
        print(
            "SKIP trainer/local_pipeline_vs_trainer transformers or accelerate is not installed (pip "
            "install -e '.[hf]')"
        )
        return 0
    from torchspan.runtime.ranks import free_port

    model = (
        f"Llama {opts.layers}x{opts.hidden} ({sum(q.numel() for q in _model(opts).parameters()) / 1e6:.2f}M)"
    )
    shape = (
        f"seq {opts.seq}, {opts.rounds} alternating rounds of {opts.warmup}+{opts.steps} steps (timed: "
        f"{opts.steps})"
    )
    if opts.only in (None, "replicas"):
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_worker, args=(opts.nproc, free_port(), opts, results), nprocs=opts.nproc)
            times = dict(results)
        print(
            f"(a) replicas: {opts.nproc} x gloo, 1 thread/process, {model}, per_device_train_batch_size "
            f"{opts.batch} (global {opts.batch * opts.nproc}), {shape}"
        )
        ranks = f"{opts.nproc} x gloo, {model}"
        _report(
            times,
            [
                (
                    PLAIN,
                    "replicas_vs_trainer_ddp",
                    "<=1.0",
                    "transformers.Trainer's own DDP (accelerate; Trainer's default "
                    f"find_unused_parameters=True), {ranks}",
                ),
                (
                    LEAN,
                    "replicas_vs_trainer_lean_ddp",
                    "-",
                    f"transformers.Trainer, ddp_find_unused_parameters=False, {ranks}",
                ),
            ],
        )
    if opts.only in (None, "local"):
        times = _local(opts)
        print(
            "(b) local pipeline: one process, 1 thread, span devices ['cpu', 'cpu'] microbatches 2, "
            f"{model}, batch {opts.batch}, {shape}"
        )
        _report(
            times,
            [(PLAIN, "local_pipeline_vs_trainer", "-", f"transformers.Trainer in one process, {model}")],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

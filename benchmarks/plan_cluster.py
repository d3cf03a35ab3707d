"""Cluster plans predicted vs measured on this machine: gloo processes on 127.0.0.1 (issue 13 item 4).

1. All-reduce of N bytes over 2 and 4 gloo processes: 2 processes calibrate the ``loopback`` link
   (relative least squares of ``t = S / bw + 2 * latency``, the ring formula at n = 2); 4 processes test the
   comm model's prediction with those figures (``planner.comm.allreduce_time``).
2. A data-parallel step of an MLP (4 Linear+ReLU blocks of ``--widths``) under
   ``torch.nn.parallel.DistributedDataParallel`` with ``bucket_cap_mb=25`` as the runtime's
   ``DataParallelReplica`` builds it (every bucket 25 MiB; forward + backward, whose bucketed gradient
   all-reduces DDP overlaps with backward and finishes inside ``backward()``; no optimizer step: the
   cost model does not model it) against ``torchspan.plan(..., devices="cpu", nodes=n,
   interconnect="loopback", data_parallel=n)``: each process one "node" of one CPU. Two predictions:
   "all at the end" (compute + the whole all-reduce: the model before overlap was modelled) and
   "overlapped" (compute + the exposed all-reduce, buckets hidden behind the rest of backward).

Every process runs ``torch.set_num_threads(1)``. Prints Markdown tables for benchmarks/RESULTS.md.

Usage::

    python benchmarks/plan_cluster.py   # default sizes and repeats
    python benchmarks/plan_cluster.py --repeats 20 --batch 64 --widths 512,2048
    # 2 processes, 3 sizes, width 64, 2 repeats (torchspan bench --quick)
    python benchmarks/plan_cluster.py --quick

Also prints ``RATIO plan_cluster/... <predicted / measured> - ...`` lines (read by ``torchspan bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)
from _ranks import rank_env  # noqa: E402

from torchspan.runtime.ranks import init_distributed  # noqa: E402

SIZES = [4 * 1024, 64 * 1024, 1024**2, 4 * 1024**2, 16 * 1024**2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mlp(width: int = 512) -> nn.Sequential:
    """Four ``width``-wide Linear+ReLU blocks and a 10-way head (512: 4.2 MB of float32 gradients, one
    25 MiB bucket; 2048: 67 MB, three buckets)."""
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _worker(
    rank: int, world: int, port: int, job: str, args: dict[str, Any], queue: Any, faults: str
) -> None:
    trace = open(Path(faults) / f"rank{rank}.txt", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=trace)  # a rank killed by a signal (abort) leaves its Python stacks here
    torch.set_num_threads(1)
    rank_env(rank, world, port)
    # torchspan's join: at exit it destroys the group and lets gloo's worker threads finish before the
    # interpreter's teardown (a raw init_process_group here lost a rank to SIGABRT at exit now and then:
    # "Fatal Python error: Aborted" in a thread with no Python frame, after the job had returned)
    init_distributed(backend="gloo", timeout=300)
    out = _allreduce(args) if job == "allreduce" else _ddp_step(rank, world, args)
    if rank == 0:
        queue.put(out)


def _allreduce(args: dict[str, Any]) -> dict[int, float]:
    """Median seconds per all-reduce, per size (slowest rank's view: a barrier before each, max over
    ranks)."""
    out = {}
    for size in args["sizes"]:
        t = torch.ones(size // 4)
        times = []
        for k in range(args["warmup"] + args["repeats"]):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if k >= args["warmup"]:
                times.append(float(took))
        out[size] = statistics.median(times)
    return out


def _ddp_step(rank: int, world: int, args: dict[str, Any]) -> tuple[float, float]:
    """Median seconds of forward + backward of a DDP replica (25 MiB buckets) on its shard of the global
    batch: ``(synced, under no_sync)``, steps alternating; their difference is the all-reduce the step waits
    for."""
    torch.manual_seed(0)
    width = args["width"]
    model = nn.parallel.DistributedDataParallel(mlp(width), bucket_cap_mb=25.0)  # as DataParallelReplica
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args["batch"], width, generator=gen).chunk(world)[rank]
    y = torch.randint(0, 10, (args["batch"],), generator=gen).chunk(world)[rank]
    loss_fn = nn.CrossEntropyLoss()
    times: dict[bool, list[float]] = {True: [], False: []}
    for k in range(2 * (args["warmup"] + args["repeats"])):
        sync = k % 2 == 0
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        with contextlib.nullcontext() if sync else model.no_sync():
            loss_fn(model(x), y).backward()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if k >= 2 * args["warmup"]:
            times[sync].append(float(took))
    return statistics.median(times[True]), statistics.median(times[False])


def run(world: int, job: str, args: dict[str, Any]) -> Any:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    with tempfile.TemporaryDirectory() as faults:
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, job, args, queue, faults)) for r in range(world)
        ]
        for p in procs:
            p.start()
        for r, p in enumerate(procs):
            p.join(timeout=600)
            if p.exitcode != 0:
                stacks = (Path(faults) / f"rank{r}.txt").read_text()
                fd, kept = tempfile.mkstemp(prefix=f"plan_cluster_{job}_rank{r}_", suffix=".txt")
                os.write(fd, stacks.encode())
                os.close(fd)
                raise RuntimeError(
                    f"{stacks[-2000:]}\n{job} over {world} processes: rank {r} exited with {p.exitcode} "
                    f"(its Python stacks at the fault: {kept})"
                )
    return queue.get()


def fit(times: dict[int, float]) -> tuple[float, float] | None:
    """``(bandwidth bytes/s, latency s)`` from 2-process all-reduce times: ``t = S/bw + 2 lat`` fitted by
    least squares of the RELATIVE error (weights ``1/t^2``), so 4 KiB counts as much as 16 MiB. ``None`` when
    the times do not grow with the size (small sizes on a busy machine: noise, no bandwidth to read)."""
    xs, ys = list(times), [times[s] for s in times]
    w = [1.0 / y**2 for y in ys]
    sw, sx, sy = sum(w), sum(a * x for a, x in zip(w, xs)), sum(a * y for a, y in zip(w, ys))
    sxx, sxy = sum(a * x * x for a, x in zip(w, xs)), sum(a * x * y for a, x, y in zip(w, xs, ys))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    intercept = (sy - slope * sx) / sw
    if not slope > 0:
        return None
    return 1.0 / slope, max(0.0, intercept / 2)


def _err(pred: float, meas: float) -> str:
    return f"{pred / meas:.2f}"


def main() -> None:
    from torchspan import plan
    from torchspan.hardware import links
    from torchspan.planner.comm import allreduce_time

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--widths", default="512,2048", help="MLP widths of the data-parallel step, comma-separated"
    )
    add_quick(ap, None, repeats=2, warmup=1, batch=16, widths="64")  # and 2 processes only, sizes up to 1 MiB
    opts = ap.parse_args()
    procs = (2,) if opts.quick else (2, 4)
    sizes = SIZES[:3] if opts.quick else SIZES
    torch.set_num_threads(1)
    args = {"sizes": sizes, "warmup": opts.warmup, "repeats": opts.repeats, "batch": opts.batch}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.2f}")

    measured = {n: run(n, "allreduce", args) for n in procs}
    fitted_at = fit(measured[2])
    table = links.lookup("loopback")
    listed = (
        f"links.py table: {table.bandwidth / 1e9:.3f} GB/s x {table.efficiency:g}, "
        f"{table.latency * 1e6:.1f} us"
    )
    if fitted_at is None:
        fitted = None
        print(
            "\nfit on 2 processes: none, the times do not grow with the size (noise at these sizes) "
            f"({listed})"
        )
    else:
        bw, lat = fitted_at
        fitted = links.calibrated(table, bw, lat, "this run")
        print(f"\nfit on 2 processes: bandwidth {bw / 1e9:.3f} GB/s, latency {lat * 1e6:.1f} us ({listed})")
    print(
        "\n| processes | bytes | measured ms | predicted ms (table) | pred/meas | predicted ms (this run's "
        "fit) | pred/meas |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in procs:
        for size in sizes:
            m = measured[n][size]
            p_table = allreduce_time(size, n, table)
            p_fit = allreduce_time(size, n, fitted) if fitted is not None else None
            by_fit = f"{p_fit * 1e3:.3f} | {_err(p_fit, m)}" if p_fit is not None else "- | -"
            print(f"| {n} | {size:,} | {m * 1e3:.3f} | {p_table * 1e3:.3f} | {_err(p_table, m)} | {by_fit} |")

    rows = []
    for width in [int(w) for w in opts.widths.split(",")]:
        x = torch.randn(opts.batch, width)
        for n in procs:
            meas, alone = run(n, "ddp", {**args, "width": width})
            pl = plan(
                mlp(width),
                x,
                devices="cpu",
                nodes=n,
                interconnect="loopback",
                data_parallel=n,
                microbatches=1,
                recompute="never",
                optimizer="sgd",
            )
            rows.append((width, n, meas, alone, pl))
    print(
        "\n| width | processes | DDP fwd+bwd measured ms | all at the end: compute + all-reduce ms | "
        "pred/meas | overlapped: compute + exposed ms | pred/meas | plan |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for width, n, meas, alone, pl in rows:
        t = pl.predicted_times
        before = t["compute"] + t["allreduce_total"] + t["p2p"]
        after = pl.predicted_step_time or 0.0
        buckets = next((k for k in pl.notes if "bucket(s)" in k), "").split(", ")[1:2]
        what = (
            f"dp {pl.data_parallel} x pp {len(pl.stages)}, {opts.batch // n} samples/replica, "
            f"{''.join(buckets)}"
        )
        print(
            f"| {width} | {n} | {meas * 1e3:.2f} | {before * 1e3:.2f} ({t['compute'] * 1e3:.2f} + "
            f"{t['allreduce_total'] * 1e3:.2f}) | {_err(before, meas)} | {after * 1e3:.2f} "
            f"({t['compute'] * 1e3:.2f} + {t['allreduce'] * 1e3:.2f}) | {_err(after, meas)} | {what} |"
        )
    print(
        "\nThe all-reduce alone: measured wait = DDP step - the same step under no_sync (same processes, "
        "alternating)."
    )
    print(
        "\n| width | processes | no_sync ms | measured wait ms | predicted all-reduce (all at the end) ms "
        "| pred/meas | predicted exposed ms | pred/meas |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for width, n, meas, alone, pl in rows:
        t, wait = pl.predicted_times, max(meas - alone, 1e-9)
        print(
            f"| {width} | {n} | {alone * 1e3:.2f} | {wait * 1e3:.2f} | {t['allreduce_total'] * 1e3:.2f} | "
            f"{_err(t['allreduce_total'], wait)} | {t['allreduce'] * 1e3:.2f} | "
            f"{_err(t['allreduce'], wait)} |"
        )
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    # for torchspan bench: the comm model's all-reduce (links.py's loopback row) over gloo's, median over
    # sizes
    for n in procs:
        ratio = statistics.median(allreduce_time(size, n, table) / measured[n][size] for size in sizes)
        print(
            f"RATIO plan_cluster/allreduce_{n}proc/predicted_vs_measured {ratio:.3f} - gloo all_reduce on "
            f"127.0.0.1, median over {len(sizes)} sizes"
        )
    for width, n, meas, _, pl in rows:
        print(
            f"RATIO plan_cluster/ddp_width{width}_{n}proc/predicted_vs_measured "
            f"{(pl.predicted_step_time or 0.0) / meas:.3f} - DDP forward+backward measured (plan: compute "
            "+ exposed all-reduce)"
        )


if __name__ == "__main__":
    main()

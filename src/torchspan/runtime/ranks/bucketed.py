"""A pipeline stage's replicas reduce through DDP's reducer, bucketed during the stage's last backward.

torch's ``DistributedDataParallel`` holds the reducer: it hooks each parameter's gradient accumulator and,
once armed, all-reduces buckets of gradients (25 MiB) as they become ready, while the backward still runs;
the reduced buckets are written back into ``.grad`` when that backward ends. A pipeline stage arms it
right before its last backward of the step (``prepare``), as ``torch.distributed.pipelining``'s stage does:
by then ``.grad`` holds every earlier micro-batch's gradient, and the hooks fire once the last one is
added. The buckets are SUMmed (a comm hook, nothing divided): the micro-batch and replica weights stay
torchspan's. The stage's forward never goes through DDP (DDP's ``no_sync`` is read at forward time,
which a 1F1B schedule interleaves with backwards). Only the first stage arms it: the reducer waits for its
all-reduces when the backward ends, which on a later stage would hold back the gradient it sends (measured
slower at the small size, benchmarks/RESULTS.md); there the flat all-reduce after the send stays.

Data-dependent models (mixture of experts): the reducer is told which parameters the last backward
reaches (``find_unused_parameters``); one reached on no replica keeps its ``.grad`` untouched by DDP,
so ``used`` (set by this module's own hooks) is summed over the replicas with the loss and ``leftover``
names the parameters to reduce after (today's flat all-reduce).

Usage (``Reduction`` does this)::

    buckets = Bucketed(params, group)      # once per stage; params: its replicated, unsharded parameters
    buckets.prepare(outputs)               # right before the stage's last backward of the step
    torch.autograd.backward(outputs, grads)   # buckets all-reduced during it, written back at its end
    flags = buckets.used                   # 1.0 per parameter reached; sum over the replicas
    rest = buckets.leftover(summed_flags)  # reduced by no bucket: reduce them as before
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["Bucketed"]


def _sum_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the bucket SUMmed over ``group`` (DDP's default divides by the group's size;
    real annotations, as DDP checks them)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class Bucketed:
    """DDP's reducer over ``params`` (a stage's replicated parameters, all on one device) in ``group``."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any) -> None:
        self.params = list(params)
        holder = nn.Module()
        holder.params = nn.ParameterList(
            self.params
        )  # the same tensors: the reducer hooks their accumulators
        self.ddp = DistributedDataParallel(
            holder,
            process_group=group,
            find_unused_parameters=True,
            init_sync=False,  # replicas already start identical (RankStage.start)
        )
        self.ddp.register_comm_hook(group, _sum_hook)
        self.used = torch.zeros(len(self.params), dtype=torch.float64)
        self._armed = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._mark(i)) for i, p in enumerate(self.params)]

    def _mark(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            if self._armed:
                self.used[i] = 1.0

        return hook

    def prepare(self, outputs: Sequence[torch.Tensor]) -> None:
        """Arm the reducer for the backward from ``outputs`` (the stage's last of the step)."""
        self.used.zero_()
        self._armed = True
        self.ddp.reducer.prepare_for_backward(list(outputs))

    def done(self) -> torch.Tensor:
        """After the armed backward: the ``used`` flags (to sum over the replicas); refuses a backward that
        reached none of the parameters (the reducer would wait for them, and the other replicas with it)."""
        self._armed = False
        if not bool(self.used.any()):
            raise RuntimeError(
                "a pipeline stage's last backward of the step reached none of its replicated parameters, "
                "so its bucketed reduction cannot start; set "
                "torchspan.runtime.ranks.stage.RankStage.bucketed = False for this model (the flat reduction)"
            )
        return self.used.clone()

    def leftover(self, summed: torch.Tensor) -> list[nn.Parameter]:
        """The parameters the last backward reached on no replica (``summed``: ``used`` summed): their
        ``.grad`` (earlier micro-batches') was left unreduced by the reducer."""
        return [p for p, n in zip(self.params, summed.tolist()) if n == 0]

    def close(self) -> None:
        """Remove this module's hooks and drop the reducer (its hooks go with it)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.ddp.reducer._remove_autograd_hooks()

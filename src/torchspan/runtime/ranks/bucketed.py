"""A pipeline stage's replicas reduce through DDP's reducer, bucketed during the stage's last backward.

torch's ``DistributedDataParallel`` holds the reducer: it hooks each parameter's gradient accumulator and,
once armed, all-reduces buckets of gradients (25 MiB) as they become ready, while the backward still runs.
A pipeline stage arms it right before its last backward of the step (``prepare``), as
``torch.distributed.pipelining``'s stage does: by then ``.grad`` holds every earlier micro-batch's
gradient, and the hooks fire once the last one is added (zero-bubble: before the last weight pass, where
they fire). The buckets are SUMmed (a comm hook, nothing divided): the micro-batch and replica weights stay
torchspan's. The stage's forward never goes through DDP (DDP's ``no_sync`` is read at forward time, which
a 1F1B schedule interleaves with backwards). Every stage arms it: the reducer's wait for its all-reduces
(and the write-back into ``.grad``) is in ``done``, after the stage has sent its input gradient upstream,
so a later stage's bucketing does not hold back the previous stage (the sentinel below). It stays flat
where a parameter's gradient is added more than once after the arming (merged weight passes), for tied
parameters (their group spans stages) and for sharded and tensor-parallel stages (``RankStage.buckets_for``).

Data-dependent models (mixture of experts): the reducer is told which parameters the last backward
reaches (``find_unused_parameters``); one reached on no replica keeps its ``.grad`` untouched by DDP,
so ``used`` (set by this module's own hooks) is summed over the replicas with the loss and ``leftover``
names the parameters to reduce after (today's flat all-reduce). A replica whose last backward reaches
none of them (or has no output needing a gradient) must still launch the same buckets as the others:
the reducer also holds a one-element ``sentinel`` parameter of its own, reached from a root made in
``prepare`` and back-propagated by ``done`` after the stage's backward. Its hook is then the first one
on such a replica (DDP marks every unreached parameter ready at the first hook: all buckets launch), and
its bucket is the last (DDP buckets the parameters in reverse), so the reducer's wait for its
all-reduces and the write-back into ``.grad`` happen in ``done``, not at the end of the stage's backward.

Usage (``Reduction`` does this)::

    buckets = Bucketed(params, group)      # once per stage; params: its replicated, unsharded parameters
    buckets.prepare(outputs)               # right before the stage's last backward of the step
    torch.autograd.backward(outputs, grads)   # buckets all-reduced during it
    flags = buckets.done()                 # the last bucket, the wait, the write-back into .grad
                                           # flags: 1.0 per parameter reached; sum over the replicas
    rest = buckets.leftover(summed_flags)  # reduced by no bucket: reduce them as before
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["Bucketed"]


class Bucketed:
    """DDP's reducer over ``params`` (a stage's replicated parameters, all on one device) in ``group``.

    ``launched``: buckets all-reduced so far (the comm hook counts them), for tests and timelines."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any) -> None:
        self.params = list(params)
        first = self.params[0]
        # a one-element parameter of its own, first (DDP buckets in reverse: its bucket is launched last)
        self.sentinel = nn.Parameter(torch.zeros(1, dtype=first.dtype, device=first.device))
        holder = nn.Module()
        holder.params = nn.ParameterList([self.sentinel, *self.params])  # the reducer hooks accumulators
        self.ddp = DistributedDataParallel(
            holder,
            process_group=group,
            find_unused_parameters=True,
            init_sync=False,  # replicas already start identical (RankStage.start)
        )
        self.launched = 0
        self.ddp.register_comm_hook(group, self._sum_hook)
        self.used = torch.zeros(len(self.params), dtype=torch.float64)
        self._armed = False
        self._root: torch.Tensor | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._mark(i)) for i, p in enumerate(self.params)]

    def _sum_hook(self, group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook: the bucket SUMmed over ``group`` (DDP's default divides by the group's size;
        real annotations, as DDP checks them)."""
        self.launched += 1
        work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def _mark(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            if self._armed:
                self.used[i] = 1.0

        return hook

    def prepare(self, outputs: Sequence[torch.Tensor]) -> None:
        """Arm the reducer for the backward from ``outputs`` (the stage's last of the step; may be empty)."""
        self.used.zero_()
        self._armed = True
        self.sentinel.grad = None
        with torch.enable_grad():
            self._root = self.sentinel.sum()
        self.ddp.reducer.prepare_for_backward([*outputs, self._root])

    def done(self) -> torch.Tensor:
        """After the armed backward: the sentinel's backward (the reducer's last bucket, its wait and the
        write-back into ``.grad``), then the ``used`` flags (to sum over the replicas)."""
        root, self._root = self._root, None
        if root is not None:
            torch.autograd.backward([root])
        self._armed = False
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
        self._root = None
        self.ddp.reducer._remove_autograd_hooks()

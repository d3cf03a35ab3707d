"""A pipeline stage's replicas reduce through DDP's reducer, bucketed during the stage's last backward.

torch's ``DistributedDataParallel`` holds the reducer: it hooks each parameter's gradient accumulator and,
once armed, all-reduces buckets of gradients (DDP's sizes: 1 MiB for the first parameters, 25 MiB after) as
they become ready, while the backward still runs. A pipeline stage arms it right before its last backward
of the step (``prepare``), as ``torch.distributed.pipelining``'s stage does: by then ``.grad`` holds every
earlier micro-batch's gradient, and the hooks fire once the last one is added (zero-bubble: before the
last weight pass, where they fire). The buckets are SUMmed (a comm hook, nothing divided): the micro-batch
and replica weights stay torchspan's. The stage's forward never goes through DDP (DDP's ``no_sync`` is read
at forward time, which a 1F1B schedule interleaves with backwards). Every stage arms it; it stays flat
where a parameter's gradient is added more than once after the arming (merged weight passes), for tied
parameters (their group spans stages) and sharded and tensor-parallel stages (``RankStage.buckets_for``).

The reducer also holds a ``sentinel`` parameter of its own (float64, first: DDP buckets in reverse, so its
bucket is launched last). ``done``, called once the stage has sent its input gradient upstream, runs one
more backward into the sentinel and into every parameter the armed backward did not reach. So:

- the reducer's wait for its all-reduces and the write-back into ``.grad`` happen in ``done``, not at the end
  of the stage's backward (which would hold back the gradient a later stage sends);
- every replica launches the same buckets, also one whose last backward reached none of the stage's
  parameters or had no output needing a gradient (data-dependent models, a mixture of experts): an
  unreached parameter is given ``-0.0`` (the exact identity of a sum: its earlier micro-batches' gradient,
  or none, goes into its bucket unchanged), so DDP needs no ``find_unused_parameters`` (no graph walk, no
  extra all-reduce of its used flags);
- the sentinel's gradient carries the step's loss and, per parameter, whether this replica has a gradient:
  summed in its bucket, they give the replicas' loss (no all-reduce of its own) and the parameters no replica
  has a gradient for, whose ``.grad`` goes back to ``None`` (as on one device: an optimizer skips them).

Usage (``Reduction`` does this)::

    buckets = Bucketed(params, group)      # once per stage; params: its replicated, unsharded parameters
    buckets.prepare(outputs)               # right before the stage's last backward of the step
    torch.autograd.backward(outputs, grads)   # buckets all-reduced during it
    total = buckets.done(loss)             # the last buckets, the wait, .grad written; the summed loss
"""

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["Bucketed"]


def _caps() -> dict[str, Any]:
    """DDP's default bucket sizes (1 MiB for the first parameters, 25 MiB after), asked for explicitly:
    without ``find_unused_parameters`` DDP starts with one bucket and re-buckets only in its own forward
    (never run here). A torch without ``bucket_cap_mb_list`` keeps the one bucket (reduced in ``done``)."""
    if "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"bucket_cap_mb_list": [1, 25]}
    return {}  # pragma: no cover - torch before the per-bucket sizes


class Bucketed:
    """DDP's reducer over ``params`` (a stage's replicated parameters, all on one device) in ``group``.

    ``launched``: buckets all-reduced so far (the comm hook counts them); ``used``: 1.0 per parameter whose
    gradient the armed backward added (by then, in a bucket)."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any) -> None:
        self.params = list(params)
        first = self.params[0]
        # a parameter of its own, first (DDP buckets in reverse: its bucket is launched last), float64: its
        # gradient carries the step's loss and, per parameter, whether this replica has a gradient
        self.sentinel = nn.Parameter(
            torch.zeros(1 + len(self.params), dtype=torch.float64, device=first.device)
        )
        holder = nn.Module()
        holder.params = nn.ParameterList([self.sentinel, *self.params])  # the reducer hooks accumulators
        self.ddp = DistributedDataParallel(
            holder,
            process_group=group,
            init_sync=False,  # replicas already start identical (RankStage.start)
            **_caps(),
        )
        self.launched = 0
        self.ddp.register_comm_hook(group, self._sum_hook)
        self.used = torch.zeros(len(self.params), dtype=torch.float64)
        self._armed = False
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
        self.ddp.reducer.prepare_for_backward(list(outputs))

    def done(self, loss: torch.Tensor) -> torch.Tensor:
        """After the armed backward: a backward into the sentinel (``loss`` and this replica's flags) and into
        every parameter the armed backward did not reach (adding ``-0.0``, which leaves any value as it is),
        so the reducer launches its last buckets, waits for them all and writes the sums into ``.grad``; a
        parameter no replica has a gradient for gets ``None`` back, not the reducer's ``-0.0``. Returns the
        loss summed over the replicas (float64, shape ``(1,)``)."""
        had = [float(p.grad is not None) for p in self.params]
        rest = [p for p, u in zip(self.params, self.used.tolist()) if not u]
        self._armed = False
        mine = torch.tensor([float(loss.detach()), *had], dtype=torch.float64, device=self.sentinel.device)
        nothing = [torch.full_like(p, -0.0) for p in rest]
        torch.autograd.backward([self.sentinel, *rest], [mine, *nothing])
        summed = self.sentinel.grad
        assert summed is not None
        self.sentinel.grad = None
        for p, n in zip(self.params, summed[1:].tolist()):
            if n == 0:
                p.grad = None
        return summed[:1]

    def close(self) -> None:
        """Remove this module's hooks and drop the reducer (its hooks go with it)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.ddp.reducer._remove_autograd_hooks()

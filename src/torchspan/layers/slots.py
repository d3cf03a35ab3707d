"""Buffers a recomputation must not change twice: BatchNorm running statistics, in-place counters.

Activation recompute runs a micro-batch's forward a second time during backward. A forward
that updates buffers in place (``BatchNorm``'s ``running_mean``/``running_var``/
``num_batches_tracked``, a registered step counter) would update them again, so after a step they
would differ from a run without recompute. ``kept`` wraps the recompute and puts every buffer of
the stage back as it was before it. (Tensor version counters cannot tell which buffers changed:
BatchNorm's kernels update the running statistics without bumping them; so all are copied.)

Usage::

    slots = buffer_slots([model.block])          # every (module, buffer name) inside block
    out = model.block(x)                          # the real forward: its updates are kept
    with kept(slots):
        out = model.block(x)                      # the recompute: its buffer updates are undone
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

__all__ = ["Slot", "buffer_slots", "kept"]

Slot = tuple[nn.Module, str]


def buffer_slots(modules: Iterable[nn.Module], own: Iterable[Slot] = ()) -> list[Slot]:
    """Every ``(owning module, buffer name)`` inside ``modules``, plus the extra slots ``own``."""
    slots: list[Slot] = []
    for top in modules:
        for mod in top.modules():
            slots.extend((mod, name) for name, b in mod._buffers.items() if b is not None)
    slots.extend(own)
    return slots


@contextlib.contextmanager
def kept(slots: Sequence[Slot]) -> Iterator[None]:
    """Run the ``with`` body (a recompute), then restore the buffers in ``slots`` to their values before it.

    A buffer the body replaced (``self.n = self.n + 1``) is put back too.
    """
    saved = [(m, n, m._buffers.get(n)) for m, n in slots]
    copies = [None if t is None else t.detach().clone() for _, _, t in saved]
    try:
        yield
    finally:
        with torch.no_grad():
            for (m, n, t), c in zip(saved, copies):
                m._buffers[n] = t
                if t is not None and c is not None:
                    t.copy_(c)

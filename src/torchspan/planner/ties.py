"""What a tied parameter split across stages costs, as the runtime pays it. Pure data.

A tie (``layers.ties``: one ``nn.Parameter`` held by several layers, GPT-2's ``wte`` / ``lm_head``) is
described to the cost models by ``TieCost``: the profile indices of the layers holding it (the first
is its *home*) and its bytes. A tie whose layers all sit on one stage (one physical device) costs
nothing; a split one costs, per the runtime:

* **One process** (``runtime.ties.TiedCopies``): the parameter lives on its home layer's device; every
  other holder on another physical device ``p`` reads ``param.to(p)`` for the duration of each of its
  forward calls, i.e. once per micro-batch (and once more when it is recomputed), and the copy's
  backward sends the gradient back into the home parameter's ``.grad``. Both transfers run inside
  that holder's stage, on its worker, so they are charged to that stage (``copy_times``):
  ``nbytes / bw(home, p)`` added to its forward (recompute included, as for its compute) and the
  same again to its backward, ``bw`` the cost model's device-to-device link (``link_bandwidth``).
  They then count in the stage's latency (the bubble) and its device's busy time (the bottleneck)
  like any compute; the home stage pays nothing.
* **Across ranks** (``runtime.ranks.stage.RankStage``): every rank holding a stage with the tie keeps
  its own copy; once per step, after the rank's last backward, its gradient is all-reduced (ring, one
  flat buffer) in the tie's own group: the ranks of those stages in every replica. Its bytes leave
  the home stage's own all-reduce (``cluster.stage_reductions``); see ``cluster`` for when it ends.

Usage::

    ties = [TieCost("embed.weight", (0, 5), 8192)]
    # per stage: (forward copy s, backward copy s) per micro-batch
    copy_times(ties, stages, names, bandwidth)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .physical import INF
from .stages import Stage

__all__ = ["TieCost", "copy_times", "split_stages", "tie_entry"]


@dataclass(frozen=True)
class TieCost:
    """A tied parameter as the cost models see it.

    ``layers``: the profile indices of the layers holding it, in execution order (``layers[0]``: the
    layer whose device keeps the one ``nn.Parameter``); ``nbytes``: its size.
    """

    name: str
    layers: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        if len(self.layers) < 2 or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(
                f"TieCost({self.name!r}).layers={self.layers!r} must be 2 or more increasing layer indices"
            )
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"TieCost({self.name!r}).nbytes={self.nbytes!r} must be an int >= 0")

    @property
    def span(self) -> tuple[int, int]:
        """Boundaries that split it: a stage boundary ``j`` with ``first < j <= last`` separates two
        holders."""
        return self.layers[0] + 1, self.layers[-1]


def stage_index(stages: Sequence[Stage], layer: int) -> int:
    return next(s for s, st in enumerate(stages) if st.start <= layer < st.end)


def split_stages(tie: TieCost, stages: Sequence[Stage]) -> list[int]:
    """The stages holding ``tie``, sorted (more than one: split)."""
    return sorted({stage_index(stages, k) for k in tie.layers})


def copy_times(
    ties: Sequence[TieCost],
    stages: Sequence[Stage],
    names: Sequence[str],
    bandwidth: Callable[[int, int], float],
) -> list[tuple[float, float]]:
    """Per stage, ``(forward, backward)`` seconds of tied-parameter copies per micro-batch (one process).

    ``names[d]``: the physical device of list entry ``d`` (holders on one physical device copy
    nothing); ``bandwidth(a, b)``: bytes/s between entries ``a`` and ``b`` (``INF``: free). Each holder
    layer on another physical device than the home layer copies the parameter in (forward) and its
    gradient back (backward).
    """
    out = [[0.0, 0.0] for _ in stages]
    for tie in ties:
        home = stages[stage_index(stages, tie.layers[0])].device
        for k in tie.layers[1:]:
            s = stage_index(stages, k)
            dev = stages[s].device
            if names[dev] == names[home]:
                continue
            bw = bandwidth(home, dev)
            seconds = 0.0 if bw == INF else tie.nbytes / bw
            out[s][0] += seconds
            out[s][1] += seconds
    return [(f, b) for f, b in out]


def tie_entry(tie: TieCost, layer_names: Sequence[str], stages: Sequence[Stage]) -> dict[str, object]:
    """``Plan.ties``' record of ``tie`` under ``stages`` (``layers`` by name, ``stages``, ``bytes``)."""
    return {
        "name": tie.name,
        "layers": [layer_names[k] for k in tie.layers],
        "stages": split_stages(tie, stages),
        "bytes": tie.nbytes,
    }

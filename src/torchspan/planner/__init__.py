"""Planner: place a model's layers on devices under memory budgets (``torchspan.plan``).

Pure data over a ``profiler.costs.Profile`` (only ``api.plan`` measures). Modules, low to high:
``plans`` (``Plan`` JSON), ``stages`` (a placement and its verdict), ``physical`` (entries that are
one device; budgets, links), ``ties`` (what a split tied parameter costs), ``cost`` (``CostModel``:
step time and memory), ``settings`` (the
settings grid), ``solver`` (the exact dynamic programme), ``explain`` (why nothing fits:
``PlanError``'s text), ``stable`` (measured predictions within noise are ties, broken the same way every
run; ``Plan.runner_up``), ``optimize`` (``search``), ``baselines``, ``spread`` (one stage per
device), ``measured`` (predicted vs measured), ``comm`` (all-reduce and point-to-point times over
``hardware.links``), ``topology`` (``Cluster``: nodes you describe), ``sharded`` and ``strategies`` (FSDP2,
offload, the comparison), ``tensorparallel`` (tensor parallel x sharded) and ``cluster`` (plans on it),
``api`` (``plan``).

Usage::

    plan = torchspan.plan(model, x, devices="cuda:0,cpu")      # profile + search
    plan = search(profile)                                      # search only (pure data)
"""

from .api import plan  # bound last: the function, not the ``plan`` submodule
from .errors import PlanError
from .optimize import search
from .plans import RECOMPUTE_MODES, SCHEDULES, Plan, StagePlan

__all__ = ["plan", "search", "Plan", "StagePlan", "PlanError", "SCHEDULES", "RECOMPUTE_MODES"]

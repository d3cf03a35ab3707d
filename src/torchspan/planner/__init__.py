"""Planner: place a model's layers on devices under memory budgets (``torchspan.plan``).

Usage::

    plan = torchspan.plan(model, x, devices="cuda:0,cpu")      # profile + search
    plan = search(profile)                                      # search only (pure data)
"""

from .plans import CHECKPOINTS, SCHEDULES, Plan, StagePlan
from .errors import PlanError
from .optimize import search
from .api import plan  # bound last: the function, not the ``plan`` submodule

__all__ = ["plan", "search", "Plan", "StagePlan", "PlanError", "SCHEDULES", "CHECKPOINTS"]

"""Planner: place a model's layers on devices under memory budgets (``torchspan.plan``)."""

from .plan import CHECKPOINTS, SCHEDULES, Plan, StagePlan

__all__ = ["Plan", "StagePlan", "SCHEDULES", "CHECKPOINTS"]

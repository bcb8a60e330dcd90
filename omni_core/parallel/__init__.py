"""Parallel layouts: the shared plan object (and, as they land, the parallelize functions that apply it)."""

from omni_core.parallel.plan import ModelShape, ParallelPlan, PlanError

__all__ = ["ModelShape", "ParallelPlan", "PlanError"]

"""Planning: compare strategies, search layouts that fit, inverse solves, GPU tiers.

Sits above the estimator (imports go one way): it builds many specs, calls the pure core
`estimate_model` with one resolved ModelDesc, and ranks by a stated step-time model.
"""
from vramplan.plan.compare import CompareRow, Strategy, compare, default_strategies
from vramplan.plan.evaluate import Evaluator, apply_changes
from vramplan.plan.fit import FitReport, FitResult, fit
from vramplan.plan.solve import fewest_gpus, largest_value, maximize
from vramplan.plan.steptime import DEFAULT_MFU, StepTime, step_time
from vramplan.plan.suggest import Suggestion, suggestions
from vramplan.plan.tiers import gpu_tiers, tiers_summary

__all__ = ["CompareRow", "DEFAULT_MFU", "Evaluator", "FitReport", "FitResult", "StepTime",
           "Strategy", "Suggestion", "apply_changes", "compare", "default_strategies",
           "fewest_gpus", "fit", "gpu_tiers", "largest_value", "maximize", "step_time",
           "suggestions", "tiers_summary"]

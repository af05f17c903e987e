"""Evaluation: full-task runs on held-out tasks, local pivot accuracy, reports."""

from __future__ import annotations

from pivotrl.evaluation.full_task import evaluate_full_tasks
from pivotrl.evaluation.local import evaluate_local
from pivotrl.evaluation.report import build_report

__all__ = ["build_report", "evaluate_full_tasks", "evaluate_local"]

"""Evaluation: full-task runs on held-out tasks, local pivot accuracy, reports."""

"""Experiment tracking: a small tracker interface (``base``), backends ``none`` and ``mlflow``, and what
a pipeline run records (``record``). Importing this package imports no tracker library."""

from pivotrl.tracking.base import TRACKERS, Tracker
from pivotrl.tracking.record import STAGES, RunRecorder, flatten_params, make_tracker, verifier_code_hash

__all__ = ["TRACKERS", "Tracker", "RunRecorder", "STAGES", "flatten_params", "make_tracker", "verifier_code_hash"]

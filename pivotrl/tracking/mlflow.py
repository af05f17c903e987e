"""``tracking.backend: mlflow``: runs recorded through MLflow's client (``MlflowClient``).

Where: ``tracking.uri`` when set (a tracking server, ``http://host:5000``, or any store URI MLflow
accepts); otherwise a local SQLite store under the run root, ``<run root>/mlflow/mlflow.db``, with
artifacts in ``<run root>/mlflow/artifacts`` (browse it with
``mlflow ui --backend-store-uri sqlite:///<run root>/mlflow/mlflow.db``). A run root on object
storage has no local store: set ``tracking.uri``.

Every call is bounded: unless the environment says otherwise, MLflow's HTTP client gets a 5-s timeout
and one retry after 1 s (``MLFLOW_HTTP_REQUEST_TIMEOUT``, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``; its own defaults are 120 s and 7 retries with exponential
backoff, minutes per call while a server is down). Training steps are sent off the training thread
(:mod:`pivotrl.tracking.live`).

Credentials never come from the config: MLflow's client reads them from the environment
(``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` or ``MLFLOW_TRACKING_TOKEN``; for artifacts
on S3, the usual ``AWS_*`` variables). ``mlflow`` is imported only when this backend is built.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator, Mapping, Sequence

from pivotrl.core.errors import TrackingError
from pivotrl.tracking.base import TRACKERS, MetricPoint

#: Our budget for one MLflow HTTP call (environment variables of MLflow's client; a value already in
#: the environment wins): a 5-s timeout, one retry, 1-s backoff.
HTTP_BUDGET = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}

#: MLflow's limits per ``log_batch`` call and per value (MLflow REST API).
_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
_MAX_PARAM_CHARS, _MAX_TAG_CHARS = 6000, 8000


def _chunks(items: list[Any], n: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class MlflowTracker:
    """A :class:`~pivotrl.tracking.base.Tracker` over ``mlflow.tracking.MlflowClient``.

    ``uri``: the tracking URI; ``artifact_root``: where new experiments keep their artifacts
    (None = the server decides). Raises TrackingError when mlflow is not installed.
    """

    def __init__(self, uri: str, artifact_root: str | None = None) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise TrackingError(
                f"tracking.backend=mlflow needs the mlflow client ({e}); install it with "
                "`pip install -e '.[tracking]' -c infra/constraints-cpu.txt`") from None
        for name, value in HTTP_BUDGET.items():  # read by MLflow's client at every request
            os.environ.setdefault(name, value)
        self.uri = uri
        self.artifact_root = artifact_root
        self._client = MlflowClient(tracking_uri=uri)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # MLflow raises MlflowException, requests and sqlalchemy errors
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TrackingError(f"MLflow at {self.uri}: {what} failed ({type(e).__name__}: {msg})") from e

    def _experiment_id(self, name: str) -> str:
        exp = self._call(f"looking up experiment {name!r}", self._client.get_experiment_by_name, name)
        if exp is not None:
            return str(exp.experiment_id)
        location = f"{self.artifact_root.rstrip('/')}/{name}" if self.artifact_root else None
        try:
            return str(self._client.create_experiment(name, artifact_location=location))
        except Exception:  # created meanwhile by a concurrent run: look it up again
            exp = self._call(f"creating experiment {name!r}", self._client.get_experiment_by_name, name)
            if exp is None:
                raise TrackingError(f"MLflow at {self.uri}: cannot create experiment {name!r}") from None
            return str(exp.experiment_id)

    def start_run(self, experiment: str, name: str, tags: Mapping[str, str]) -> str:
        exp_id = self._experiment_id(experiment)
        run = self._call("creating a run", self._client.create_run, exp_id, run_name=name,
                         tags={k: str(v)[:_MAX_TAG_CHARS] for k, v in tags.items()})
        return str(run.info.run_id)

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:_MAX_PARAM_CHARS]) for k, v in params.items()]
        for chunk in _chunks(items, _MAX_PARAMS):
            self._call("logging params", self._client.log_batch, run_id, params=chunk)

    def log_metrics(self, run_id: str, points: Sequence[MetricPoint]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(step)) for k, v, step in points]
        for chunk in _chunks(items, _MAX_METRICS):
            self._call("logging metrics", self._client.log_batch, run_id, metrics=chunk)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:_MAX_TAG_CHARS]) for k, v in tags.items()]
        for chunk in _chunks(items, _MAX_TAGS):
            self._call("setting tags", self._client.log_batch, run_id, tags=chunk)

    def log_artifact(self, run_id: str, local_path: str, artifact_dir: str | None = None) -> None:
        self._call(f"uploading {os.path.basename(local_path)}", self._client.log_artifact, run_id, local_path,
                   artifact_dir)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self._call("ending the run", self._client.set_terminated, run_id, status)


def local_store(root: str) -> tuple[str, str]:
    """(tracking URI, artifact root) of the local store under a local run root ``root``."""
    base = os.path.join(os.path.abspath(os.path.expanduser(root)), "mlflow")
    os.makedirs(base, exist_ok=True)
    return f"sqlite:///{os.path.join(base, 'mlflow.db')}", os.path.join(base, "artifacts")


@TRACKERS.register("mlflow")
def _build(section: Any, local_root: str | None) -> MlflowTracker:
    if section.uri:
        return MlflowTracker(section.uri)
    if local_root is None:
        raise TrackingError("tracking.backend=mlflow with a run root on object storage needs tracking.uri "
                            "(a tracking server, e.g. http://mlflow.internal:5000)")
    uri, artifacts = local_store(local_root)
    return MlflowTracker(uri, artifacts)

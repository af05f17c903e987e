"""Prefect tasks: thin wrappers adding cache keys, retries and artifacts around pivotrl calls.

Importing the package tells the storage layer how to find the Prefect flow and task run a manifest
is written from (:func:`pivotrl.storage.manifest.register_run_id_provider`), so the core never
imports Prefect.
"""

from __future__ import annotations

from pivotrl.storage.manifest import register_run_id_provider


def _prefect_run_ids() -> dict[str, str | None] | None:
    """The ids of the Prefect flow run and task run of the calling code; None outside a run."""
    from prefect.runtime import flow_run, task_run  # the orchestrator, imported once a run asks

    flow_id, task_id = flow_run.id, task_run.id
    if flow_id is None and task_id is None:
        return None
    return {"flow_run_id": str(flow_id) if flow_id is not None else None,
            "task_run_id": str(task_id) if task_id is not None else None}


register_run_id_provider(_prefect_run_ids)

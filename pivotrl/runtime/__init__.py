"""The machine a run executes on: models, precision, sizing, CPUs, costs and injected faults.

* :mod:`~pivotrl.runtime.models`, :mod:`~pivotrl.runtime.model_pins` — a model source → a local checkpoint;
* :mod:`~pivotrl.runtime.precision` — the compute dtype chosen by the hardware (``model.dtype: auto``);
* :mod:`~pivotrl.runtime.sizing` — a run sized to the machine from a short calibration;
* :mod:`~pivotrl.runtime.mfu` — model FLOPs and MFU against the calibrated peak;
* :mod:`~pivotrl.runtime.cpu_claims` — machine-wide CPU claims of engines and ranks;
* :mod:`~pivotrl.runtime.ledger` — the cost ledger of a run;
* :mod:`~pivotrl.runtime.faults` — seeded fault injection for reliability tests;
* :mod:`~pivotrl.runtime.ray_local` — a real local Ray cluster for tests and benchmarks.
"""

"""The bottom layer: what every other package may import, and which imports nothing of pivotrl.

* :mod:`~pivotrl.core.errors` — the exception tree (catch the narrowest class you can act on);
* :mod:`~pivotrl.core.hashing` — canonical JSON and content hashes (stage keys, manifests, configs);
* :mod:`~pivotrl.core.registry` — name → implementation registries for every choice a config string makes;
* :mod:`~pivotrl.core.retry` — the one retry mechanism (tenacity): which failures are transient, how often;
* :mod:`~pivotrl.core.progress` — progress lines with an ETA for stages whose output goes to a log.
"""

"""Pipeline stages: each stage reads its inputs from the artifact store, computes, and writes its
outputs back with a manifest. Stages take the validated RunConfig and an ArtifactStore and never
import Prefect; ``pivotrl.tasks`` wraps them (caching, retries, artifacts) and ``pivotrl.flows``
orders them.

Artifact keys are content-addressed: ``<stage>/<hash of inputs + config section>/...``, so an
unchanged input maps to the same key (and is reused) and a changed one never does.
"""

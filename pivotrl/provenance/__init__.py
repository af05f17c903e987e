"""Where an artifact came from and what decided it.

* :mod:`~pivotrl.provenance.lineage` — the provenance tree of an artifact (from the manifests);
* :mod:`~pivotrl.provenance.fingerprints` — short hashes of what decides a reward and what the model sees;
* :mod:`~pivotrl.provenance.code_digest` — digests of the code that decides a stage's output (stage keys);
* :mod:`~pivotrl.provenance.rollouts` — every sampled action of probing, training and evaluation.
"""

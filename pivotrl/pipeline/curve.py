"""The train stage's held-out learning curve (``training.eval_every``): greedy accuracy on a fixed
seeded choice of ``training.eval_states`` held-out states, measured by the training rollout engine
(which serves the current policy after every refresh) before the first step, every N steps and after
the last (:class:`pivotrl.training.loop.LoopHooks` ``evaluate``). The states come from the held-out
split of the demonstrations the pivot set was probed from (named in the pivot set's manifest), never
from the pivot set; the verifier is the training verifier. Plotted by
:mod:`pivotrl.evaluation.learning_curve`. The end-to-end RL baseline measures the same curve with
the same hook on its own engine (:func:`pivotrl.pipeline.compare.stage_e2e_baseline`).

Where the held-out split has stop decisions (BFCL's closing "Done." after a multi-turn user turn:
the right action is to answer without a tool call), the same pass also measures a seeded choice of
``training.eval_states`` of them, apart (``heldout_stop_*``): they are pivots only with ``quality.include_stop_decisions``, so this is how
a run sees, step by step, whether training on call states teaches the policy to keep calling where
it should stop.

Each point carries the rollout turns sampled to it (:func:`probe_turns` for the probe's share,
:func:`pivotrl.evaluation.learning_curve.with_rollout_turns` for the steps').
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from pivotrl.config import RunConfig
from pivotrl.pipeline.common import prompt_kwargs
from pivotrl.pipeline.results import ProbeResult
from pivotrl.storage import ArtifactStore

log = logging.getLogger("pivotrl.pipeline")

__all__ = ["curve_states", "heldout_curve_hook", "pivot_candidates_key", "probe_row_turns", "probe_turns"]


def probe_row_turns(rec: dict[str, Any]) -> int:
    """The rollout turns of one probed state (a row of ``probes.parquet``): its m sampled actions,
    one model call each (the length of its ``rewards``, the m verdicts; 0 for a state skipped)."""
    import json

    return len(json.loads(rec.get("rewards") or "[]"))


def probe_turns(store: ArtifactStore, probes_key: str) -> int:
    """The rollout turns of the probe: Σ over probed states of m (:func:`probe_row_turns`) in
    ``<probes_key>/probes.parquet``."""
    return sum(probe_row_turns(r) for r in store.read_parquet(f"{probes_key}/probes.parquet").to_dict("records"))


def pivot_candidates_key(store: ArtifactStore, probe: ProbeResult) -> str | None:
    """The store key (``demos/<key>/candidates.parquet``) of the candidates table ``probe``'s pivot
    set was probed from, as its manifest names it (``inputs.candidates``, a URL); in a store copied
    or moved since, the same content-addressed key (the URL's last three parts). None when the
    manifest names none or that key is not in this store."""
    uri = (store.read_manifest(f"{probe.pivots_key}/pivots.parquet").inputs.get("candidates") or {}).get("uri", "")
    root = store.url("x")[:-1]
    key = uri[len(root):] if uri.startswith(root) else "/".join(uri.split("/")[-3:])
    return key if uri and store.exists(key) else None


def curve_states(cfg: RunConfig, store: ArtifactStore, probe: ProbeResult, demos_key: str | None = None,
                 kinds: tuple[str, ...] = ("call", "text_rule")) -> list[Any]:
    """The held-out turn states of the curve: ``training.eval_states`` states of ``kinds`` (candidate
    kinds, :func:`pivotrl.data.text_rules.candidate_kind`) of the held-out split (seeded by
    ``run.seed``), from the demonstrations named in the pivot set's manifest
    (:func:`pivot_candidates_key`), or from ``demos_key``'s when given (the demonstrations the pivot
    set was probed from, as a stage that has them passes them). [] when neither names any, or the
    split has no state of ``kinds``."""
    from pivotrl.data.states import frame_to_states
    from pivotrl.pipeline.demos import read_histories
    from pivotrl.pipeline.probe import select_candidates

    if demos_key is None:
        key = pivot_candidates_key(store, probe)
        if key is None:
            return []
        demos_key = key.rsplit("/", 1)[0]
    else:
        key = f"{demos_key}/candidates.parquet"
    cand = store.read_parquet(key)
    chosen = select_candidates(cand, "heldout", cfg.training.eval_states, cfg.run.seed, kinds=kinds)
    if not len(chosen):
        return []
    return frame_to_states(chosen, read_histories(store, demos_key, chosen["trajectory_id"]))


def heldout_curve_hook(cfg: RunConfig, store: ArtifactStore, probe: ProbeResult, tokenizer: Any, engine: Any,
                       verifier: Any, demos_key: str | None = None) -> Callable[[int], dict[str, float]] | None:
    """``evaluate(step) -> {heldout_n, heldout_accepted, heldout_accuracy, heldout_tokens,
    heldout_gen_*}`` on the engine (greedy, ``rollout.max_tokens``; no accuracy when no state could
    be evaluated), plus ``heldout_stop_n``, ``heldout_stop_accepted`` and ``heldout_stop_accuracy``
    for the held-out stop decisions when the split has any (one engine pass for both; the
    ``heldout_gen_*`` counters are that pass's). None when ``training.eval_every`` is 0 or there are
    no held-out states (logged). ``demos_key``: as for :func:`curve_states`."""
    from pivotrl.evaluation.local import evaluate_local_groups
    from pivotrl.rollout.base import SamplingConfig

    if not cfg.training.eval_every or engine is None:
        return None
    states = curve_states(cfg, store, probe, demos_key)
    if not states:
        log.warning("training.eval_every = %d, but the demonstrations have no held-out state: no learning curve",
                    cfg.training.eval_every)
        return None
    stops = curve_states(cfg, store, probe, demos_key, kinds=("stop",))
    sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=cfg.rollout.max_tokens, seed=cfg.run.seed)
    jobs = [(states, sampling)] + ([(stops, sampling)] if stops else [])

    def evaluate(step: int) -> dict[str, float]:
        done = evaluate_local_groups(engine, tokenizer, jobs, verifier, max_context=cfg.model.max_context,
                                     label=f"held-out curve after step {step}", cache_dir=str(cfg.run.local_cache()),
                                     **prompt_kwargs(cfg))
        summary = done[0][1]
        n, k = int(summary.get("n_samples") or 0), int(summary.get("n_accepted") or 0)
        out = {"heldout_n": float(n), "heldout_accepted": float(k),
               "heldout_tokens": float(summary.get("tokens_generated") or 0)}
        # The curve's generation (pivotrl.runtime.generation): heldout_gen_tokens, heldout_gen_mfu, ...
        out.update({f"heldout_{k}": float(v) for k, v in summary.items() if k.startswith("gen_")})
        if n:  # no NaN for the trackers: a step where nothing could be evaluated has no accuracy
            out["heldout_accuracy"] = k / n
        said = f"held-out accuracy after step {step}: {k}/{n}"
        if stops:
            stop = done[1][1]
            sn, sk = int(stop.get("n_samples") or 0), int(stop.get("n_accepted") or 0)
            out.update(heldout_stop_n=float(sn), heldout_stop_accepted=float(sk))
            if sn:
                out["heldout_stop_accuracy"] = sk / sn
            said += f"; stop decisions {sk}/{sn}"
        log.info(said)
        return out

    return evaluate

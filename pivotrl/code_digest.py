"""Content digests of the code that decides a stage's output, for the stages' content keys.

A stage key must change when the code that determines the stage's artifact changes — a verifier,
the action parser, the prompt renderer, an environment, the sampling code — or a rerun would find
the old artifact under the unchanged key and reuse, say, stale rewards. The git commit is not
enough (an edited, uncommitted verifier has the same commit) and the whole package is too much
(editing the report would re-run probing). So each stage names the modules it depends on in
:data:`STAGE_CODE`, and :func:`stage_code_digest` hashes their source bytes.

Source files are located with ``importlib.util.find_spec`` and read, never imported: the digest of
a stage that uses vLLM can be computed where vLLM is not installed. Pure core: standard library only.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

from pivotrl.errors import ConfigError

_CORE = ("pivotrl.data", "pivotrl.actions", "pivotrl.action_prefix", "pivotrl.prompts", "pivotrl.tool_render")
#: The environment glue: tool execution (pool and worker side, pivotrl.envs) and the retry function
#: that decides how often a failed tool request is tried again before the verifier gives up.
_ENVS = ("pivotrl.envs", "pivotrl.storage.retry")

#: Modules (a package means every ``.py`` file under it) whose code decides each stage's artifact.
STAGE_CODE: dict[str, tuple[str, ...]] = {
    "demonstrations": ("pivotrl.data", *_ENVS, "pivotrl.pipeline.demos"),
    # The warm start only: an edit to the train or evaluate stage never re-runs it.
    "reference": _CORE + ("pivotrl.models", "pivotrl.training.sft", "pivotrl.training.logprobs", "pivotrl.training.mfu",
                          "pivotrl.training.settings", "pivotrl.model_pins", "pivotrl.pipeline.reference"),
    "probe": _CORE + _ENVS + ("pivotrl.verifiers", "pivotrl.rollout", "pivotrl.filtering",
                              "pivotrl.pipeline.probe"),
    # pivotrl.training holds the loop (training.loop), its checkpoints and the trainer.
    # The training package without the baselines of ``pivotrl compare`` (sft, e2e): editing a
    # baseline must not re-train PivotRL.
    "train": _CORE + _ENVS + ("pivotrl.verifiers", "pivotrl.rollout", "pivotrl.objective",
                              *(f"pivotrl.training.{m}" for m in ("checkpoints", "deepspeed_utils", "groups",
                                                                  "launch", "logprobs", "loop", "mfu", "offline",
                                                                  "rank_engines", "pivotrl", "rl_stage", "settings",
                                                                  "trainer_state", "weight_sync")),
                              "pivotrl.pipeline.train"),
    # The drift re-probe and the held-out state selection run pivotrl.pipeline.probe's code.
    "evaluate": _CORE + _ENVS + ("pivotrl.verifiers", "pivotrl.rollout", "pivotrl.evaluation",
                                 "pivotrl.pipeline.probe", "pivotrl.pipeline.evaluate", "pivotrl.pipeline.eval_shards"),
}


def _source_files(module: str) -> list[Path]:
    """The ``.py`` files of ``module`` (all of them, recursively, for a package), sorted."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ConfigError(f"code digest: module {module!r} not found")
    if spec.submodule_search_locations:
        return sorted(p for loc in spec.submodule_search_locations for p in Path(loc).rglob("*.py"))
    return [Path(spec.origin)]


@functools.lru_cache(maxsize=None)
def code_digest(modules: tuple[str, ...]) -> str:
    """sha256 (hex) over the relative path and bytes of every source file of ``modules``.

    Computed once per process per module set. Raises ConfigError for an unknown module.
    """
    h = hashlib.sha256()
    files = sorted({f.resolve() for m in modules for f in _source_files(m)})
    top = Path(importlib.util.find_spec("pivotrl").origin).resolve().parent.parent  # type: ignore[arg-type]
    for f in files:
        rel = f.relative_to(top) if f.is_relative_to(top) else f
        h.update(str(rel).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def stage_code_digest(stage: str) -> str:
    """:func:`code_digest` of the modules :data:`STAGE_CODE` lists for ``stage``.

    Raises ConfigError naming the valid stages for an unknown one.
    """
    try:
        modules = STAGE_CODE[stage]
    except KeyError:
        raise ConfigError(f"code digest: unknown stage {stage!r}; valid: {', '.join(STAGE_CODE)}") from None
    return code_digest(modules)

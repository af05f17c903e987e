"""The ``execution`` verifier: functional equivalence in BFCL's simulated tools (PivotRL §3.2).

An action is accepted iff executing its calls from the turn state's environment state gives

- the same environment snapshot as executing the demonstration's calls (every involved simulator's
  public attributes plus the file system's current directory; ``BFCLEnvironment.snapshot``), and
- the same tool outputs, compared as a multiset (the order of independent calls may differ; an
  extra or missing call changes the multiset, so it is rejected).

So ``cd(folder='document/')`` is accepted where the demonstration has ``cd(folder='document')``
(the simulator strips the trailing slash: same directory, same output), while a call that differs
only in its visible output (``ls(a=True)`` vs ``ls()`` in a directory with hidden files) is not.
An accepted action whose call list is the demonstration's has reason ``"match"``; one whose call
list differs (another spelling, order or set of calls with the same effect) has reason
``"equivalent"`` (:data:`~pivotrl.verifiers.base.NOT_DEMONSTRATED`), so the actions rewarded only
because execution is compared can be counted (probe table, training metrics, report).

Execution happens in a :class:`~pivotrl.envs.sandbox.SandboxPool` worker, never in the caller's
process. All m actions of one state go in ONE request: the worker rebuilds the state once by
replaying ``verifier_context["prior_calls"]`` on a fresh environment (``replay``), then runs the
demonstration and each distinct candidate on its own deep copy. A failed request (timeout, crash,
memory) is retried (``retries``, exponential ``backoff_s``); if it still fails the verifier raises
VerifierError, never a reward of 0. A text demonstration is judged by its text rule, as everywhere
(:mod:`pivotrl.data.text_rules`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from pivotrl.data.schema import ToolCall, TurnState
from pivotrl.core.hashing import canonical_json
from pivotrl.envs.sandbox import SandboxError, SandboxPool
from pivotrl.core.errors import DataError, ToolExecutionError, VerifierError
from pivotrl.runtime.faults import FaultInjector
from pivotrl.core.retry import RetryStats, call_with_retries
from pivotrl.verifiers.base import NOT_DEMONSTRATED, VERIFIERS, VerifierResult, demo_calls, kind_check, parse_actions

__all__ = ["ExecutionVerifier", "execute_candidates"]

SANDBOX_FUNCTION = "bfcl.execute_candidates"


class _NoRetry(Exception):
    """A sandbox failure that retrying cannot fix (the worker function itself raised)."""


def _default_cache_dir() -> Path:
    return Path(os.environ.get("PIVOTRL_CACHE_DIR") or Path.home() / ".cache" / "pivotrl")


@VERIFIERS.register("execution")
class ExecutionVerifier:
    """Functional-equivalence verifier for states with ``verifier_context["env"]`` (kind "bfcl").

    Args:
        pool: a SandboxPool whose workers know ``bfcl_root``; if None, the verifier starts its own
            (``num_workers``, ``timeout_s``, ``memory_mb``) on first use and closes it in :meth:`close`.
        bfcl_root: directory containing ``bfcl_eval/`` for an own pool; default
            ``ensure_bfcl(cache_dir)`` (cache_dir default: ``$PIVOTRL_CACHE_DIR`` or ``~/.cache/pivotrl``).
        retries: retries of a failed sandbox request (``call_with_retries``).
        backoff_s: the wait before retry k is backoff_s · 2^k ...
        max_backoff_s: ... and at most max_backoff_s.
        faults: a :class:`~pivotrl.runtime.faults.FaultInjector` for an own pool (fault injection; None = off).

    ``stats`` (RetryStats) counts sandbox requests, retries and final failures.
    Reasons: "match", "text", "parse_error", "wrong_kind", "unknown_tool", "different_state",
    "different_output", "different_state_and_output".
    """

    def __init__(
        self,
        pool: SandboxPool | None = None,
        *,
        bfcl_root: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        num_workers: int = 1,
        timeout_s: float = 30.0,
        memory_mb: int = 1024,
        retries: int = 2,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        faults: FaultInjector | None = None,
    ) -> None:
        self._pool = pool
        self._own_pool = pool is None
        self._pool_opts = dict(num_workers=num_workers, timeout_s=timeout_s, memory_mb=memory_mb, faults=faults)
        self._bfcl_root = bfcl_root
        self._cache_dir = cache_dir
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stats = RetryStats()

    @property
    def pool(self) -> SandboxPool:
        if self._pool is None:
            root = self._bfcl_root
            if root is None:
                from pivotrl.bfcl.wheel import ensure_bfcl

                root = ensure_bfcl(self._cache_dir if self._cache_dir is not None else _default_cache_dir())
            self._pool = SandboxPool(bfcl_root=root, **self._pool_opts)
        return self._pool

    def score(self, state: TurnState, actions: Sequence[str]) -> list[VerifierResult]:
        """One result per action (length m or K).

        Raises DataError if the state has no ``verifier_context["env"]`` of kind "bfcl" (only when
        something must be executed) and VerifierError when the sandbox fails after its retries.
        """
        demo = demo_calls(state)
        tool_names = {t.name for t in state.tools}
        results: list[VerifierResult | None] = []
        pending: dict[str, list[int]] = {}  # canonical calls → indices of actions with those calls
        candidates: list[list[dict[str, Any]]] = []
        for i, parsed in enumerate(parse_actions(state, actions, getattr(self, "tool_parser", None))):
            verdict = kind_check(demo, parsed, state)
            if verdict is None and any(c.name not in tool_names for c in parsed.calls):
                verdict = VerifierResult.reject("unknown_tool")
            results.append(verdict)
            if verdict is None:
                calls = [ToolCall(c.name, dict(c.arguments)).to_dict() for c in parsed.calls]
                key = canonical_json(calls)
                if key not in pending:
                    pending[key] = []
                    candidates.append(calls)
                pending[key].append(i)
        if candidates:
            verdicts = self._execute(state, demo, candidates)
            demo_key = canonical_json([ToolCall(c.name, dict(c.arguments)).to_dict() for c in demo])
            for key, verdict in zip(pending, verdicts):
                if verdict.accepted and key != demo_key:  # same effect, another call list
                    verdict = VerifierResult.accept(NOT_DEMONSTRATED)
                for i in pending[key]:
                    results[i] = verdict
        done = [r for r in results if r is not None]
        if len(done) != len(results):  # pragma: no cover - every action gets exactly one verdict
            raise VerifierError(f"turn state {state.state_id!r}: {len(results) - len(done)} actions left unscored")
        return done

    def _execute(
        self, state: TurnState, demo: Sequence[ToolCall], candidates: list[list[dict[str, Any]]]
    ) -> list[VerifierResult]:
        ctx = state.verifier_context
        env = ctx.get("env")
        if not isinstance(env, Mapping) or env.get("kind") != "bfcl":
            raise DataError(
                f"turn state {state.state_id!r}: the execution verifier needs verifier_context.env of kind "
                f"'bfcl', got {None if not isinstance(env, Mapping) else env.get('kind')!r}"
            )
        prior = ctx.get("prior_calls") or []
        if not isinstance(prior, list):
            raise DataError(f"turn state {state.state_id!r}: verifier_context.prior_calls is not a list")
        payload = {
            "env": dict(env),
            "prior_calls": list(prior),
            "demo_calls": [ToolCall(c.name, dict(c.arguments)).to_dict() for c in demo],
            "candidates": candidates,
        }

        def once() -> Any:
            try:
                return self.pool.call(SANDBOX_FUNCTION, payload)
            except SandboxError as e:
                if e.reason == "error":
                    raise _NoRetry(str(e)) from e
                raise

        try:
            reply = call_with_retries(once, self.retries, self.backoff_s, retry_on=(ToolExecutionError,),
                                      stats=self.stats, max_backoff_s=self.max_backoff_s)
        except (ToolExecutionError, _NoRetry) as e:
            raise VerifierError(
                f"execution verifier could not decide turn state {state.state_id!r} "
                f"({len(candidates)} distinct actions) after {self.retries} retries: {e}"
            ) from e
        return [VerifierResult(1.0 if r["accepted"] else 0.0, bool(r["accepted"]), str(r["reason"])) for r in reply]

    def close(self) -> None:
        """Stop the verifier's own sandbox pool (a pool passed in is left to its owner)."""
        if self._own_pool and self._pool is not None:
            self._pool.close()
            self._pool = None


def execute_candidates(payload: Mapping[str, Any], settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Sandbox worker function: compare each candidate call list with the demonstration's.

    ``payload``: ``{"env": ctx, "prior_calls": [call dicts], "demo_calls": [call dicts],
    "candidates": [[call dicts], ...]}``; ``settings["bfcl_root"]``: directory with ``bfcl_eval/``.
    Replays the prior calls once, then runs the demo and every candidate on separate deep copies.
    Returns one ``{"accepted": bool, "reason": str}`` per candidate.
    """
    from pivotrl.bfcl.envs import replay

    bfcl_root = settings.get("bfcl_root")
    if not bfcl_root:
        raise DataError("execute_candidates: the sandbox pool was started without bfcl_root")
    base = replay(payload["env"], payload["prior_calls"], bfcl_root)

    def run(call_dicts: Sequence[Mapping[str, Any]]) -> tuple[list[str], dict[str, Any]]:
        env = base.copy()
        outputs = env.execute_all(ToolCall.from_dict(d, "call") for d in call_dicts)
        return outputs, env.snapshot()

    demo_outputs, demo_snapshot = run(payload["demo_calls"])
    demo_key = sorted(demo_outputs)
    out = []
    for calls in payload["candidates"]:
        outputs, snapshot = run(calls)
        same_state = snapshot == demo_snapshot
        same_output = sorted(outputs) == demo_key
        if same_state and same_output:
            reason = "match"
        elif not same_state and not same_output:
            reason = "different_state_and_output"
        else:
            reason = "different_output" if same_state else "different_state"
        out.append({"accepted": same_state and same_output, "reason": reason})
    return out

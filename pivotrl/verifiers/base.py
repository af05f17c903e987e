"""Verifier contract, registry and the ``auto`` dispatcher (PivotRL §3.2: ``R(s, a) = 1[a ∈ M(s)]``).

A verifier scores the raw model outputs (actions) sampled at one turn state: it parses them itself
with :func:`pivotrl.format.actions.parse_action`; output that does not parse is a reward of 0 with reason
``"parse_error"`` (not an error). When it cannot decide (a tool crashed or timed out after its
retries) it raises :class:`~pivotrl.core.errors.VerifierError`, never a reward of 0.

Acceptance rules are explicit (tool names, argument rules, functional equivalence), never text
similarity. A text action is rejected when the demonstration calls tools. When the demonstration's
action is text, every verifier applies the state's text rule (:mod:`pivotrl.data.text_rules`):
a stop decision accepts any action without a tool call, an answer with an explicit rule must satisfy
it, and a text turn with no rule accepts nothing (no reward for arbitrary text).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from pivotrl.format.actions import parse_action
from pivotrl.data.schema import Message, ToolCall, TurnState
from pivotrl.core.errors import ActionParseError, ConfigError, DataError
from pivotrl.core.registry import Registry
from pivotrl.format.tool_parsers import get_tool_parser

__all__ = [
    "NOT_DEMONSTRATED",
    "SHARED_OPTIONS",
    "VERIFIERS",
    "AutoVerifier",
    "ParsedAction",
    "Verifier",
    "VerifierResult",
    "count_not_demonstrated",
    "demo_calls",
    "get_verifier",
    "parse_actions",
]


@dataclass(frozen=True)
class VerifierResult:
    """The verdict on one action: ``reward`` ∈ {0.0, 1.0}, ``accepted`` = reward == 1, ``reason``
    a short machine-readable tag (e.g. ``"match"``, ``"parse_error"``, ``"wrong_tool"``)."""

    reward: float
    accepted: bool
    reason: str

    @classmethod
    def accept(cls, reason: str = "match") -> "VerifierResult":
        return cls(1.0, True, reason)

    @classmethod
    def reject(cls, reason: str) -> "VerifierResult":
        return cls(0.0, False, reason)


#: The reason of an accepted action whose call list differs from the demonstration's (the
#: ``execution`` verifier: another call list that reaches the same state and outputs).
NOT_DEMONSTRATED = "equivalent"


def count_not_demonstrated(reasons: Sequence[str]) -> int:
    """How many of these verdict reasons are accepted actions that differ from the demonstration."""
    return sum(1 for r in reasons if r == NOT_DEMONSTRATED)


@runtime_checkable
class Verifier(Protocol):
    """``score(state, actions) -> list[VerifierResult]``: one result per action (m or K of them)."""

    def score(self, state: TurnState, actions: Sequence[str]) -> list[VerifierResult]: ...


VERIFIERS: Registry[type] = Registry("verifier")

#: Options a run configuration may pass to any verifier: a verifier that has no use for one of
#: them (e.g. ``tool_name`` and ``timeout_s``) ignores it. Any other unknown option is an error.
SHARED_OPTIONS: frozenset[str] = frozenset(
    {"pool", "bfcl_root", "cache_dir", "num_workers", "timeout_s", "memory_mb", "retries", "backoff_s",
     "max_backoff_s", "faults", "tool_parser"}
)


def _accepted_options(cls: type) -> set[str] | None:
    """Keyword parameters of ``cls.__init__``; None if it takes ``**kwargs``."""
    if cls.__init__ is object.__init__:
        return set()
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.name != "self"}


def get_verifier(name: str, **opts: Any) -> Verifier:
    """Instantiate the verifier registered as ``name`` with keyword options ``opts``.

    Names: "tool_name", "arguments", "execution", "auto". Options in :data:`SHARED_OPTIONS` that
    the verifier does not use are ignored. Raises ConfigError for an unknown name (listing the
    valid ones) or any other option the verifier does not take.
    """
    cls = VERIFIERS.get(name)
    accepted = _accepted_options(cls)
    if accepted is not None:
        unknown = sorted(k for k in opts if k not in accepted and k not in SHARED_OPTIONS)
        if unknown:
            valid = ", ".join(sorted(accepted)) or "(none)"
            raise ConfigError(f"verifier {name!r}: unknown option(s) {', '.join(unknown)}; valid: {valid}")
        parser = opts.get("tool_parser")
        opts = {k: v for k, v in opts.items() if k in accepted}
        inst = cls(**opts)
        if parser is not None and "tool_parser" not in accepted:
            inst.tool_parser = get_tool_parser(parser)  # read by parse_actions
        return inst
    return cls(**opts)


@dataclass(frozen=True)
class ParsedAction:
    """An action after parsing: ``message`` is None iff it did not parse (``error`` says why)."""

    text: str
    message: Message | None
    error: str = ""

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return () if self.message is None else self.message.tool_calls

    @property
    def is_text(self) -> bool:
        return self.message is not None and not self.message.tool_calls


def parse_actions(state: TurnState, actions: Sequence[str], parser: Any = None) -> list[ParsedAction]:
    """Parse each raw action with the run's tool-call parser (``pivotrl.format.tool_parsers``; default
    pythonic) and the state's tools (positional arguments are named from them)."""
    parse = parse_action if parser is None else parser.parse
    out = []
    for text in actions:
        try:
            out.append(ParsedAction(text, parse(text, state.tools)))
        except ActionParseError as e:
            out.append(ParsedAction(text, None, str(e)))
    return out


def demo_calls(state: TurnState) -> tuple[ToolCall, ...]:
    """The demonstration's calls: ``verifier_context["demo_calls"]`` if present, else the demo
    action's tool calls (empty for a text demo action). Raises DataError for malformed dicts."""
    raw = state.verifier_context.get("demo_calls")
    if raw is None:
        return tuple(state.demo_action.tool_calls)
    if not isinstance(raw, list):
        raise DataError(f"turn state {state.state_id!r}: verifier_context.demo_calls is not a list")
    return tuple(ToolCall.from_dict(d, f"turn state {state.state_id!r}.demo_calls[{i}]") for i, d in enumerate(raw))


def kind_check(demo: Sequence[ToolCall], parsed: ParsedAction, state: TurnState | None = None) -> VerifierResult | None:
    """The verdict every verifier shares, or None if the calls must be compared.

    Unparsable → reject "parse_error"; call demo → reject a text action ("wrong_kind"); text demo →
    reject calls ("wrong_kind") and judge a text action by the state's kind
    (:func:`pivotrl.data.text_rules.candidate_kind`): "stop" → accept ("stop"); "text_rule" →
    the rule in ``verifier_context["answer_rule"]`` ("rule" / "rule_failed"); otherwise (or without
    ``state``) → reject ("no_rule").
    """
    from pivotrl.data.text_rules import candidate_kind, check_answer

    if parsed.message is None:
        return VerifierResult.reject("parse_error")
    if not demo:
        if not parsed.is_text:
            return VerifierResult.reject("wrong_kind")
        kind = "text_no_rule" if state is None else candidate_kind(state)
        if kind == "stop":
            return VerifierResult.accept("stop")
        rule = None if state is None else state.verifier_context.get("answer_rule")
        if kind == "text_rule" and isinstance(rule, dict):
            ok, reason = check_answer(rule, parsed.message.content)
            return VerifierResult(float(ok), ok, reason)
        return VerifierResult.reject("no_rule")
    if parsed.is_text:
        return VerifierResult.reject("wrong_kind")
    return None


@VERIFIERS.register("auto")
class AutoVerifier:
    """Dispatch on ``state.verifier_context["default_verifier"]`` (set by the data source).

    Options: shared ones (:data:`SHARED_OPTIONS`, e.g. ``timeout_s=30, bfcl_root=root``) go to every
    underlying verifier that takes them; options for one verifier go under its name
    (``AutoVerifier(execution={"pool": pool})``) and win over shared ones. Underlying verifiers are
    built on first use. Raises ConfigError for any other option.
    """

    def __init__(self, **opts: Any) -> None:
        names = [n for n in VERIFIERS if n != "auto"]
        self._shared: dict[str, Any] = {}
        self._per: dict[str, dict[str, Any]] = {}
        for key, value in opts.items():
            if key in SHARED_OPTIONS:
                self._shared[key] = value
            elif key in names and isinstance(value, dict):
                self._per[key] = value
            else:
                raise ConfigError(
                    f"auto verifier: option {key!r} is neither a shared option ({', '.join(sorted(SHARED_OPTIONS))}) "
                    f"nor a verifier name with a dict of options ({', '.join(names)})"
                )
        self._verifiers: dict[str, Verifier] = {}

    def verifier_for(self, state: TurnState) -> Verifier:
        name = state.verifier_context.get("default_verifier")
        if not isinstance(name, str) or name == "auto" or name not in VERIFIERS:
            raise DataError(
                f"turn state {state.state_id!r}: verifier_context.default_verifier={name!r} is not one of "
                f"{', '.join(n for n in VERIFIERS if n != 'auto')}"
            )
        if name not in self._verifiers:
            self._verifiers[name] = get_verifier(name, **{**self._shared, **self._per.get(name, {})})
        return self._verifiers[name]

    @property
    def stats(self) -> Any:
        """Retry statistics (``RetryStats``) summed over the underlying verifiers built so far."""
        from pivotrl.core.retry import RetryStats

        total = RetryStats()
        for v in self._verifiers.values():
            s = getattr(v, "stats", None)
            if s is not None:
                total.calls += s.calls
                total.retries += s.retries
                total.failures += s.failures
                total.last_errors = (total.last_errors + list(s.last_errors))[-10:]
        return total

    def score(self, state: TurnState, actions: Sequence[str]) -> list[VerifierResult]:
        """Score with the state's default verifier (see :class:`Verifier`)."""
        return self.verifier_for(state).score(state, actions)

    def close(self) -> None:
        for v in self._verifiers.values():
            close = getattr(v, "close", None)
            if close is not None:
                close()

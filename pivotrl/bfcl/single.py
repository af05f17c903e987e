"""BFCL's own AST checker as the judge of record for BFCL's single-turn categories (never re-implemented).

With ``quality.judge: bfcl`` every greedy held-out and out-of-domain state of a BFCL single-turn
category (``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``) is judged as BFCL's
``eval_runner._ast_file_runner`` judges a prompting model's answer:

* the model's raw text is decoded by BFCL's own Python decoder,
  ``bfcl_eval/model_handler/utils.py:default_decode_ast_prompting`` (strip backticks, newlines and
  spaces at both ends, add the missing ``[``/``]``, ``ast.parse``, keyword arguments only), then
  checked with ``bfcl_eval/utils.py:is_function_calling_format_output``; a failure is
  ``"ast_decoder:decoder_failed"`` / ``"ast_decoder:decoder_wrong_output_format"`` as in BFCL;
* the decoded calls are judged by ``bfcl_eval/eval_checker/ast_eval/ast_checker.py:ast_checker``
  against the record's own ``function`` list and ``possible_answer`` ground truth, read from the
  pinned wheel by record id (language Python, the record's category).

When the run's tool-call parser is not pythonic (``hermes``, ``llama3_json``) BFCL's Python decoder
cannot read the text at all; then the calls pivotrl's parser read are handed to ``ast_checker`` (as
BFCL's function-calling handlers hand it the calls their API returned), and the report says so.

Java and JavaScript (``simple_java``, ``simple_javascript``): BFCL decodes their call syntax with
tree-sitter, which pivotrl does not depend on; the calls pivotrl's parser read (values as source-text
strings, :mod:`pivotrl.bfcl.languages`) are handed to ``ast_checker`` with the category's language,
whose type converters read them. Irrelevance (``irrelevance``, ``live_irrelevance``): BFCL's
``_evaluate_single_relevance_entry``: the answer is right iff BFCL's decoder does not read a non-empty
call list from it (``"irrelevance_error:decoder_success"`` otherwise).

The decoding and the import of BFCL's code from the wheel are :mod:`pivotrl.bfcl.ast_decoder`; the
verdicts applied to a local evaluation table and their report section are
:mod:`pivotrl.bfcl.single_tables`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pivotrl.bfcl.ast_decoder import AstVerdict, bfcl_decode
from pivotrl.bfcl.data import IRRELEVANCE_CATEGORIES, SINGLE_TURN_CATEGORIES
from pivotrl.bfcl.languages import language_of, root_modules
from pivotrl.core.errors import DataError
from pivotrl.core.hashing import json_problem

__all__ = ["BFCLSingleTurnJudge"]

_MODEL_NAME = "pivotrl"


class BFCLSingleTurnJudge:
    """BFCL's ``ast_checker`` on BFCL single-turn records (module docstring).

    ``bfcl_root``: directory containing ``bfcl_eval/`` (:func:`pivotrl.bfcl.wheel.ensure_bfcl`);
    ``tool_parser``: the run's tool-call parser name (``pivotrl.format.tool_parsers``); with "pythonic"
    BFCL's decoder reads the raw text, otherwise pivotrl's parser does.
    """

    def __init__(self, bfcl_root: str | Path, tool_parser: str = "pythonic") -> None:
        self.root = Path(bfcl_root)
        self.tool_parser = tool_parser
        self._records: dict[str, dict[str, tuple[list[Any], list[Any]]]] = {}

    @property
    def decoder(self) -> str:
        """Which decoder reads the model's text (for the report)."""
        return ("BFCL's Python decoder (default_decode_ast_prompting)" if self.tool_parser == "pythonic"
                else f"pivotrl's {self.tool_parser} parser (BFCL's Python decoder cannot read {self.tool_parser} text)")

    def _category(self, category: str) -> dict[str, tuple[list[Any], list[Any]]]:
        if category not in self._records:
            data = self.root / "bfcl_eval" / "data"
            fname = f"BFCL_v4_{category}.json"
            records: dict[str, tuple[list[Any], list[Any]]] = {}
            answers: dict[str, Any] = {}
            files = [(data / fname, "record")]
            if category not in IRRELEVANCE_CATEGORIES:
                files.append((data / "possible_answer" / fname, "answer"))
            for path, into in files:
                if not path.is_file():
                    raise DataError(f"{path.name}: missing from the BFCL data (BFCL's single-turn judge)")
                with open(path, encoding="utf-8") as f:
                    for lineno, line in enumerate(f, start=1):
                        if not line.strip():
                            continue
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path.name} line {lineno}: malformed JSON ({json_problem(e)})") from None
                        if into == "answer":
                            answers[str(obj.get("id"))] = obj.get("ground_truth")
                        else:
                            records[str(obj.get("id"))] = (obj.get("function"), [])
            self._records[category] = {rid: (funcs, answers.get(rid, [])) for rid, (funcs, _) in records.items()
                                       if rid in answers or category in IRRELEVANCE_CATEGORIES}
        return self._records[category]

    def judges(self, state: Any) -> bool:
        """Whether ``state`` is the answer of a BFCL single-turn record (its category is one of
        :data:`~pivotrl.bfcl.data.SINGLE_TURN_CATEGORIES` and its trajectory id a record of it)."""
        category = getattr(state, "category", "")
        return (category in SINGLE_TURN_CATEGORIES and state.turn_index == 0
                and str(state.trajectory_id) in self._category(category))

    def judge(self, state: Any, text: str, parsed_calls: Sequence[Any] | None = None) -> AstVerdict:
        """BFCL's verdict on ``text``, the model's answer at ``state`` (``judges(state)`` must hold).

        ``parsed_calls``: pivotrl's parse of the text (ToolCalls), used only when the run's tool
        parser is not pythonic (None: the text did not parse). Raises DataError for a state that is
        not a BFCL single-turn record.
        """
        if not self.judges(state):
            raise DataError(f"turn state {state.state_id!r}: not a BFCL single-turn record; BFCL's AST judge cannot judge it")
        functions, possible = self._category(state.category)[str(state.trajectory_id)]
        if state.category in IRRELEVANCE_CATEGORIES:
            return self._no_call(text, parsed_calls)
        language = language_of(state.category)
        if language != "PYTHON":  # BFCL's Java / JavaScript decoders need tree-sitter: pivotrl's parse
            if not parsed_calls:
                return AstVerdict(False, "ast_decoder:decoder_failed", "pivotrl's parser read no call")
            decoded = [{c.name: dict(c.arguments)} for c in parsed_calls]
        elif self.tool_parser == "pythonic":
            decoded, failure = bfcl_decode(text, self.root)
            if failure is not None:
                return failure
        elif parsed_calls is None:
            return AstVerdict(False, "ast_decoder:decoder_failed", f"pivotrl's {self.tool_parser} parser read no call")
        else:
            decoded = [{c.name: dict(c.arguments)} for c in parsed_calls]
        b = root_modules(self.root)
        try:
            result = b.ast_checker(functions, decoded, possible, getattr(b.languages, language), state.category,
                                   _MODEL_NAME)
        except Exception as e:  # noqa: BLE001 - a checker crash on odd model output rejects it, as a failure
            return AstVerdict(False, "ast_checker:crashed", f"{type(e).__name__}: {e}"[:300])
        if result.get("valid"):
            return AstVerdict(True)
        errors = result.get("error") or [""]
        return AstVerdict(False, str(result.get("error_type", "ast_checker:unknown")), str(errors[0])[:300])

    def _no_call(self, text: str, parsed_calls: Sequence[Any] | None) -> AstVerdict:
        """BFCL's irrelevance verdict: right iff no non-empty call list is decoded from the answer."""
        if self.tool_parser == "pythonic":
            decoded, failure = bfcl_decode(text, self.root)
            calls = bool(decoded) and failure is None
        else:
            calls = bool(parsed_calls)
        if calls:
            return AstVerdict(False, "irrelevance_error:decoder_success",
                              "Valid syntax. Successfully decode AST when it should not.")
        return AstVerdict(True)


"""Data audit of what a gold call's free text says it is: the dialogue's own claims, replayed.

Every free-text string argument of a gold call (every string leaf with a space inside, recursing
into lists and objects; identifiers and names are the "not in the history" audit's,
:mod:`pivotrl.data.audit`) is checked against what it says it is. Strings are compared after
:func:`normalise`, BFCL's own string normalisation (``standardize_string`` of its AST checker: spaces
and ``,./-_*^`` removed, lower case, ``'`` read as ``"``), with every whitespace character read as a
space: a quote's closing period or comma, or a line break for a space, is no difference. (BFCL's
multi-turn checker compares states and outputs exactly, so a gold text that differs after this
normalisation is one that a model copying exactly what the dialogue names is scored wrong against.)
Words are the maximal runs of ASCII letters and digits, compared in lower case.

* *A copy of a tool output* (:data:`NOT_TOOL_OUTPUT_MARK`). A value of three words or more whose words
  are exactly those of an earlier tool output (the output, or a string anywhere in its JSON), as a
  multiset, claims to be that output: it must equal it after :func:`normalise`, else it is flagged
  *inconsistent with the tool output* (words reordered, quotes stripped).
* *A quote of the user* (:data:`NOT_USER_QUOTE_MARK`). The quotes of the user turns so far are the
  spans between ``'...'`` (quote marks not inside a word; ``\\'`` and a ``'`` inside a word are
  apostrophes), ``"..."``, ``“...”``, ``‘...’`` and backticks. A value equal to one is fine.
  Otherwise a value that shares most of a quote's words in order (difflib ratio ≥ 0.6 over words; a
  quote of three words or more, with a space inside) claims to be that quote and is flagged *differs
  from the user's quote* unless its only differences are placeholders filled with numbers
  (``'... is X miles.'`` → ``'... is 980 miles.'``, ``${price}``).
* *A value the user dictated* (:data:`NOT_DICTATED_MARK`). A word of the value whose neighbours (up to
  four words either side, at least four in all) occur around another word of a user turn so far, that
  word being a number (digits: ``2026``; ``15th`` and ``15`` are the same) or a name (a capitalised
  word; not all capitals, as placeholders are written), and which that context never surrounds in any
  user turn, is flagged: the user's turn states another value (``December 15, 2023`` where the user
  dictated ``December 15, 2026``).
* *Text the user asked to be included* (:data:`NOT_INCLUDED_MARK`). A sentence of the current user
  turn that names the argument (``description``, ``message``, ``content``, ``comment``, ...), asks to
  include it (include, incorporate, contain) and refers to the reply of an earlier call (feedback,
  reply, response, answer, output or result, followed by words of that tool's name: "the feedback we
  got from customer support" → the last ``contact_customer_support``) asks for that output's text:
  the argument must contain one of its strings of three words or more (after :func:`normalise`), else
  it is flagged *misses the text the user asked to include*. A value equal to a quote of the user is
  taken as dictated and not checked for inclusions.

What cannot be decided is not flagged: composed free text the user did not dictate (a message to
customer support written from "detail the challenges I faced"), partial copies, paraphrases. At most
one claim flag per argument: the first that applies of tool output, dictated value, quote, inclusion.
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any, Iterator, Mapping, Sequence

__all__ = ["NOT_DICTATED_MARK", "NOT_INCLUDED_MARK", "NOT_TOOL_OUTPUT_MARK", "NOT_USER_QUOTE_MARK", "claim_flags",
           "normalise", "user_quotes"]

#: In a flag's text: a gold value that is a tool output altered (module docstring).
NOT_TOOL_OUTPUT_MARK = ": inconsistent with the tool output: "
#: ... a gold value that claims a quote of the user and differs from it.
NOT_USER_QUOTE_MARK = ": differs from the user's quote: "
#: ... a gold value stating another number or name than the user dictated.
NOT_DICTATED_MARK = ": not what the user dictated: "
#: ... a gold value without the text the user asked it to include.
NOT_INCLUDED_MARK = ": misses the text the user asked to include: "

_BFCL_STRIP = re.compile(r"[\s,./\-_*^]")
_WORD = re.compile(r"[A-Za-z0-9]+")
_QUOTE = re.compile(r"(?<![A-Za-z0-9])'((?:\\'|(?<=[A-Za-z])'(?=[A-Za-z])|[^'\n])+?)['’](?![A-Za-z0-9])"
                    r"|\"([^\"\n]+)\"|“([^”]+)”|‘([^’]+)’|`([^`\n]+)`")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_INCLUDE = re.compile(r"\b(include|includes|including|incorporate|incorporates|incorporating|contain|contains|"
                      r"containing)\b", re.I)
_REPLY = re.compile(r"\b(feedback|reply|replies|response|responses|answer|answers|output|outputs|result|results)\b"
                    r"((?:\W+\w+){1,8})", re.I)
_MIN_WORDS = 3
_QUOTE_RATIO = 0.6
_CONTEXT = 4
_STOP = frozenset({"get", "set", "the", "a", "an", "of", "to", "by", "id", "info", "for"})


def normalise(text: str) -> str:
    """BFCL's ``standardize_string`` with every whitespace character read as a space."""
    return _BFCL_STRIP.sub("", text).lower().replace("'", '"')


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, string) of every string leaf of ``value``."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path.lstrip("."), value


def _output_strings(output: str) -> list[str]:
    """A tool output and every string in its JSON (when it is JSON)."""
    try:
        decoded = json.loads(output)
    except ValueError:
        return [output]
    return [output] + [s for _, s in _strings(decoded)]


def user_quotes(text: str) -> list[str]:
    """The quoted spans of a user turn (module docstring), ``\\'`` read as ``'``."""
    return [next(g for g in m.groups() if g is not None).replace("\\'", "'").strip() for m in _QUOTE.finditer(text)]


def _copied_output(value: str, outputs: Sequence[str]) -> str | None:
    """The earlier output string whose words are the value's, altered; None if none or equal."""
    words = sorted(_words(value))
    if len(words) < _MIN_WORDS:
        return None
    copies = [s for out in outputs for s in _output_strings(out) if sorted(_words(s)) == words]
    if not copies or any(normalise(s) == normalise(value) for s in copies):
        return None
    return copies[-1]


def _filled_placeholders(quote: list[str], value: list[str]) -> bool | None:
    """Whether the only word differences of ``value`` from ``quote`` are placeholders filled with
    numbers (True), there are none (None), or some other (False)."""
    ops = [op for op in difflib.SequenceMatcher(None, quote, value, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not ops:
        return None
    return all(tag == "replace" and not any(c.isdigit() for w in quote[i1:i2] for c in w)
               and all(w.isdigit() for w in value[j1:j2]) for tag, i1, i2, j1, j2 in ops)


def _misquoted(value: str, quotes: Sequence[str]) -> str | None:
    """The user quote ``value`` claims to be and differs from (module docstring), else None."""
    if any(normalise(q) == normalise(value) for q in quotes):
        return None
    words = _words(value)
    best, ratio = None, _QUOTE_RATIO
    for q in quotes:
        qw = _words(q)
        long = len(qw) >= _MIN_WORDS and any(c.isspace() for c in q)
        r = difflib.SequenceMatcher(None, qw, words, autojunk=False).ratio() if long else 0.0
        if r >= ratio:
            best, ratio = q, r
    if best is None or _filled_placeholders(_words(best), words):
        return None
    return best


def _dictated(word: str) -> bool:
    return any(c.isdigit() for c in word) or (len(word) > 1 and word[0].isupper() and not word.isupper())


def _same(a: str, b: str) -> bool:
    da, db = re.sub(r"\D", "", a), re.sub(r"\D", "", b)
    return a.lower() == b.lower() or (bool(da) and da == db)


def _contradicted(value: str, users: Sequence[str]) -> tuple[str, str] | None:
    """(the value's word, the word the user's turn states in its place), or None (module docstring)."""
    words = _WORD.findall(value)
    low = [w.lower() for w in words]
    turns = [_WORD.findall(u) for u in users]
    for i, w in enumerate(words):
        left, right = low[max(0, i - _CONTEXT):i], low[i + 1:i + 1 + _CONTEXT]
        if len(left) + len(right) < _CONTEXT:
            continue
        stated = []
        for u in turns:
            ul = [x.lower() for x in u]
            for j in range(len(left), len(u) - len(right)):
                if ul[j - len(left):j] == left and ul[j + 1:j + 1 + len(right)] == right:
                    stated.append(u[j])
        if stated and not any(_same(s, w) for s in stated):
            theirs = next((s for s in stated if _dictated(s)), None)
            if theirs is not None:
                return w, theirs
    return None


def _requested_output(param: str, turn_text: str, earlier: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """(the request's words, the output asked for) when the current user turn asks ``param`` to
    include an earlier call's reply (module docstring), else None."""
    names = {param.lower(), *param.lower().split("_")} - _STOP
    for sentence in _SENTENCE.split(turn_text):
        low = sentence.lower()
        if not _INCLUDE.search(sentence) or not any(re.search(rf"\b{re.escape(n)}\b", low) for n in names):
            continue
        for m in _REPLY.finditer(sentence):
            after = set(_words(m.group(2))) - _STOP
            for tool, output in reversed(earlier):
                if after & (set(tool.lower().split("_")) - _STOP):
                    return m.group(0).strip(), output
    return None


def claim_flags(where: str, call: str, arguments: Mapping[str, Any], users: Sequence[str],
                earlier: Sequence[tuple[str, str]]) -> list[str]:
    """The claim flags of one gold call (module docstring): ``where`` = ``"turn 2 call 0"``, ``call``
    its text, ``users`` the user turns so far (the current one last), ``earlier`` (tool name, output)
    of every call before it."""
    outputs = [o for _, o in earlier]
    quotes = [q for u in users for q in user_quotes(u)]
    flags = []
    for path, value in _strings(dict(arguments)):
        if not any(c.isspace() for c in value.strip()):
            continue  # an identifier, a name, a code: the "not in the history" audit's domain
        head = f"{where} {call!r}"
        if (copied := _copied_output(value, outputs)) is not None:
            flags.append(f"{head}{NOT_TOOL_OUTPUT_MARK}{path}={value[:160]!r} has the words of the earlier "
                         f"output {copied[:160]!r}, not its text")
        elif (stated := _contradicted(value, users)) is not None:
            flags.append(f"{head}{NOT_DICTATED_MARK}{path}={value[:160]!r} says {stated[0]!r} where the user's "
                         f"turn states {stated[1]!r}")
        elif (quote := _misquoted(value, quotes)) is not None:
            flags.append(f"{head}{NOT_USER_QUOTE_MARK}{path}={value[:160]!r}, the user wrote {quote[:160]!r}")
        elif users and not any(normalise(q) == normalise(value) for q in quotes) and (
                asked := _requested_output(path.split(".")[-1].split("[")[0], users[-1], earlier)) is not None:
            wanted = [s for s in _output_strings(asked[1]) if len(_words(s)) >= _MIN_WORDS]
            if wanted and not any(normalise(s) in normalise(value) for s in wanted):
                flags.append(f"{head}{NOT_INCLUDED_MARK}{path}={value[:160]!r} lacks {asked[0]!r}: "
                             f"{wanted[-1][:160]!r}")
    return flags

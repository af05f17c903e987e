"""Prefix viability of a partial action (:func:`is_viable_prefix`): whether text generated so far
can still be completed into an action that :func:`pivotrl.format.actions.parse_action` accepts.

Pure core: standard library only.
"""

from __future__ import annotations

import re

from pivotrl.format.actions import raw_calls
from pivotrl.core.errors import ActionParseError

__all__ = ["is_viable_prefix"]

_IDENT_START = re.compile(r"[^\W\d]", re.UNICODE)
_IDENT_CHAR = re.compile(r"\w", re.UNICODE)
_CLOSERS = {")": "(", "]": "[", "}": "{"}

# States of the scanner over the top-level list (outside call arguments).
_FIRST, _NAME, _AFTER_NAME, _AFTER_DOT, _AFTER_CALL, _AFTER_COMMA, _CLOSED = range(7)


def is_viable_prefix(text: str) -> bool:
    """Whether the partial output ``text`` can still be completed into a valid action.

    Conservative: False only when no continuation can give a valid action (prose inside the call
    list, a mismatched bracket, an unterminated one-line string, text or a comment after the
    closing ``]``, a complete list that does not parse). Text actions are always viable.
    """
    s = text.lstrip()
    if not s or not s.startswith("["):
        return True
    state = _FIRST
    stack: list[str] = []  # open brackets inside call arguments
    i, n = 1, len(s)
    while i < n:
        c = s[i]
        if stack:  # inside the arguments of a call
            if c in "'\"":
                end = _skip_string(s, i)
                if end is None:
                    return False
                if end >= n:
                    return True  # string still open
                i = end
                continue
            if c == "#":
                return False
            if c in "([{":
                stack.append(c)
            elif c in _CLOSERS:
                if stack[-1] != _CLOSERS[c]:
                    return False
                stack.pop()
                if not stack:
                    state = _AFTER_CALL
            i += 1
            continue
        if state == _CLOSED:
            if not c.isspace():
                return False
        elif c.isspace():
            if state == _NAME:
                state = _AFTER_NAME
        elif state in (_FIRST, _AFTER_COMMA, _AFTER_DOT):
            if _IDENT_START.match(c):
                state = _NAME
            elif c == "]" and state == _AFTER_COMMA:
                state = _CLOSED
            else:
                return False
        elif state == _NAME:
            if c == ".":
                state = _AFTER_DOT
            elif c == "(":
                stack.append("(")
            elif not _IDENT_CHAR.match(c):
                return False
        elif state == _AFTER_NAME:
            if c == ".":
                state = _AFTER_DOT
            elif c == "(":
                stack.append("(")
            else:
                return False
        elif state == _AFTER_CALL:
            if c == ",":
                state = _AFTER_COMMA
            elif c == "]":
                state = _CLOSED
            else:
                return False
        i += 1
    if state == _CLOSED:
        try:
            raw_calls(s.rstrip())
        except ActionParseError:
            return False
    return True


def _skip_string(s: str, i: int) -> int | None:
    """Index just past the string literal starting at ``s[i]``; ``len(s)`` if it is still open;
    None if it can never be closed (a newline inside a one-line string)."""
    q = s[i]
    n = len(s)
    if s.startswith(q * 3, i):
        j = i + 3
        while j < n:
            if s[j] == "\\":
                j += 2
                continue
            if s.startswith(q * 3, j):
                return j + 3
            j += 1
        return n
    if i + 2 == n and s[i + 1] == q:
        return n  # '' at the very end: an empty string or the start of a triple-quoted one
    j = i + 1
    while j < n:
        ch = s[j]
        if ch == "\\":
            j += 2
            continue
        if ch == q:
            return j + 1
        if ch == "\n":
            return None
        j += 1
    return n

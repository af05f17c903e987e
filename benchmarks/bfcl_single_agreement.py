"""pivotrl's ``arguments`` verifier vs BFCL's ``ast_checker`` on variants of the 1,000 single-turn golds.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/bfcl_single_agreement.py

Each gold (pivotrl's demonstration text of each ``simple_python``, ``multiple``, ``parallel`` and
``parallel_multiple`` record) is written as it is and in variants a policy may write (a code fence,
no brackets, trailing prose, lists as tuples, positional arguments, integers as floats); each text
is judged by both (:mod:`pivotrl.bfcl.single`) and the texts their parsers read
differently are counted by kind. Prints one line per variant: texts, agreement counts, kinds.
"""
import collections
import os
import time

from pivotrl.format.actions import format_action, format_call, format_value
from pivotrl.bfcl.data import SINGLE_TURN_CATEGORIES, load_bfcl
from pivotrl.bfcl.wheel import ensure_bfcl
from pivotrl.data.states import extract_turn_states
from pivotrl.bfcl.ast_decoder import decoder_difference
from pivotrl.bfcl.single import BFCLSingleTurnJudge
from pivotrl.verifiers import get_verifier

cache = os.path.expanduser("~/.cache/pivotrl")
root = ensure_bfcl(cache)
states = [s for t in load_bfcl(SINGLE_TURN_CATEGORIES, cache) for s in extract_turn_states(t)]
judge = BFCLSingleTurnJudge(root)
ver = get_verifier("arguments")
def tuple_text(calls):
    out = []
    for c in calls:
        args = ", ".join(f"{k}=" + (("(" + ", ".join(format_value(x) for x in v) + ("," if len(v) == 1 else "") + ")") if isinstance(v, list) and v else format_value(v)) for k, v in sorted(c.arguments.items()))
        out.append(f"{c.name}({args})")
    return "[" + ", ".join(out) + "]"
def positional(calls, tools):
    out = []
    for c in calls:
        props = list(next(t for t in tools if t.name == c.name).parameters.get("properties") or {})
        pos, kw, i = [], dict(c.arguments), 0
        while i < len(props) and props[i] in kw:
            pos.append(format_value(kw.pop(props[i]))); i += 1
        out.append(f"{c.name}(" + ", ".join(pos + [f"{k}={format_value(v)}" for k, v in sorted(kw.items())]) + ")")
    return "[" + ", ".join(out) + "]"
def intfloat(calls):
    from pivotrl.data.schema import ToolCall
    cs = [ToolCall(name=c.name, arguments={k: (float(v) if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in c.arguments.items()}) for c in calls]
    return "[" + ", ".join(format_call(c) for c in cs) + "]"
variants = {
    "gold": lambda s, g, c: g,
    "code_fence": lambda s, g, c: "```\n" + g + "\n```",
    "code_fence_python": lambda s, g, c: "```python\n" + g + "\n```",
    "no_brackets": lambda s, g, c: g[1:-1],
    "trailing_prose": lambda s, g, c: g + " This computes it.",
    "lists_as_tuples": lambda s, g, c: tuple_text(c),
    "positional": lambda s, g, c: positional(c, s.tools),
    "ints_as_floats": lambda s, g, c: intfloat(c),
}
table = {}
t0 = time.time()
for name, f in variants.items():
    agree = collections.Counter(); diffs = collections.Counter(); n = 0
    for s in states:
        g = format_action(s.demo_action)
        text = f(s, g, s.demo_action.tool_calls)
        if text == g and name != "gold":
            continue
        n += 1
        b = judge.judge(s, text).valid
        p = ver.score(s, [text])[0].accepted
        agree[{(True, True): "both", (True, False): "only_bfcl", (False, True): "only_pivotrl", (False, False): "neither"}[(b, p)]] += 1
        k = decoder_difference(text, s.tools, root)
        if k: diffs[k] += 1
    table[name] = {"texts": n, **agree, "decoder_differences": dict(diffs)}
    print(name, table[name], flush=True)
print("seconds", round(time.time() - t0, 1))

"""The audit of what a gold call's free text says it is (pivotrl.data.claims), on tiny hand-made
dialogues: one test per kind of claim, each with the twins that must not be flagged; the flags'
kinds as ``pivotrl demos`` and the report count them. (On the 200 BFCL multi_turn_base tasks:
tests/integration/test_bfcl_records.py.)"""

from __future__ import annotations

import pytest

from pivotrl.config import load_config
from pivotrl.data.claims import claim_flags, normalise, user_quotes
from pivotrl.pipeline.demos import FLAG_KINDS, flag_kind

CAT = '{"file_content": "{\\"experiment\\": \\"Apollo Test\\", \\"result\\": \\"Success\\"}"}'
SORTED = '{"sorted_content": "Initial report content Unsorted data More unsorted data"}'
DIFF = '{"diff_lines": "- Old line one.\\n+ New line two."}'


def flags(arguments, users, earlier=(), call="f()"):
    return claim_flags("turn 1 call 0", call, arguments, users, list(earlier))


def test_normalise_is_bfcls_string_rule_with_any_whitespace_for_a_space():
    assert normalise("Hello, World. It's 9/10 -- ok_*^") == 'helloworldit"s910ok'
    assert normalise("a\nb\tc d") == normalise("abcd")
    assert normalise('{"a": "b"}') != normalise("{a: b}")


def test_user_quotes_read_apostrophes_escapes_and_curly_quotes():
    assert user_quotes("Tweet 'I've decided to go.' now") == ["I've decided to go."]
    assert user_quotes("say 'Hi Sam. I\\'ll call soon'.'") == ["Hi Sam. I'll call soon"]
    assert user_quotes('titled "A B", then “C D” and ‘E F’ and `g h`') == ["A B", "C D", "E F", "g h"]
    assert user_quotes("Mike's car and Ltd.'s stock") == []


@pytest.mark.parametrize("content, flagged", [
    ("{experiment: Apollo Test, result: Success}", True),  # quotes stripped
    ('{"experiment": "Apollo Test", "result": "Success"}', False),  # the output's text
    ("Initial report content More unsorted data Unsorted data", True),  # words reordered
    ("Initial report content Unsorted data More unsorted data", False),
    ("- Old line one.+ New line two.", False),  # a line break read as a space
    ("Initial report content", False),  # a part of it: cannot be decided, not flagged
])
def test_a_copy_of_a_tool_output_must_be_its_text(content, flagged):
    earlier = [("cat", CAT), ("sort", SORTED), ("diff", DIFF)]
    got = flags({"content": content}, ["Post it exactly as it is."], earlier, "post_tweet(...)")
    assert [flag_kind(f) for f in got] == (["not_tool_output"] if flagged else [])
    if flagged:
        assert got[0].startswith("turn 1 call 0 'post_tweet(...)': inconsistent with the tool output: content=")


@pytest.mark.parametrize("message, flagged", [
    ("Require assistance with transaction particulars", True),  # a word dropped
    ("Require assistance with the transaction particulars. Please assist.", True),  # a sentence added
    ("Require assistance with the transaction particulars.", False),  # the closing period is no difference
    ("require Assistance with the transaction-particulars", False),  # case, hyphen: BFCL's normalisation
    ("Please look at my booking", False),  # composed, not the quote: not decided
])
def test_a_quote_of_the_user_must_be_the_quote(message, flagged):
    users = ["Contact support and convey that I 'Require assistance with the transaction particulars'."]
    got = flags({"message": message}, users)
    assert [flag_kind(f) for f in got] == (["not_user_quote"] if flagged else [])


def test_placeholders_filled_with_numbers_and_identifiers_are_not_misquotes():
    users = ["Text Bob 'The distance from A to B is xxx km.' and 'Omega is at ${price} per share!'",
             "Rename 'project_plan.md' to project_overview.md, then title it 'Tire Pressure Issue' and "
             "describe it 'Urgent tire pressure issue.'"]
    assert flags({"message": "The distance from A to B is 750.0 km."}, users) == []
    assert flags({"content": "Omega is at $457.23 per share!"}, users) == []
    assert flags({"destination": "project_overview.md"}, users) == []  # no space: not free text
    assert flags({"title": "Tire Pressure Issue", "description": "Urgent tire pressure issue."}, users) == []
    assert flags({"message": "The distance from A to B is far km."}, users) != []  # a word, not a number


@pytest.mark.parametrize("description, stated", [
    ("the flight from JFK to LAX on December 15, 2023, needs to be canceled", ("2023", "2026")),
    ("the flight from JFK to LAX on December 15th, 2026, needs to be canceled", None),  # 15th is 15
    ("the flight from JFK to LAX on December 16, 2026, needs to be canceled", ("16", "15")),
    ("the flight booked for Alex Jonson from JFK to LAX", ("Jonson", "Johnson")),  # a name
    ("the flight booked for Alex Johnson from JFK to LAX", None),
    ("my flight on the 15th needs to be canceled soon", None),  # no context the user's turn has
])
def test_a_value_the_user_dictated_must_be_the_same(description, stated):
    users = ["Book for Alex Johnson from JFK to LAX.",
             "Put description as the flight from JFK to LAX on December 15, 2026, needs to be canceled "
             "immediately. The flight booked for Alex Johnson from JFK to LAX is off."]
    got = flags({"description": description}, users)
    assert [flag_kind(f) for f in got] == (["not_dictated"] if stated else [])
    if stated:
        assert got[0].endswith(f"says {stated[0]!r} where the user's turn states {stated[1]!r}")


SUPPORT = '{"customer_support_message": "Thank you for contacting customer support. We will get back to you."}'


@pytest.mark.parametrize("user, description, flagged", [
    ("The description ought to include the feedback we got from customer support.",
     "Feedback from customer support was unsatisfactory.", True),
    ("The description ought to include the feedback we got from customer support.",
     "Unsatisfactory. Support said: thank you for contacting customer support, we will get back to you", False),
    # Another argument named, or no reply of that tool: nothing asked of the description.
    ("The message ought to include the feedback we got from customer support.", "Unsatisfactory.", False),
    ("The description ought to include the feedback we got from the travel agent.", "Unsatisfactory.", False),
    # A description the user dictated is theirs, whatever else the turn says.
    ("Incorporate the reply from customer support in the description. Details be 'Unsatisfactory reply here.'",
     "Unsatisfactory reply here.", False),
])
def test_text_the_user_asked_to_include_must_be_there(user, description, flagged):
    earlier = [("contact_customer_support", SUPPORT), ("ticket_login", '{"success": true}')]
    got = flags({"title": "Costs", "description": description}, ["Contact support.", user], earlier)
    assert [flag_kind(f) for f in got] == (["not_included"] if flagged else [])
    if flagged:
        assert "misses the text the user asked to include: description=" in got[0]
        assert "'Thank you for contacting customer support. We will get back to you.'" in got[0]


def test_the_kinds_are_counted_by_demos_and_the_report():
    from pivotrl.evaluation.trust import trust_sections

    assert FLAG_KINDS[-4:] == ("not_tool_output", "not_user_quote", "not_dictated", "not_included")
    counts = {"flagged": 1, "flagged_ids": ["a"], "flags_by_kind": {k: int(k.startswith("not_t")) for k in FLAG_KINDS}}
    lines = trust_sections(load_config(None, []), counts, [])
    assert ("- flags by kind: failing_call 0, no_op 0, not_reproduced 0, not_ground_truth 0, not_in_history 0, "
            "not_tool_output 1, not_user_quote 0, not_dictated 0, not_included 0") in lines


@pytest.mark.data
def test_normalise_agrees_with_bfcls_own_string_rule():
    """BFCL's own ``standardize_string``, from the pinned wheel's AST checker."""
    import os
    import sys

    from pivotrl.bfcl.ast_decoder import bfcl_modules
    from pivotrl.bfcl.wheel import ensure_bfcl

    bfcl_modules(ensure_bfcl(os.environ["PIVOTRL_CACHE_DIR"]))  # imports the checker from the wheel
    standardize_string = sys.modules["bfcl_eval.eval_checker.ast_eval.ast_checker"].standardize_string
    for s in ["Hello, World. It's 9/10 -- ok_*^", "Omega is at $457.23 per share!", '{"a": "b c"}', "Q1: $5000, Q2"]:
        assert normalise(s) == standardize_string(s)

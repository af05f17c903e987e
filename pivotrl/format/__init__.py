"""The action format: how a turn state becomes a prompt and how a sampled text becomes an action.

One format is used for demonstrations, probing, training and evaluation:

* :mod:`~pivotrl.format.actions` — the pythonic action format (``parse_action``, ``format_call``);
* :mod:`~pivotrl.format.action_prefix` — whether a partial action can still be completed;
* :mod:`~pivotrl.format.tool_parsers` — named tool-call parsers (model text ↔ assistant message);
* :mod:`~pivotrl.format.tool_render` — the tool schemas and outputs as the model reads them;
* :mod:`~pivotrl.format.tool_tags` — tool-call tags whose output rows were never trained;
* :mod:`~pivotrl.format.chatml`, :mod:`~pivotrl.format.chat_render` — ChatML and chat-template rendering;
* :mod:`~pivotrl.format.chat_format` — which renderer writes a state, which parser reads an action;
* :mod:`~pivotrl.format.prompts` — the one prompt renderer every consumer calls.
"""

"""Tiny, offline test components: a ChatML tokenizer and a small random Llama.

Nothing here touches a model hub. The tokenizer is a byte-level BPE trained in-process on a few
hundred built-in strings (Python call syntax, JSON and English), so every string round-trips
through ``encode``/``decode``. The model is a 2-layer ``LlamaForCausalLM`` with head size 64
(a size vLLM has kernels for), initialised deterministically from a seed.

Typical use in a test::

    tok = tiny_tokenizer()
    model = tiny_llama(tok, seed=0)
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")   # model + tokenizer, HF format

:mod:`pivotrl.testing.grammar` sets the same model's weights so that it writes from a small grammar
(e.g. well-formed hermes tool calls with random arguments): ``save_grammar_checkpoint``.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

from pivotrl.storage.files import atomic_dir

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# ChatML as used by SmolLM2, without its implicit default system prompt:
#   <|im_start|>{role}\n{content}<|im_end|>\n ... and, for generation, <|im_start|>assistant\n
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to in and or is are was be it this that for on with as by at from not you your "
    "please can could would should will list file files folder directory current move copy create "
    "delete remove find search sort open close read write send message user post ticket stock "
    "price buy sell order flight book hotel car vehicle engine fuel temperature weather city "
    "number value result error true false none name arguments function call tool output answer "
    "calculate sum mean average factorial square root area triangle circle radius base height "
    "what how many which when where who why yes no done ok thanks help show get set update "
    "first second last next previous new old all each every some any more less total"
).split()

_CALLS = (
    "[cd(folder='document'), mkdir(dir_name='temp')]",
    "[ls(a=True)]",
    "[mv(source='final_report.pdf', destination='temp')]",
    "[sort(file_name='final_report.pdf')]",
    "[grep(file_name='log.txt', pattern='error')]",
    "[math.factorial(number=5)]",
    "[calculate_triangle_area(base=10, height=5)]",
    "[get_weather(city='Paris', unit='celsius')]",
    "[send_message(receiver_id='USR002', message='Hello there!')]",
    "[place_order(symbol='AAPL', price=150.25, amount=-3, order_type='Buy')]",
    "[book_flight(access_token='abc123', card_id='card_1', travel_date='2024-12-01')]",
    "[set_value(key=None, values=[1, 2, 3], options={'a': 1, 'b': (2, 3)})]",
    "[echo(content='The quick brown fox jumps over the lazy dog.', file_name='note.txt')]",
)

_JSON = (
    '{"name": "cd", "description": "Change directory.", "parameters": {"type": "object", '
    '"properties": {"folder": {"type": "string", "description": "Target folder."}}, '
    '"required": ["folder"]}}',
    '{"type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}',
    '{"result": [1, 2.5, -3, true, false, null], "error": "Error during execution: not found"}',
)

_SENTENCES = (
    "You are a helpful assistant that can call tools.",
    "Please move the final report into the temp folder.",
    "What is the factorial of five?",
    "I want to buy three shares of Apple at the current price.",
    "The file system has a document folder with two files.",
    "Answer with a list of function calls, or with plain text when no tool applies.",
    "Thanks, that is all for now.",
)


def _training_corpus() -> list[str]:
    """A few hundred deterministic strings covering calls, JSON, digits and English."""
    corpus: list[str] = []
    corpus.extend(_CALLS * 4)
    corpus.extend(_JSON * 4)
    corpus.extend(_SENTENCES * 4)
    for i in range(0, len(_WORDS) - 8, 3):
        corpus.append(" ".join(_WORDS[i : i + 8]).capitalize() + ".")
    corpus.extend(f"{n} {n * 7} {n / 4} -{n}" for n in range(100))
    corpus.append("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 _-.,:;!?'\"()[]{}=+*/\\<>|@#$%^&~`")
    return corpus


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(special_tokens: tuple[str, ...] = (IM_START, IM_END)) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> Any:
    """A ChatML byte-level BPE tokenizer (≈512 tokens) built offline; deterministic.

    Returns a fresh ``transformers.PreTrainedTokenizerFast`` (the trained BPE is cached in-process)
    with ``eos_token = pad_token = "<|im_end|>"``, ``bos_token = "<|im_start|>"`` (never added
    automatically) and a ChatML ``chat_template``: each message renders as
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; ``add_generation_prompt=True`` appends
    ``<|im_start|>assistant\\n``. Unlike SmolLM2's template, no default system prompt is inserted.
    Ids: ``<|im_start|>`` = 0, ``<|im_end|>`` = 1.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer_json())
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=IM_END,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


#: Special tokens, eos/bos and the stop tokens of the generation config of a few chat-model families,
#: for tokenizers that behave like theirs (the chat template is passed separately).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2.5": {"special": ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), "eos": "<|im_end|>", "bos": None,
                "pad": "<|endoftext|>", "stop": ("<|im_end|>", "<|endoftext|>")},
    "llama3.1": {"special": ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
                 "eos": "<|eot_id|>", "bos": "<|begin_of_text|>", "pad": "<|end_of_text|>",
                 "stop": ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")},
    "gemma3": {"special": ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "eos": "<eos>",
               "bos": "<bos>", "pad": "<pad>", "stop": ("<eos>", "<end_of_turn>")},
}


def tiny_chat_tokenizer(family: str, chat_template: str) -> Any:
    """A byte-level BPE tokenizer (≈512 tokens, offline, deterministic) with the special tokens,
    eos, bos and pad of ``family`` (a key of :data:`FAMILIES`) and the given chat template.

    Its ``generation_stop_ids`` attribute lists the ids a generation config of that family stops
    at (pass them as ``eos_token_id`` to :func:`save_tiny_checkpoint`).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[family]
    backend = Tokenizer.from_str(_trained_tokenizer_json(tuple(fam["special"])))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=fam["bos"], eos_token=fam["eos"],
                                  pad_token=fam["pad"], model_max_length=4096, clean_up_tokenization_spaces=False)
    tok.chat_template = chat_template
    tok.generation_stop_ids = [tok.convert_tokens_to_ids(t) for t in fam["stop"]]
    return tok


def tiny_llama_config(tokenizer: Any, **overrides: Any) -> Any:
    """The ``LlamaConfig`` of :func:`tiny_llama`; ``overrides`` replace any field.

    Defaults: 2 layers, hidden 128, 2 attention heads of size 64, 1 KV head, MLP 256,
    tied embeddings, 4096 positions, vocabulary = ``len(tokenizer)``.
    """
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.1,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_llama(tokenizer: Any, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised 2-layer ``LlamaForCausalLM`` (fp32, eval mode), deterministic in ``seed``.

    ``overrides`` are ``LlamaConfig`` fields (see :func:`tiny_llama_config`). The global torch RNG
    is left untouched (initialisation runs under ``torch.random.fork_rng``). ``initializer_range``
    defaults to 0.1 so that the untrained model's next-token distributions are far from uniform.
    """
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(tokenizer, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


def save_tiny_checkpoint(directory: str | os.PathLike[str], seed: int = 0, tokenizer: Any = None,
                         **overrides: Any) -> Path:
    """Save :func:`tiny_llama` (``seed``, ``overrides``) and :func:`tiny_tokenizer` to ``directory``.

    Writes an HF checkpoint directory (``config.json``, ``model.safetensors``, tokenizer files)
    atomically: into a temporary sibling first, then renamed. Returns the directory path.
    Raises FileExistsError if ``directory`` exists and is not empty. ``tokenizer``: another
    tokenizer (e.g. :func:`tiny_chat_tokenizer`); its ``generation_stop_ids`` become the
    generation config's ``eos_token_id``.
    """
    target = Path(directory)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"checkpoint directory {target} exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer() if tokenizer is None else tokenizer
    if tokenizer is not None and getattr(tokenizer, "generation_stop_ids", None):
        overrides.setdefault("eos_token_id", list(tokenizer.generation_stop_ids))
    model = tiny_llama(tok, seed=seed, **overrides)
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return target


#: Keys of what an engine measured rather than found: generation wall time and what derives from it
#: (``gen_s``, ``heldout_gen_mfu``...), and the local evaluation's generation counters (``local_gen_*``:
#: prefix-cache hits depend on how the items were batched).
_MEASURED = re.compile(r"gen_(s|tokens_per_s|mfu)$|^local_gen_")


def _without_measured(obj: Any) -> Any:
    """``obj`` without the :data:`_MEASURED` keys, at any depth."""
    if isinstance(obj, dict):
        return {k: _without_measured(v) for k, v in obj.items() if not _MEASURED.search(str(k))}
    if isinstance(obj, list):
        return [_without_measured(v) for v in obj]
    return obj


def comparable_report(result: dict[str, Any], roots: "list[str | os.PathLike[str]]") -> tuple[dict[str, Any], str]:
    """``(report.json, report.md)`` of an evaluation result dict (``EvalResult.to_dict()``, local
    root) without what names the run rather than its numbers: ``meta.config_hash`` (a sharded run's
    config differs in ``scale_out``) and the paths of ``roots`` in the Markdown. Two evaluations of
    the same policies on the same tasks give equal pairs, whether sharded or not."""
    import copy

    report = copy.deepcopy(result["report"])
    digest = report["meta"].pop("config_hash")
    # what the evaluation's own engine measured (wall time, and prefix-cache hits that depend on how
    # the items were batched): how fast, not what was found
    speed = report.get("generation_speed") or {}
    report["generation_speed"] = {k: {m: x for m, x in v.items() if m not in ("s", "tokens_per_s", "mfu")}
                                  for k, v in speed.items() if not k.startswith("evaluation:")}
    report = _without_measured(report)
    import fsspec

    with fsspec.open(result["report_md"], "r", encoding="utf-8") as f:  # a local path or a storage URL
        md = f.read()
    md = "\n".join(ln for ln in md.splitlines() if not ln.startswith("| generation, "))
    for root in sorted((str(r) for r in roots), key=len, reverse=True):
        md = md.replace(root, "<root>")
    return report, md.replace(digest, "<config hash>").replace(digest[:12], "<config hash>")


from pivotrl.testing.grammar import grammar_llama, grammar_tokenizer, save_grammar_checkpoint  # noqa: E402

__all__ = [
    "CHAT_TEMPLATE",
    "comparable_report",
    "FAMILIES",
    "grammar_llama",
    "grammar_tokenizer",
    "IM_END",
    "IM_START",
    "save_grammar_checkpoint",
    "save_tiny_checkpoint",
    "tiny_llama",
    "tiny_chat_tokenizer",
    "tiny_llama_config",
    "tiny_tokenizer",
]


def descendants(pids: list[int]) -> list[int]:
    """Every descendant process of ``pids`` (Linux ``/proc``)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], list(pids)
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def vllm_worker_cpus(pids: list[int]) -> dict[int, str]:
    """``{pid: Cpus_allowed_list}`` of every vLLM model-worker process (``VLLM::Worker``) descended
    from ``pids``; {} when none is found. It is the process's main thread's list: on the CPU build
    that is OpenMP's thread 0, pinned to the first CPU of the engine's bind list (``"0"`` for binds
    "0" and "0,1"), while an unbound worker shows every CPU it may use (``"0-1"``)."""
    found: dict[int, str] = {}
    for pid in descendants(pids):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "VLLM::Worker":
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        found.update({pid: ln.split()[1] for ln in status.splitlines() if ln.startswith("Cpus_allowed_list")})
    return found

from __future__ import annotations

import pytest
import torch

from pivotrl.testing import save_tiny_checkpoint, tiny_llama, tiny_tokenizer


def test_tokenizer_chatml_and_special_ids() -> None:
    tok = tiny_tokenizer()
    assert len(tok) == 512
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [0, 1]
    assert tok.eos_token_id == tok.pad_token_id == 1
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "text",
    ["[cd(folder='document'), mkdir(dir_name='temp')]", "héllo 漢字 \t\n -3.5e2 {'a': None}", ""],
)
def test_tokenizer_round_trips(text: str) -> None:
    tok = tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_tokenizer_compresses_calls() -> None:
    tok = tiny_tokenizer()
    call = "[cd(folder='document'), mkdir(dir_name='temp')]"
    # trained merges: far fewer tokens than the 47 bytes
    assert len(tok.encode(call, add_special_tokens=False)) < 30


def test_tiny_llama_deterministic_in_seed() -> None:
    tok = tiny_tokenizer()
    a, b, c = tiny_llama(tok, seed=0), tiny_llama(tok, seed=0), tiny_llama(tok, seed=1)
    assert a.config.num_hidden_layers == 2 and a.config.head_dim == 64
    assert a.config.tie_word_embeddings and a.lm_head.weight is a.model.embed_tokens.weight
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_tiny_llama_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_llama(tiny_tokenizer(), seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_save_tiny_checkpoint_round_trip(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_checkpoint(tmp_path / "ckpt", seed=3)
    assert path == tmp_path / "ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind
    model = AutoModelForCausalLM.from_pretrained(path)
    ref = tiny_llama(tiny_tokenizer(), seed=3)
    got, want = model.state_dict(), ref.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token == "<|im_end|>"
    assert tok.encode("[ls(a=True)]") == tiny_tokenizer().encode("[ls(a=True)]")
    with pytest.raises(FileExistsError):
        save_tiny_checkpoint(path)

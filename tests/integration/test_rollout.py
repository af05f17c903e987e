from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from pivotrl.core.errors import ConfigError, ModelError
from pivotrl.rollout import ROLLOUT_ENGINES, Generation, SamplingConfig, make_engine
from pivotrl.rollout.hf import TransformersEngine
from pivotrl.testing import save_tiny_checkpoint, tiny_llama, tiny_tokenizer

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(tok, seed=0)


@pytest.fixture(scope="module")
def engine(model, tok):
    return TransformersEngine(model, tok)


@pytest.fixture(scope="module")
def prompts(tok):
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Please move the final report into the temp folder."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return [tok.encode(chat), tok.encode("[cd(folder='document')]")]


def oracle_logprobs(model, prompt: list[int], action: list[int]) -> list[float]:
    """Plain full forward over prompt + action: log_softmax at each action position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + action])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + t, a].item() for t, a in enumerate(action)]


def max_abs_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------- config


def test_sampling_config_validation() -> None:
    with pytest.raises(ConfigError, match="sampling.n"):
        SamplingConfig(n=0)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingConfig(max_tokens=0)
    with pytest.raises(ConfigError, match="stop"):
        SamplingConfig(stop="]")
    assert SamplingConfig(stop=["]"]).stop == ("]",)


def test_registry_and_lazy_import() -> None:
    assert ROLLOUT_ENGINES.names() == ["transformers", "vllm"]
    with pytest.raises(ConfigError, match="valid names: transformers, vllm"):
        make_engine("sglang", "unused")
    code = "import sys, pivotrl.rollout; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_make_engine_from_checkpoint(tmp_path, tok, prompts) -> None:
    path = save_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    eng = make_engine("transformers", str(path), dtype="fp32", max_model_len=64)
    assert isinstance(eng, TransformersEngine) and eng.max_model_len == 64
    assert eng.model.dtype == torch.float32
    with pytest.raises(ConfigError, match="prompt 0 has 64 tokens"):
        eng.generate([[5] * 64], SamplingConfig())
    gens = eng.generate([[5] * 60], SamplingConfig(max_tokens=10, seed=0))
    assert len(gens[0][0].token_ids) <= 4  # cut at the context limit (60 + 4 = 64)
    with pytest.raises(ConfigError, match="outside"):
        eng.generate([[600]], SamplingConfig())
    with pytest.raises(ConfigError, match="empty"):
        eng.generate([[]], SamplingConfig())
    with pytest.raises(ModelError):
        make_engine("transformers", str(tmp_path / "missing"))


# ---------------------------------------------------------------------------- transformers engine


def test_kv_reuse_matches_no_reuse(model, tok, engine, prompts) -> None:
    naive = TransformersEngine(model, tok, reuse_prompt_cache=False)
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=24, seed=11)
    shared = engine.generate(prompts, sampling)
    separate = naive.generate(prompts, sampling)
    assert [len(g) for g in shared] == [4, 4]
    for a_row, b_row in zip(shared, separate):
        for a, b in zip(a_row, b_row):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            assert max_abs_diff(a.rollout_logprobs, b.rollout_logprobs) <= 1e-5
    # the 4 samples of one prompt are not copies of each other
    assert len({tuple(g.token_ids) for g in shared[0]}) == 4


def test_rollout_logprobs_equal_score_and_oracle(model, engine, prompts) -> None:
    gens = engine.generate(prompts, SamplingConfig(n=3, temperature=0.7, top_p=0.9, max_tokens=16, seed=2))
    pairs = [(prompts[i], g) for i in range(2) for g in gens[i]]
    scores = engine.score([p for p, _ in pairs], [g.token_ids for _, g in pairs])
    for (prompt, g), s in zip(pairs, scores):
        assert len(s) == len(g.token_ids) == len(g.rollout_logprobs)
        assert max_abs_diff(s, g.rollout_logprobs) <= 1e-4
        # unscaled (temperature 1) log-probs, as a plain trainer forward computes them
        assert max_abs_diff(g.rollout_logprobs, oracle_logprobs(model, prompt, g.token_ids)) <= 1e-4


def test_score_mixed_lengths_matches_oracle(model, engine, prompts) -> None:
    actions = [[7], [40, 41, 42, 43, 44], [100, 200], [1]]
    ps = [prompts[0], prompts[0], prompts[1], prompts[0]]
    scores = engine.score(ps, actions)
    for p, a, s in zip(ps, actions, scores):
        assert max_abs_diff(s, oracle_logprobs(model, p, a)) <= 1e-5
    with pytest.raises(ConfigError, match="action 0 is empty"):
        engine.score([prompts[0]], [[]])
    with pytest.raises(ConfigError, match="2 prompts but 1 actions"):
        engine.score(prompts, [[1]])


def test_seed_reproducible_and_distinct(engine, prompts) -> None:
    s = SamplingConfig(n=2, max_tokens=12, seed=5)
    a = engine.generate(prompts, s)
    b = engine.generate(prompts, s)
    c = engine.generate(prompts, SamplingConfig(n=2, max_tokens=12, seed=6))
    ids = lambda gens: [g.token_ids for row in gens for g in row]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    # identical prompts at different indices get different samples
    d = engine.generate([prompts[0], prompts[0]], s)
    assert d[0][0].token_ids == a[0][0].token_ids
    assert d[1][0].token_ids != d[0][0].token_ids


def test_greedy_and_top_k_one_follow_argmax(model, engine, prompts) -> None:
    greedy = engine.generate([prompts[0]], SamplingConfig(n=2, temperature=0.0, max_tokens=6))[0]
    topk1 = engine.generate([prompts[0]], SamplingConfig(n=1, temperature=1.3, top_k=1, max_tokens=6, seed=9))[0]
    assert greedy[0].token_ids == greedy[1].token_ids == topk1[0].token_ids
    seq = list(prompts[0])
    with torch.no_grad():
        for tok_id in greedy[0].token_ids:
            assert tok_id == int(model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(tok_id)


def test_finish_reasons_eos_length_abort_and_stop(tok, prompts) -> None:
    base = tiny_llama(tok, seed=0)
    eng = TransformersEngine(base, tok)
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, seed=21)
    sample = eng.generate([prompts[0]], sampling)[0][0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 8
    assert tok.eos_token_id not in sample.token_ids
    # declare a later sampled token an extra eos id: generation ends there with "stop"
    j = next(i for i in range(2, 8) if sample.token_ids[i] not in sample.token_ids[:i])
    other = tiny_llama(tok, seed=0, eos_token_id=[tok.eos_token_id, sample.token_ids[j]])
    stopped = TransformersEngine(other, tok).generate([prompts[0]], sampling)[0][0]
    assert stopped.token_ids == sample.token_ids[: j + 1] and stopped.finish_reason == "stop"
    # stop_fn aborts a sample as soon as it returns True
    seen: list[str] = []
    prefix_len = len(tok.decode(sample.token_ids[:2]))
    aborted = eng.generate(
        [prompts[0]], sampling, stop_fn=lambda text: seen.append(text) or len(text) >= prefix_len
    )[0][0]
    assert aborted.token_ids == sample.token_ids[:2] and aborted.finish_reason == "abort"
    assert seen == [tok.decode(sample.token_ids[:1]), tok.decode(sample.token_ids[:2])]
    # stop strings: text is cut before the stop string, tokens kept as produced
    full_text = tok.decode(sample.token_ids, skip_special_tokens=True)
    stop = full_text[-3:]
    cut = eng.generate([prompts[0]], SamplingConfig(temperature=1.0, max_tokens=8, seed=21, stop=(stop,)))[0][0]
    assert cut.finish_reason == "stop"
    assert cut.text == full_text[: full_text.find(stop)]


def test_load_weights_changes_and_restores(tmp_path, tok, prompts) -> None:
    ckpt0 = save_tiny_checkpoint(tmp_path / "s0", seed=0)
    ckpt1 = save_tiny_checkpoint(tmp_path / "s1", seed=1)
    eng = TransformersEngine(str(ckpt0), dtype="fp32")
    action = [[40, 41, 42, 43]]
    before = eng.score([prompts[0]], action)[0]
    eng.load_weights(str(ckpt1))
    changed = eng.score([prompts[0]], action)[0]
    assert max_abs_diff(before, changed) > 0.1
    assert max_abs_diff(changed, oracle_logprobs(tiny_llama(tok, seed=1), prompts[0], action[0])) <= 1e-5
    eng.load_weights(str(ckpt0))
    assert eng.score([prompts[0]], action)[0] == before
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        eng.load_weights(str(tmp_path))
    wrong = save_tiny_checkpoint(
        tmp_path / "wide", seed=0, hidden_size=256, intermediate_size=512, num_attention_heads=4
    )
    with pytest.raises(ModelError, match="does not match"):
        eng.load_weights(str(wrong))


def test_bf16_engine_close_to_fp32(model, tok, prompts) -> None:
    bf16 = TransformersEngine(tiny_llama(tok, seed=0), tok, dtype="bf16")
    assert bf16.model.dtype == torch.bfloat16
    gens = bf16.generate([prompts[0]], SamplingConfig(n=2, max_tokens=8, seed=1))[0]
    for g in gens:
        assert isinstance(g, Generation)
        assert max_abs_diff(g.rollout_logprobs, oracle_logprobs(model, prompts[0], g.token_ids)) < 0.2


# ---------------------------------------------------------------------------- vLLM engine


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    root = tmp_path_factory.mktemp("vllm")
    ckpt0 = save_tiny_checkpoint(root / "s0", seed=0)
    ckpt1 = save_tiny_checkpoint(root / "s1", seed=1)
    eng = make_engine("vllm", str(ckpt0), dtype="fp32", max_model_len=512, kv_cache_gib=1, seed=0)
    yield eng, ckpt0, ckpt1
    eng.close()


def test_cpu_bind_list_takes_the_first_allowed_cpus_and_respects_an_explicit_bind() -> None:
    from pivotrl.rollout.vllm_placement import cpu_bind_list

    assert cpu_bind_list(None, {}, allowed=[3, 1, 2]) == "1,2,3"
    assert cpu_bind_list(2, {}, allowed=[3, 1, 2]) == "1,2"
    assert cpu_bind_list(8, {}, allowed=[0, 1]) == "0,1"
    assert cpu_bind_list(1, {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, allowed=[0, 1]) is None
    with pytest.raises(ConfigError, match="cpu_threads must be >= 1"):
        cpu_bind_list(0, {}, allowed=[0, 1])


@pytest.mark.vllm
def test_vllm_worker_is_bound_to_every_allowed_cpu(vllm_setup) -> None:
    import os

    from pivotrl.testing import vllm_worker_cpus

    eng = vllm_setup[0]
    assert eng.cpu_bind == ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # scoped to the engine's construction
    # the model worker's main thread is OpenMP's thread 0, pinned to the bind list's first CPU (an
    # unbound worker would show every allowed CPU)
    assert list(vllm_worker_cpus([os.getpid()]).values()) == [eng.cpu_bind.split(",")[0]]


@pytest.mark.vllm
def test_vllm_logprobs_match_transformers_oracle(vllm_setup, model, engine, prompts) -> None:
    eng = vllm_setup[0]
    sampling = SamplingConfig(n=3, temperature=0.8, top_p=0.95, max_tokens=16, seed=4)
    gens = eng.generate(prompts, sampling)
    assert [len(row) for row in gens] == [3, 3]
    for prompt, row in zip(prompts, gens):
        assert len({tuple(g.token_ids) for g in row}) == 3
        for g in row:
            assert g.finish_reason in ("stop", "length") and len(g.token_ids) == len(g.rollout_logprobs)
            oracle = oracle_logprobs(model, prompt, g.token_ids)
            assert max_abs_diff(g.rollout_logprobs, oracle) <= 1e-4
    # same seed → same samples; score() agrees with the transformers engine
    again = eng.generate(prompts, sampling)
    assert [g.token_ids for g in again[0]] == [g.token_ids for g in gens[0]]
    actions = [gens[0][0].token_ids, gens[1][2].token_ids]
    assert all(
        max_abs_diff(a, b) <= 1e-4 for a, b in zip(eng.score(prompts, actions), engine.score(prompts, actions))
    )
    # stop_fn cuts after the fact with "abort"
    cut = eng.generate([prompts[0]], SamplingConfig(n=1, max_tokens=8, seed=4), stop_fn=lambda t: True)[0][0]
    assert len(cut.token_ids) == 1 and cut.finish_reason in ("abort", "stop")


@pytest.mark.vllm
def test_vllm_groups_in_one_pass_sample_what_separate_calls_sample(vllm_setup, prompts) -> None:
    """Batches with their own sampling (greedy; m seeded samples; another seed) served in one
    scheduler pass give the generations of one generate call per batch, token for token."""
    from pivotrl.rollout.base import generate_groups

    eng = vllm_setup[0]
    groups = [(prompts, SamplingConfig(n=1, temperature=0.0, max_tokens=12, seed=1)),
              (prompts, SamplingConfig(n=4, temperature=1.0, max_tokens=12, seed=2)),
              (prompts[::-1], SamplingConfig(n=2, temperature=0.7, max_tokens=6, seed=3))]
    together = generate_groups(eng, groups)
    alone = [eng.generate(p, s) for p, s in groups]
    shape = [[len(row) for row in g] for g in together]
    assert shape == [[1, 1], [4, 4], [2, 2]] == [[len(row) for row in g] for g in alone]
    assert [[[x.token_ids for x in row] for row in g] for g in together] == \
        [[[x.token_ids for x in row] for row in g] for g in alone]
    assert all(len(x.token_ids) <= 6 for row in together[2] for x in row)
    assert len({tuple(x.token_ids) for x in together[1][0]}) > 1  # sampled, not greedy


@pytest.mark.vllm
def test_vllm_load_weights_changes_and_restores(vllm_setup, tok, prompts) -> None:
    eng, ckpt0, ckpt1 = vllm_setup
    action = [[40, 41, 42, 43]]
    before = eng.score([prompts[0]], action)[0]
    eng.load_weights(str(ckpt1))
    changed = eng.score([prompts[0]], action)[0]
    assert max_abs_diff(before, changed) > 0.1
    assert max_abs_diff(changed, oracle_logprobs(tiny_llama(tok, seed=1), prompts[0], action[0])) <= 1e-4
    eng.load_weights(str(ckpt0))
    assert eng.score([prompts[0]], action)[0] == before


@pytest.mark.vllm
def test_vllm_update_weights_from_shared_memory_changes_and_restores(vllm_setup, tok, prompts) -> None:
    """The in-memory refresh (rollout.weight_sync: memory): the workers read a shared-memory block;
    the tied head follows the new embedding (the refresh check's tolerance, fp32)."""
    from transformers import AutoModelForCausalLM

    from pivotrl.rollout.weight_sync import SharedWeights, module_weights

    eng, ckpt0, ckpt1 = vllm_setup
    action = [[40, 41, 42, 43]]
    before = eng.score([prompts[0]], action)[0]
    block = SharedWeights()
    eng.update_weights(*block.write(module_weights(AutoModelForCausalLM.from_pretrained(ckpt1))))
    changed = eng.score([prompts[0]], action)[0]
    assert max_abs_diff(before, changed) > 0.1
    assert max_abs_diff(changed, oracle_logprobs(tiny_llama(tok, seed=1), prompts[0], action[0])) <= 1e-4
    eng.update_weights(*block.write(module_weights(AutoModelForCausalLM.from_pretrained(ckpt0))))
    assert max_abs_diff(eng.score([prompts[0]], action)[0], before) <= 1e-6
    block.close()


def test_decode_attention_matches_sdpa(tok, prompts) -> None:
    sampling = SamplingConfig(n=3, max_tokens=12, seed=8)
    plain = TransformersEngine(tiny_llama(tok, seed=0, num_key_value_heads=1), tok, decode_attention=False)
    fast = TransformersEngine(tiny_llama(tok, seed=0, num_key_value_heads=1), tok, decode_attention=True)
    assert fast.model.config._attn_implementation == "pivotrl_decode"
    for a, b in zip(plain.generate(prompts, sampling), fast.generate(prompts, sampling)):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert max_abs_diff(x.rollout_logprobs, y.rollout_logprobs) <= 1e-5
    # grouped-query layout: 2 query heads sharing 1 KV head vs 2 KV heads (no grouping)
    for kv in (1, 2):
        m_plain = tiny_llama(tok, seed=3, num_key_value_heads=kv)
        m_fast = tiny_llama(tok, seed=3, num_key_value_heads=kv)
        e_plain = TransformersEngine(m_plain, tok, decode_attention=False)
        e_fast = TransformersEngine(m_fast, tok, decode_attention=True)
        # a 3-token prompt + 5-token action runs entirely on the short-query path (causal, no mask)
        ps, actions = [prompts[0], prompts[1], [0, 5, 6]], [[40, 41, 42], [7], [8, 9, 10, 11, 12]]
        for x, y in zip(e_plain.score(ps, actions), e_fast.score(ps, actions)):
            assert max_abs_diff(x, y) <= 1e-5


@pytest.mark.vllm
def test_vllm_generate_groups_counts_prompts_in_the_pass_and_meters_same_tokens(vllm_setup, prompts) -> None:
    eng = vllm_setup[0]
    groups = [(prompts, SamplingConfig(n=2, temperature=1.0, max_tokens=8, seed=5)),
              (prompts[:1], SamplingConfig(n=1, temperature=0.0, max_tokens=4, seed=5))]
    plain = eng.generate_groups(groups)
    before = eng.meter.totals()
    done: list[int] = []
    counted = eng.generate_groups(groups, on_done=done.append)
    assert [[[g.token_ids for g in row] for row in grp] for grp in counted] == \
        [[[g.token_ids for g in row] for row in grp] for grp in plain]
    assert done == [1] * (len(prompts) + 1)
    gen = eng.meter.totals().minus(before)
    assert gen.requests == len(prompts) + 1 and gen.prompt_tokens == sum(map(len, prompts)) + len(prompts[0])
    assert gen.generated_tokens == sum(len(g.token_ids) for grp in counted for row in grp for g in row)
    # every prompt was served before: each child request computes its prompt past the full KV
    # blocks cached (a prompt shorter than one block: all of it, once per sample)
    block = int(eng.llm.llm_engine.vllm_config.cache_config.block_size)
    assert gen.prefill_tokens == sum(s.n * (len(p) - (len(p) - 1) // block * block) for ps, s in groups for p in ps)
    assert gen.flops > 0 and gen.seconds > 0


@pytest.mark.vllm
def test_vllm_cpu_blocks_of_32_prefill_less_and_sample_the_same_tokens_as_vllms_128(vllm_setup, prompts) -> None:
    """On vLLM's CPU build the engine takes 32-token KV blocks (vLLM's own default there: 128). The
    sibling samples of an n-sample request reuse the first sample's full blocks only, so a prompt is
    prefilled once plus its tail past the last full block per sibling: the same seeded samples, with
    fewer prompt tokens computed (a prompt under one block of 128 was computed once per sample)."""
    import random

    from pivotrl.rollout.vllm import CPU_BLOCK_SIZE
    from pivotrl.rollout.vllm_placement import is_cpu_platform

    eng, ckpt0, _ = vllm_setup
    if not is_cpu_platform():
        pytest.skip("the default block size is set on vLLM's CPU build only")
    assert eng.llm.llm_engine.vllm_config.cache_config.block_size == CPU_BLOCK_SIZE == 32
    rng = random.Random(20261207)
    batch = [*prompts, [rng.randrange(5, eng.vocab_size) for _ in range(300)]]
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=8, seed=3)

    def run(e):
        e.llm.reset_prefix_cache()
        before = e.meter.totals()
        gens = e.generate(batch, sampling)
        return gens, e.meter.totals().minus(before).prefill_tokens

    def expected(block: int) -> int:  # every prompt once, then its tail past the last full block per sibling
        return sum(len(p) + 3 * (len(p) - (len(p) - 1) // block * block) for p in batch)

    narrow, narrow_prefill = run(eng)
    wide_engine = make_engine("vllm", str(ckpt0), dtype="fp32", max_model_len=512, kv_cache_gib=1, seed=0,
                              block_size=128)
    try:
        assert wide_engine.llm.llm_engine.vllm_config.cache_config.block_size == 128
        wide, wide_prefill = run(wide_engine)
    finally:
        wide_engine.close()
    assert [[g.token_ids for g in row] for row in narrow] == [[g.token_ids for g in row] for row in wide]
    for row_n, row_w in zip(narrow, wide):
        for g_n, g_w in zip(row_n, row_w):
            assert g_n.rollout_logprobs == pytest.approx(g_w.rollout_logprobs, abs=1e-4)
    assert (narrow_prefill, wide_prefill) == (expected(32), expected(128))
    assert narrow_prefill < wide_prefill


@pytest.mark.vllm
def test_vllm_meter_counts_the_prefill_of_every_sample_of_a_request(vllm_setup, capfd) -> None:
    """vLLM runs an n-sample request as n child requests: the first computes a fresh prompt, each
    sibling hits its full KV blocks and recomputes the partial last block. The meter counts what the
    engine computed, the scheduler's prefix-cache queries − hits (before: the one num_cached_tokens
    of the request, 12 of 144 here); a repeated prompt counts only the uncached tail of each child.
    The statistics print nothing."""
    import random

    from pivotrl.runtime.generation import request_flops

    eng = vllm_setup[0]
    block = int(eng.llm.llm_engine.vllm_config.cache_config.block_size)
    rng = random.Random(20261205)
    prompt = [rng.randrange(5, eng.vocab_size) for _ in range(block * 2 + 44)]  # 2 full blocks + 44
    full = (len(prompt) - 1) // block * block  # the prompt tokens a later child finds cached
    tail = len(prompt) - full
    stats = eng.prefill_stats
    assert stats is not None and eng.llm.llm_engine.logger_manager.stat_loggers == [stats]
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=6, seed=11)
    counted = {}
    for label, want_cached in (("fresh", [0, full, full, full]), ("repeated", [full] * 4)):
        before, q0, h0 = eng.meter.totals(), stats.queries, stats.hits
        gens = eng.generate([prompt], sampling)
        gen = eng.meter.totals().minus(before)
        assert (gen.requests, gen.samples, gen.prompt_tokens) == (1, 4, len(prompt)), label
        assert gen.prefill_tokens == (stats.queries - q0) - (stats.hits - h0), label
        lengths = [len(g.token_ids) for g in gens[0]]
        assert gen.flops == pytest.approx(request_flops(eng.meter.shape, len(prompt), want_cached, lengths)), label
        counted[label] = gen.prefill_tokens
    # the whole prompt once plus the partial block per sibling; then the partial block per child
    assert counted == {"fresh": len(prompt) + 3 * tail, "repeated": 4 * tail}
    if block == 32:  # pivotrl's default on vLLM's CPU build: 108 tokens = 3 full blocks + 12
        assert counted == {"fresh": 108 + 3 * 12, "repeated": 4 * 12}
    assert not stats.cached  # every request's statistics taken
    capfd.readouterr()
    eng.llm.llm_engine.do_log_stats()  # what vLLM's loop calls every VLLM_LOG_STATS_INTERVAL seconds
    out, err = capfd.readouterr()
    assert "throughput" not in out + err and "Prefix cache" not in out + err

"""Flaky tools: injected crashes and latency in the sandbox, retries, and what is dropped.

Real components throughout: BFCL multi-turn states, the ``execution`` verifier in real sandbox
worker processes, and the ``TransformersEngine`` on a tiny Llama taught the demonstration actions
for a few steps (so that its probes are sometimes parseable calls that must be executed, sometimes
not: an untrained random model never produces a call, and nothing would reach the sandbox).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from pivotrl.format.actions import format_action
from pivotrl.config import load_config
from pivotrl.envs.sandbox import SandboxPool
from pivotrl.core.errors import ConfigError
from pivotrl.runtime.faults import FaultInjector, fault_seed
from pivotrl.pipeline.common import make_verifier
from pivotrl.pipeline.probe import apply_pivot_filter, pivot_stats, probe_states, stats_markdown
from pivotrl.rollout.base import SamplingConfig
from pivotrl.testing import tiny_tokenizer

# Needs the pinned BFCL data (downloaded once into the cache): not in `make test-fast`.
pytestmark = pytest.mark.data

PROMPT = {"tool_style": "compact", "max_tool_output_chars": 2000}
M = 4
MAX_TOKENS = 32
SAMPLING = SamplingConfig(n=M, temperature=1.0, top_p=0.7, max_tokens=MAX_TOKENS, seed=0)
#: verdicts given without executing anything (the sandbox is never asked)
NO_EXECUTION = {"parse_error", "wrong_kind", "unknown_tool"}


@pytest.fixture(scope="module")
def bfcl():
    from pivotrl.bfcl.data import load_bfcl
    from pivotrl.bfcl.wheel import ensure_bfcl
    from pivotrl.data.states import extract_turn_states

    cache = os.environ["PIVOTRL_CACHE_DIR"]
    root = ensure_bfcl(cache)
    (traj,) = load_bfcl(["multi_turn_base"], cache, limit_per_category=2)[1:]  # multi_turn_base_1
    states = [s for s in extract_turn_states(traj) if s.verifier_context["default_verifier"] == "execution"][:6]
    assert [format_action(s.demo_action) for s in states] == [
        "[ls(a=True)]", "[cd(folder='workspace')]", "[mv(destination='archive', source='log.txt')]",
        "[cd(folder='archive')]", "[grep(file_name='log.txt', pattern='Error')]", "[tail(file_name='log.txt', lines=20)]",
    ]
    return root, states


@pytest.fixture(scope="module")
def engine(bfcl):
    """The tiny model after 12 full-batch AdamW steps on the six demonstration actions."""
    import torch

    from pivotrl.format.prompts import encode_state
    from pivotrl.rollout.hf import TransformersEngine
    from pivotrl.testing import tiny_llama

    _, states = bfcl
    tok = tiny_tokenizer()
    model = tiny_llama(tok, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3)
    examples = []
    for s in states:
        prompt = encode_state(s, tok, max_len=2048 - MAX_TOKENS, **PROMPT)
        action = tok(format_action(s.demo_action), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples.append((torch.tensor([prompt + action]), torch.tensor([[-100] * len(prompt) + action])))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(12):
            opt.zero_grad()
            for ids, labels in examples:
                (model(input_ids=ids, labels=labels).loss / len(examples)).backward()
            opt.step()
    model.eval()
    return TransformersEngine(model, tok, max_model_len=2048), tok


def run_config(tmp_path, *overrides: str):
    return load_config(None, [f"run.storage_root={tmp_path}", "verifier.name=execution", "verifier.timeout_s=30",
                              *overrides])


def probe(engine, states, verifier):
    eng, tok = engine
    t0 = time.monotonic()
    df = probe_states(eng, tok, states, verifier, num_probes=M, sampling=SAMPLING, max_context=2048,
                      max_tokens=MAX_TOKENS, prompt_kwargs=PROMPT, progress=False)
    return df, time.monotonic() - t0


@pytest.fixture(scope="module")
def clean(bfcl, engine, tmp_path_factory):
    root, states = bfcl
    verifier = make_verifier(run_config(tmp_path_factory.mktemp("clean"), "verifier.retries=8"), root, engine[1], backoff_s=0.01)
    try:
        df, wall = probe(engine, states, verifier)
    finally:
        verifier.close()
    print(f"\nfault-free probing: {wall:.2f} s, {verifier.stats.calls} sandbox requests")
    return df, verifier.stats


def test_the_fault_free_table_is_consistent(clean):
    df, stats = clean
    assert list(df["status"]) == ["ok"] * 6
    assert list(df["verifier_retries"]) == [0] * 6 and stats.retries == 0
    executed = 0
    for row in df.itertuples():
        rewards, reasons = json.loads(row.rewards), json.loads(row.reasons)
        assert len(rewards) == M and rewards == [1.0 if r == "match" else 0.0 for r in reasons]
        assert row.mu == sum(rewards) / M and row.var == pytest.approx(row.mu * (1 - row.mu))
        executed += any(r not in NO_EXECUTION for r in reasons)
    # One sandbox request per state with at least one action to execute (distinct actions batched).
    assert stats.calls == executed >= 4
    decisions = apply_pivot_filter(df, 0.5)["decision"]
    assert "kept" in set(decisions) or "above_threshold" in set(decisions)  # some states have mixed outcomes


def test_injected_tool_faults_change_nothing_but_the_retry_count(bfcl, engine, clean, tmp_path):
    root, states = bfcl
    clean_df, clean_stats = clean
    cfg = run_config(tmp_path, "verifier.retries=8", "faults.tool_failure_rate=0.3", "faults.tool_latency_s=0.05")
    verifier = make_verifier(cfg, root, engine[1], backoff_s=0.01)
    try:
        df, wall = probe(engine, states, verifier)
        injector = verifier.pool.faults
    finally:
        verifier.close()
    assert injector is not None and injector.seed == fault_seed(0, "tools")
    # The probe table (samples, rewards, μ̂, σ̂², reasons, statuses) is identical to the fault-free one.
    cols = [c for c in df.columns if c != "verifier_retries"]
    assert df[cols].equals(clean_df[cols])
    lam = 0.5
    a, b = apply_pivot_filter(df, lam), apply_pivot_filter(clean_df, lam)
    assert list(a["decision"]) == list(b["decision"])
    assert list(a.loc[a["decision"] == "kept", "state_id"]) == list(b.loc[b["decision"] == "kept", "state_id"])
    # Every injected crash cost exactly one retry; none ran out.
    retries = int(df["verifier_retries"].sum())
    assert retries == verifier.stats.retries == injector.failures > 0
    assert verifier.stats.failures == 0
    assert injector.drawn == clean_stats.calls + retries  # one draw per attempt
    stats = pivot_stats(a, lam)
    assert stats["verifier_retries"] == retries and stats["total"]["skipped_verifier_error"] == 0
    assert f"Verifier retries (tool requests repeated after a crash or timeout): {retries};" in stats_markdown(stats)
    print(f"\n30% injected failures, ≤ 0.05 s latency: {retries} retries over {injector.drawn} requests, "
          f"per state {list(df['verifier_retries'])}, {wall:.2f} s")


def test_without_retries_a_failed_state_is_dropped_never_scored_zero(bfcl, engine, clean):
    root, states = bfcl
    clean_df, _ = clean
    with SandboxPool(timeout_s=30, bfcl_root=root, faults=FaultInjector(1.0, 0.0, seed=1)) as pool:
        from pivotrl.verifiers import get_verifier

        verifier = get_verifier("execution", pool=pool, retries=0)
        df, _ = probe(engine, states, verifier)
    needs_sandbox = [any(r not in NO_EXECUTION for r in json.loads(x)) for x in clean_df["reasons"]]
    assert list(df["status"]) == ["verifier_error" if n else "ok" for n in needs_sandbox]
    dropped = df[df["status"] == "verifier_error"]
    assert len(dropped) >= 4
    assert all(json.loads(r) == [] for r in dropped["rewards"]) and dropped["mu"].isna().all()
    assert all("injected tool fault" in r and "after 0 retries" in r for r in dropped["reason"])
    assert list(dropped["verifier_retries"]) == [0] * len(dropped)
    # States decided without the sandbox keep their real (all-zero: unparsable) rewards.
    kept = df[df["status"] == "ok"]
    assert kept[["state_id", "rewards"]].equals(clean_df[df["status"] == "ok"][["state_id", "rewards"]])
    stats = pivot_stats(apply_pivot_filter(df, 0.5), 0.5)
    assert stats["total"]["skipped_verifier_error"] == len(dropped)
    assert stats["total"]["candidates"] == 6


@pytest.mark.parametrize("tool, limit, reason", [
    ("pivotrl.envs.sandbox_worker:_fn_sleep", {"timeout_s": 1.0}, "timed out after 1 s"),       # sleeps forever
    ("pivotrl.envs.sandbox_worker:_fn_allocate", {"memory_mb": 256}, "256 MiB memory limit"),   # allocates without bound
])
def test_a_runaway_tool_is_stopped_and_probing_goes_on(bfcl, engine, tool, limit, reason):
    from pivotrl.verifiers import get_verifier

    root, states = bfcl
    opts = {"timeout_s": 20.0, **limit}
    # The verifier's sandbox function replaced by a runaway one: every execution request runs away.
    with SandboxPool(bfcl_root=root, functions={"bfcl.execute_candidates": tool}, **opts) as pool:
        verifier = get_verifier("execution", pool=pool, retries=1, backoff_s=0.0)
        t0 = time.monotonic()
        df, _ = probe(engine, states[:2], verifier)
        wall = time.monotonic() - t0
        assert pool.replaced == 4  # 2 states × 2 attempts, each worker killed and replaced
        assert pool.call("echo", [1]) == [1]  # the pool still works
    assert list(df["status"]) == ["verifier_error"] * 2
    assert all(reason in r for r in df["reason"]) and list(df["verifier_retries"]) == [1, 1]
    print(f"\nrunaway tool {tool.split(':')[1]}: 4 attempts stopped in {wall:.2f} s")


def test_fault_draws_are_seeded_private_and_wired_from_the_config(bfcl, tmp_path):
    import random

    random.seed(123)
    before = random.random()
    a, b = FaultInjector(0.3, 0.05, seed=7), FaultInjector(0.3, 0.05, seed=7)
    draws = [a.draw() for _ in range(200)]
    assert draws == [b.draw() for _ in range(200)]
    random.seed(123)
    assert random.random() == before  # the global RNG was not touched
    assert 40 <= sum(d.fail for d in draws) == a.failures <= 80 and a.drawn == 200
    assert all(0.0 <= d.latency_s <= 0.05 for d in draws)
    assert not any(d.fail for d in (FaultInjector(0.0, 0.05, seed=7).draw() for _ in range(50)))
    assert len({fault_seed(0, "tools"), fault_seed(0, "storage"), fault_seed(0, "storage", 1), fault_seed(1, "tools")}) == 4
    with pytest.raises(ConfigError, match=r"faults.tool_failure_rate = 1.5: must be in \[0, 1\]"):
        FaultInjector(1.5)
    # make_verifier hands the run's faults and retries to the execution verifier, also through auto.
    root, states = bfcl
    cfg = load_config(None, [f"run.storage_root={tmp_path}", "verifier.retries=5", "faults.tool_failure_rate=0.25"])
    auto = make_verifier(cfg, root, tiny_tokenizer())
    ex = auto.verifier_for(states[0])
    assert ex.retries == 5 and ex.pool.faults.tool_failure_rate == 0.25 and ex.pool.faults.seed == fault_seed(0, "tools")
    auto.close()
    plain = make_verifier(run_config(tmp_path), root, tiny_tokenizer())
    assert plain.pool.faults is None  # no faults configured: none injected
    plain.close()

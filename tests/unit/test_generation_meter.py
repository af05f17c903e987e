"""Generation MFU accounting (pivotrl.runtime.generation) on the tiny model, the engines' meters,
the report's generation rows and progress counted inside one engine pass."""

from __future__ import annotations

import pandas as pd
import pytest

from pivotrl.rollout.base import Generation, SamplingConfig, generate_groups
from pivotrl.runtime.generation import GenerationMeter, request_flops, shape_of_checkpoint, since, snapshot
from pivotrl.runtime.mfu import ModelShape, forward_flops
from pivotrl.testing import save_tiny_checkpoint, tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_tokenizer()
    return tok, tiny_llama(tok)


def test_request_flops_counts_prefill_after_cache_decode_and_head(tiny) -> None:
    _, model = tiny
    shape = ModelShape.of_model(model)
    v = model.config.vocab_size
    # tiny: 2 layers, hidden 128, 2 heads × 64, tied head V×128
    assert (shape.n_head, shape.n_layers, shape.attn_dim) == (v * 128, 2, 128)
    assert shape.n_body == sum(p.numel() for p in model.parameters()) - v * 128
    # P = 10 with 4 cached; samples of 3 and 1 tokens: fed 6 + 2 + 0, pairs (55 - 10) + (11 + 12), logits 4
    got = request_flops(shape, 10, 4, [3, 1])
    assert got == forward_flops(shape, 8, 4, 68)
    assert got == 2 * shape.n_body * 8 + 2 * v * 128 * 4 + 4 * 2 * 128 * 68
    # no cache, one sample of one token: the prompt only, one logits row
    assert request_flops(shape, 5, 0, [1]) == forward_flops(shape, 5, 1, 15)
    # two prefill passes (vLLM's child requests): the first computes all 10 tokens, the second the
    # 2 past its 8 cached ones (positions 9, 10: 19 pairs); the decode as above
    assert request_flops(shape, 10, [0, 8], [3, 1]) == forward_flops(shape, 10 + 2 + 2, 4, 55 + 19 + 23)
    assert request_flops(shape, 10, [4], [3, 1]) == request_flops(shape, 10, 4, [3, 1])


def test_checkpoint_shape_equals_the_model_shape(tiny, tmp_path) -> None:
    _, model = tiny
    ckpt = save_tiny_checkpoint(tmp_path / "tiny")
    assert shape_of_checkpoint(ckpt, model.config) == ModelShape.of_model(model)
    assert shape_of_checkpoint(tmp_path / "none", model.config) is None


def test_meter_totals_metrics_and_mfu(tiny) -> None:
    _, model = tiny
    shape = ModelShape.of_model(model)
    meter = GenerationMeter(shape, threads=2, dtype="bfloat16")

    class Eng:
        pass

    eng = Eng()
    eng.meter = meter
    before = snapshot(eng)
    meter.record(10, 4, [3, 1])
    meter.record(7, None, [2])
    meter.add_seconds(0.5)
    gen = since(eng, before)
    flops = request_flops(shape, 10, 4, [3, 1]) + request_flops(shape, 7, 0, [2])
    assert (gen.requests, gen.samples, gen.prompt_tokens, gen.prefill_tokens, gen.generated_tokens) == (2, 3, 17, 13, 6)
    assert gen.flops == pytest.approx(flops) and gen.dtype == "bf16"
    m = gen.metrics(10.0)
    assert m["gen_tflop"] == pytest.approx(flops / 1e12) and m["gen_tokens_per_s"] == pytest.approx(12.0)
    assert m["gen_peak_gflops"] == 20.0 and m["gen_mfu"] == pytest.approx(flops / 0.5 / 20e9)
    assert "gen_mfu" not in gen.metrics(None) and snapshot(object()) is None
    assert gen.counters(10.0)["gen MFU %"] == round(100 * m["gen_mfu"], 2)
    # a pool sums its engines (threads side by side)
    pool = Eng()
    pool.engines = [eng, eng]
    assert snapshot(pool).threads == 4 and snapshot(pool).flops == pytest.approx(2 * flops)


def test_engines_side_by_side_sum_their_counts_over_the_longest_time() -> None:
    from pivotrl.runtime.generation import GenerationTotals, side_by_side

    a = GenerationTotals(requests=2, samples=8, prompt_tokens=100, prefill_tokens=90, generated_tokens=40,
                         flops=4e9, seconds=2.0, threads=2, dtype="fp32")
    b = GenerationTotals(requests=3, samples=12, prompt_tokens=150, prefill_tokens=150, generated_tokens=60,
                         flops=6e9, seconds=3.0, threads=2, dtype="fp32")
    both = side_by_side([a, None, b])  # None: a rank without an engine
    assert (both.requests, both.samples, both.prompt_tokens, both.prefill_tokens, both.generated_tokens) == \
        (5, 20, 250, 240, 100)
    assert (both.flops, both.seconds, both.threads) == (1e10, 3.0, 4)
    assert both.mfu(1.0) == pytest.approx(1e10 / 3.0 / 4e9)  # four threads for three seconds
    assert side_by_side([a]) == a and side_by_side([None, None]) is None and side_by_side([]) is None


def test_vllm_engine_meters_each_child_request_from_the_engine_statistics(tiny) -> None:
    """VLLMEngine._collect takes each child request's cached prompt tokens from PrefillStats (fed
    by vLLM's engine loop like a stat logger); a request whose children are not all there (no
    statistics) falls back to the request's one num_cached_tokens."""
    from types import SimpleNamespace as NS

    from pivotrl.rollout.vllm import VLLMEngine
    from pivotrl.rollout.vllm_stats import PrefillStats

    _, model = tiny
    shape = ModelShape.of_model(model)
    stats = PrefillStats()
    # one engine step: request "7" (n = 3) admitted (queries 3 × 300, hits 2 × 256), its children finished
    stats.record(NS(prefix_cache_stats=NS(queries=900, hits=512)),
                 NS(finished_requests=[NS(request_id="7", num_cached_tokens=c) for c in (0, 256, 256)]))
    stats.record(None, None)  # a step without statistics
    assert (stats.queries, stats.hits, stats.cached) == (900, 512, {"7": [0, 256, 256]})
    stats.log(), stats.log_engine_initialized(), stats.record_sleep_state(0, 0), stats.record_admission_rejection("x")

    def out(rid, prompt_len, cached, lengths):
        return NS(request_id=rid, prompt_token_ids=[1] * prompt_len, num_cached_tokens=cached,
                  outputs=[NS(index=i, token_ids=[5] * n, logprobs=[{5: NS(logprob=-0.5)}] * n, finish_reason="length",
                              text="x" * n) for i, n in enumerate(lengths)])

    eng = object.__new__(VLLMEngine)
    eng.meter, eng.prefill_stats = GenerationMeter(shape, threads=1, dtype="float32"), stats
    gens = eng._collect([out("7", 300, 256, [4, 2, 3]), out("8", 50, 16, [2])], None)
    assert [[len(g.token_ids) for g in row] for row in gens] == [[4, 2, 3], [2]]
    gen = eng.meter.totals()
    # request 7: 300 + 44 + 44 computed (= queries − hits), not the 44 of the last child; request 8
    # has no statistics: 50 − 16
    assert (gen.requests, gen.samples, gen.prompt_tokens, gen.prefill_tokens) == (2, 4, 350, 388 + 34)
    assert gen.flops == pytest.approx(request_flops(shape, 300, [0, 256, 256], [4, 2, 3])
                                      + request_flops(shape, 50, 16, [2]))
    assert stats.cached == {}
    stats.record(None, NS(finished_requests=[NS(request_id="9", num_cached_tokens=0)]))
    eng._forget_requests()  # a scoring call's requests: not metered, not kept
    assert stats.cached == {}


def test_transformers_engine_feeds_its_meter(tiny) -> None:
    from pivotrl.rollout.hf import TransformersEngine

    tok, model = tiny
    eng = TransformersEngine(model, tok, max_model_len=256)
    prompts = [[1, 5, 9, 11], [2, 7, 3]]
    gens = eng.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_tokens=5, seed=3))
    gen = eng.meter.totals()
    shape = ModelShape.of_model(model)
    assert (gen.requests, gen.prompt_tokens, gen.prefill_tokens) == (2, 7, 7)
    assert gen.generated_tokens == sum(len(g.token_ids) for row in gens for g in row)
    assert gen.flops == pytest.approx(sum(request_flops(shape, len(p), 0, [len(g.token_ids) for g in row])
                                          for p, row in zip(prompts, gens)))
    assert gen.seconds > 0 and gen.dtype == "fp32"


def test_report_carries_generation_speed() -> None:
    from pivotrl.evaluation.report_data import policy_row
    from pivotrl.evaluation.report_speed import generation_speed, speed_lines

    df = pd.DataFrame([{"step": 1, "gen_prefill_tokens": 100.0, "gen_tokens": 40.0, "gen_tflop": 0.002, "gen_s": 2.0,
                        "gen_peak_gflops": 50.0},
                       {"step": 2, "gen_prefill_tokens": 60.0, "gen_tokens": 20.0, "gen_tflop": 0.001, "gen_s": 1.0,
                        "gen_peak_gflops": 50.0, "heldout_gen_tokens": 5.0, "heldout_gen_tflop": 0.0005,
                        "heldout_gen_s": 0.5, "heldout_gen_prefill_tokens": 30.0}])
    row = policy_row("policy", {"local": {"accuracy": 0.5, "gen_tokens": 9.0, "gen_tflop": 0.001, "gen_s": 1.0,
                                          "gen_prefill_tokens": 12.0, "gen_mfu": 0.02, "gen_peak_gflops": 50.0}})
    assert row["local_gen_mfu"] == 0.02 and row["local_gen_tokens"] == 9.0
    speed = generation_speed(df, [row])
    assert speed["training rollouts"]["tokens"] == 60.0 and speed["training rollouts"]["tokens_per_s"] == 20.0
    assert speed["training rollouts"]["mfu"] == pytest.approx(0.003e3 / 3.0 / 50.0)
    assert "mfu" not in speed["learning curve"]  # no peak recorded
    assert speed["evaluation: policy"]["mfu"] == pytest.approx(0.001e3 / 1.0 / 50.0)
    text = "\n".join(speed_lines({}, {}, speed))
    assert "generation, training rollouts (160 prompt tokens prefilled, 60 generated; forward)" in text
    assert "| 2.0 % |" in text
    assert generation_speed(None, [policy_row("x", {})]) == {}


def test_progress_counts_prompts_inside_one_pass() -> None:
    from pivotrl.core.progress import Progress
    from pivotrl.rollout.vllm_stats import Ticks

    # vLLM's engine loop: a tqdm-like class, called with an iterable (rendering) or total= (requests)
    seen: list[int] = []
    ticks = Ticks(seen.append)
    assert list(ticks([1, 2], desc="Rendering prompts")) == [1, 2]
    bar = ticks(total=3, desc="Processed prompts", postfix="")
    bar.update(4)  # one request with n = 4 samples finished
    bar.update(4)
    assert seen == [1, 1] and bar.n == 8 and bar.format_dict["elapsed"] > 0

    class Pass:  # an engine serving the groups in one pass, finishing prompts one by one
        def generate_groups(self, groups, on_done=None):
            for prompts, _ in groups:
                for _ in prompts:
                    lines.append(bar.line())
                    on_done(1)
            return [[[Generation([1], "a", [0.0], "stop")] for _ in prompts] for prompts, _ in groups]

    class Plain:  # no generate_groups: one generate call per batch
        def generate(self, prompts, sampling):
            lines.append(bar.line())
            return [[Generation([1], "a", [0.0], "stop")] for _ in prompts]

    groups = [([[1, 2], [3]], SamplingConfig()), ([[4]], SamplingConfig())]
    for engine, want in ((Pass(), ["0/3", "1/3", "2/3"]), (Plain(), ["0/3", "2/3"])):
        lines = []
        with Progress("evaluation", 3, "states", emit=lambda _: None) as bar:
            generate_groups(engine, groups, on_done=bar.update)
            assert bar.done == 3
        assert [x.split(": ")[1].split(" ")[0] for x in lines] == want
        assert "ETA unknown" in lines[0] and "ETA" in lines[-1] and "unknown" not in lines[-1]


def test_a_pool_of_engines_that_generate_together_counts_its_own_wall_time(tiny) -> None:
    """Two engines of a pool generate at the same time: the pool's generation seconds are its wall
    time, not the sum of its engines' (which halved tok/s and MFU with two engines)."""
    import time

    from pivotrl.rollout.pool import EnginePool

    _, model = tiny
    shape = ModelShape.of_model(model)

    class Slow:
        def __init__(self) -> None:
            self.meter = GenerationMeter(shape, threads=1, dtype="fp32")

        def generate(self, prompts, sampling, *, positions=None, seeds=None):
            with self.meter.timed():
                time.sleep(1.0)
                for p in prompts:
                    self.meter.record(len(p), 0, [2])
            return [[None] for _ in prompts]

    one, two = Slow(), Slow()
    pool = EnginePool([one, two])
    before = snapshot(pool)
    pool.generate([[1, 2, 3]] * 4, object())
    gen = since(pool, before)
    own = [e.meter.totals() for e in (one, two)]
    assert all(t.seconds >= 1.0 for t in own)
    assert (gen.requests, gen.generated_tokens, gen.threads) == (4, 8, 2)
    assert gen.flops == pytest.approx(sum(t.flops for t in own))
    # the pool's wall: at least the slower engine's time, well under the two engines' sum (a margin
    # of half an engine's time: thread start-up on a loaded machine has taken 0.1 s)
    assert max(t.seconds for t in own) <= gen.seconds < sum(t.seconds for t in own) - 0.5
    assert gen.seconds == pytest.approx(pool.generation_seconds)
    # one engine: that engine's own totals
    solo = EnginePool([Slow()])
    solo.generate([[1, 2]], object())
    assert snapshot(solo) == solo.engines[0].meter.totals()

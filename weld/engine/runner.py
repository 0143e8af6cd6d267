"""The model runner: turns a scheduler plan into device arrays of bucketed shapes and runs one
jitted program (forward over the paged cache, then sampling and logprobs on device).

Shapes are rounded up to a small set of buckets (powers of two for batch rows and tokens per
row); block tables always have the width of the longest sequence (attention loops only over
the pages in use), so sequences growing never recompile. `num_compiles` counts the distinct
programs this runner has asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weld.engine.sampler import SamplingArrays, sample, token_logprobs
from weld.engine.sampling_params import MAX_LOGPROBS
from weld.engine.scheduler import ScheduledSeq, SchedulerOutput
from weld.models.common.cache import AttentionBatch, PagedKVCache


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass
class StepResult:
    """Host copies of what one call produced, row i for plan entry i."""

    token_ids: np.ndarray  # [n] sampled ids (meaningful where entry.sample)
    logprobs: np.ndarray | None  # [n] raw logprob of the sampled id
    ranks: np.ndarray | None  # [n]
    top_ids: np.ndarray | None  # [n, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None  # [n, MAX_LOGPROBS]
    # Prompt logprobs: for entry i and fed token j, the logprob of the token after it.
    prompt_logprobs: np.ndarray | None = None  # [n, t]
    prompt_ranks: np.ndarray | None = None  # [n, t]
    prompt_top_ids: np.ndarray | None = None  # [n, t, MAX_LOGPROBS]
    prompt_top_logprobs: np.ndarray | None = None  # [n, t, MAX_LOGPROBS]


def _step(forward, weights, cache, tokens, positions, block_tables, last_index, sampling,
          prompt_targets, *, cfg, num_top: int, with_prompt_logprobs: bool):
    """forward + sample for one padded batch. Shapes: tokens/positions [b, t], last_index [b]."""
    batch = AttentionBatch(block_tables=block_tables)
    if with_prompt_logprobs:
        logits, _, cache = forward(weights, cfg, tokens, positions, cache, batch)  # [b, t, v]
        last_logits = jnp.take_along_axis(logits, last_index[:, None, None], axis=1)[:, 0]
        prompt = token_logprobs(logits, prompt_targets, num_top)
    else:
        logits, _, cache = forward(weights, cfg, tokens, positions, cache, batch, last_index[:, None])
        last_logits = logits[:, 0]
        prompt = None
    ids = sample(last_logits, sampling)
    chosen = token_logprobs(last_logits, ids, num_top) if num_top else None
    return cache, ids, chosen, prompt


class ModelRunner:
    """Owns the weights, the KV page pools and the jitted step program."""

    def __init__(self, family: ModuleType, cfg: Any, weights: Any, *, num_pages: int, page_size: int,
                 kv_dtype: Any, max_model_len: int):
        self.family = family
        self.cfg = cfg
        self.weights = weights
        self.page_size = page_size
        self.max_pages_per_seq = bucket(-(-max_model_len // page_size), 8)
        self.cache = PagedKVCache.create(cfg.kv_spec, num_pages, page_size, kv_dtype)
        self._programs: set[tuple] = set()
        self._step = jax.jit(functools.partial(_step, family.forward),
                             static_argnames=("cfg", "num_top", "with_prompt_logprobs"),
                             donate_argnames=("cache",))

    @property
    def num_compiles(self) -> int:
        """Distinct program shapes requested so far (each compiled once)."""
        return len(self._programs)

    def execute(self, plan: SchedulerOutput, want_logprobs: bool = False,
                want_prompt_logprobs: bool = False) -> StepResult:
        entries = plan.entries
        n = len(entries)
        b = bucket(n)
        t = 1 if plan.kind == "decode" else bucket(max(e.num_tokens for e in entries), 16)
        pages = self.max_pages_per_seq

        tokens = np.zeros((b, t), np.int32)
        positions = np.full((b, t), -1, np.int32)
        block_tables = np.zeros((b, pages), np.int32)
        last_index = np.zeros((b,), np.int32)
        targets = np.zeros((b, t), np.int32)
        temperature = np.zeros((b,), np.float32)
        top_k = np.zeros((b,), np.int32)
        top_p = np.ones((b,), np.float32)
        min_p = np.zeros((b,), np.float32)
        seed_hi = np.zeros((b,), np.uint32)
        seed_lo = np.zeros((b,), np.uint32)
        sample_pos = np.zeros((b,), np.int32)
        for i, e in enumerate(entries):
            seq, p = e.seq, e.seq.params
            ids = _tokens_of(e)
            tokens[i, :e.num_tokens] = ids
            positions[i, :e.num_tokens] = np.arange(e.start, e.start + e.num_tokens)
            block_tables[i, :len(seq.block_table)] = seq.block_table
            last_index[i] = e.num_tokens - 1
            if want_prompt_logprobs:
                # The target of fed token j is the token after it, where that is known.
                nxt = [seq.token_at(pos + 1) if pos + 1 < seq.num_tokens else 0
                       for pos in range(e.start, e.start + e.num_tokens)]
                targets[i, :e.num_tokens] = nxt
            temperature[i] = 0.0 if p.greedy else p.temperature
            top_k[i] = p.top_k if p.top_k > 0 else 0
            top_p[i] = p.top_p
            min_p[i] = p.min_p
            seed_hi[i] = (seq.seed >> 32) & 0xFFFFFFFF
            seed_lo[i] = seq.seed & 0xFFFFFFFF
            sample_pos[i] = e.start + e.num_tokens

        sampling = SamplingArrays(
            temperature=jnp.asarray(temperature), top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p),
            min_p=jnp.asarray(min_p), seed_hi=jnp.asarray(seed_hi), seed_lo=jnp.asarray(seed_lo),
            position=jnp.asarray(sample_pos))
        num_top = MAX_LOGPROBS if want_logprobs or want_prompt_logprobs else 0
        self._programs.add((b, t, num_top, want_prompt_logprobs))
        self.cache, ids, chosen, prompt = self._step(
            self.weights, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
            jnp.asarray(block_tables), jnp.asarray(last_index), sampling, jnp.asarray(targets),
            cfg=self.cfg, num_top=num_top, with_prompt_logprobs=want_prompt_logprobs)
        ids, chosen, prompt = jax.device_get((ids, chosen, prompt))
        result = StepResult(token_ids=ids[:n], logprobs=None, ranks=None, top_ids=None, top_logprobs=None)
        if chosen is not None:
            result.logprobs, result.ranks, result.top_ids, result.top_logprobs = (x[:n] for x in chosen)
        if prompt is not None:
            (result.prompt_logprobs, result.prompt_ranks, result.prompt_top_ids,
             result.prompt_top_logprobs) = (x[:n] for x in prompt)
        return result


def _tokens_of(entry: ScheduledSeq) -> list[int]:
    seq = entry.seq
    all_ids = seq.prompt_token_ids + seq.output_token_ids
    return all_ids[entry.start:entry.start + entry.num_tokens]

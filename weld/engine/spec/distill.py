"""The drafter's training data: the target's own answers to a prompt set, on disk, resumable.

DeepSpec's recipe trains a drafter on self-distilled data: the target answers each prompt (as a
chat user message, or raw text) at its sampling settings, and the drafter learns to predict
those answers from the target's hidden states. `generate` writes one JSON line per answer
(`sequences.jsonl`: prompt index, sample index, prompt length, token ids) as answers finish, in
batches; a rerun reads the file, keeps every complete line and generates only what is missing,
so an interrupted run loses at most one batch. `read_sequences` reads the file back.

Samples: sample 0 is greedy, the others are drawn at `SAMPLED` (llama.cpp's and weld's CLI
defaults), each with its own seed, so a prompt's answers differ.

On an accelerator the greedy answers come from `generate_fixed` instead of the engine: one
program of one shape (prefill, then a device loop of decode steps over the model's own
`forward`), where the engine compiles a program for each batch shape it meets, 10-35 s each on a
TPU v5e (a round of 1,024 requests made no progress there in 274 s).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Iterator, Sequence

from weld.engine.sampling_params import DEFAULT_SAMPLING
from weld.utils.errors import InvalidInputError
from weld.utils.progress import Progress

SEQUENCES_FILE = "sequences.jsonl"
# The most cache `generate_fixed` allocates (rows x (prompt + new tokens)), and at most half the
# device's memory where it says: --max-num-seqs is the user's, so bounded before anything is made.
FIXED_CACHE_BYTES = 16 * 2**30
# The sampling of samples 1, 2, ...: the CLI's defaults (sample 0 is greedy).
SAMPLED = DEFAULT_SAMPLING


def read_prompts(path: str | pathlib.Path) -> list[str]:
    """Prompts from a text file: paragraphs (separated by blank lines) if it has any, else lines."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InvalidInputError(f"{path}: no such file (expected a text file of prompts)")
    text = path.read_text(encoding="utf-8").strip()
    if "\n\n" in text:  # a paragraph's lines are one prompt
        prompts = [" ".join(paragraph.split()) for paragraph in text.split("\n\n")]
    else:
        prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise InvalidInputError(f"{path} holds no prompts")
    return prompts


def read_prompt_files(paths: str | pathlib.Path | Sequence[str | pathlib.Path]) -> list[str]:
    """`read_prompts` of one file, or of several, one after another (the answers' prompt indices
    count through them in that order)."""
    if isinstance(paths, (str, pathlib.Path)):
        paths = [paths]
    return [prompt for path in paths for prompt in read_prompts(path)]


@dataclasses.dataclass(frozen=True)
class Answer:
    """One of the target's answers: prompt + continuation as token ids."""

    prompt_index: int
    sample: int
    prompt_length: int
    tokens: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"prompt": self.prompt_index, "sample": self.sample, "prompt_length": self.prompt_length,
                           "tokens": list(self.tokens)}, separators=(",", ":"))


def read_sequences(path: str | pathlib.Path) -> list[Answer]:
    """Every complete line of a sequences file (a torn last line, from an interrupted run, is skipped)."""
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    answers = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break  # the write was cut off: it is generated again
            try:
                row = json.loads(line)
                answer = Answer(int(row["prompt"]), int(row["sample"]), int(row["prompt_length"]),
                                tuple(int(t) for t in row["tokens"]))
            except (ValueError, KeyError, TypeError) as err:
                raise InvalidInputError(f"{path}:{number}: not a sequence record ({err})") from None
            answers.append(answer)
    return answers


def complete_answers(out_dir: str | pathlib.Path, num_prompts: int, samples: int) -> list[Answer] | None:
    """Every answer `generate` would return, read from out_dir/sequences.jsonl, or None while
    some are still to be generated."""
    done = {(a.prompt_index, a.sample): a for a in read_sequences(pathlib.Path(out_dir) / SEQUENCES_FILE)}
    keys = [(i, s) for i in range(num_prompts) for s in range(samples)]
    return [done[key] for key in keys] if all(key in done for key in keys) else None


def _truncate_torn_line(path: pathlib.Path) -> None:
    """Drops a last line without its newline, so that appending starts on a fresh line."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)


def _answers_so_far(out_dir: str | pathlib.Path) -> tuple[pathlib.Path, dict[tuple[int, int], Answer]]:
    """(out_dir/sequences.jsonl, its complete answers by (prompt, sample)), the file ready to
    append to (created, a torn last line cut off)."""
    path = pathlib.Path(out_dir) / SEQUENCES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    _truncate_torn_line(path)
    return path, {(a.prompt_index, a.sample): a for a in read_sequences(path)}


def sampling_for(sample: int, seed: int, max_new_tokens: int):
    """The SamplingParams of answer `sample` (0: greedy) of a prompt, seeded by `seed`."""
    from weld.engine.sampling_params import SamplingParams

    if sample == 0:
        return SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    return SamplingParams(max_tokens=max_new_tokens, seed=seed, **SAMPLED)


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def generate(llm: Any, prompts: Sequence[str], out_dir: str | pathlib.Path, *, max_new_tokens: int,
             samples: int = 1, chat: bool = True, seed: int = 0, batch_size: int = 256,
             progress: bool | None = None, log=print) -> list[Answer]:
    """The target's answers to every prompt (samples per prompt), appended to
    out_dir/sequences.jsonl as each batch finishes; answers already in the file are kept.
    Returns every answer, in (prompt, sample) order."""
    if samples < 1:
        raise InvalidInputError(f"samples per prompt must be >= 1, got {samples}")
    path, done = _answers_so_far(out_dir)
    todo = [(i, s) for i in range(len(prompts)) for s in range(samples) if (i, s) not in done]
    if done:
        log(f"{path}: {len(done)} answers already generated, {len(todo)} to go")
    with Progress(len(todo), "Generating answers", unit="answer", enabled=progress) as bar, \
            open(path, "a", encoding="utf-8") as f:
        for batch in _batches(todo, batch_size):
            requests = [prompts[i] for i, _ in batch]
            params = [sampling_for(s, seed * 1_000_003 + i * 31 + s, max_new_tokens) for i, s in batch]
            if chat:
                outs = llm.chat([[{"role": "user", "content": p}] for p in requests], params, use_tqdm=False)
            else:
                outs = llm.generate(list(requests), params, use_tqdm=False)
            for (i, s), out in zip(batch, outs):
                answer = Answer(i, s, len(out.prompt_token_ids),
                                tuple(out.prompt_token_ids) + tuple(out.outputs[0].token_ids))
                done[(i, s)] = answer
                f.write(answer.to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    return [done[key] for key in sorted(done) if key[0] < len(prompts) and key[1] < samples]


def prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """A prompt's token ids as `LLM.chat` (a user message) or `LLM.generate` (raw text) makes them."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             continue_final_message=False, tools=None)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def generate_fixed(family: Any, weights: dict, cfg: Any, tokenizer: Any, prompts: Sequence[str],
                   out_dir: str | pathlib.Path, *, max_new_tokens: int, chat: bool = True, rows: int = 64,
                   progress: bool | None = None, log=print) -> list[Answer]:
    """`generate`'s greedy answers (sample 0 of every prompt), from one jitted program of one
    shape: `rows` prompts at a time, each padded to the longest prompt (rounded up to 64), a
    prefill and then a `while_loop` of decode steps on a paged cache of rows x (prompt + new)
    tokens, until every row has stopped (EOS) or made max_new_tokens. Appended to
    out_dir/sequences.jsonl batch by batch, as `generate` does; answers already there are kept."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from weld.models.common.cache import AttentionBatch

    if rows < 1:
        raise InvalidInputError(f"rows must be >= 1, got {rows}")
    path, done = _answers_so_far(out_dir)
    todo = [i for i in range(len(prompts)) if (i, 0) not in done]
    if done:
        log(f"{path}: {len(done)} answers already generated, {len(todo)} to go")
    ids = {i: prompt_ids(tokenizer, prompts[i], chat) for i in todo}
    if not todo:
        return [done[key] for key in sorted(done) if key[0] < len(prompts) and key[1] == 0]
    page = 16
    width = -(-max(len(t) for t in ids.values()) // 64) * 64
    limit = cfg.max_position_embeddings
    if width + max_new_tokens > limit:
        longest = max(ids, key=lambda i: len(ids[i]))
        raise InvalidInputError(f"prompt {longest} takes {len(ids[longest])} tokens: with {max_new_tokens} new ones "
                                f"(padded to {width} + {max_new_tokens}) it exceeds the model's {limit} positions")
    pages = -(-(width + max_new_tokens) // page)
    spec = family.cache_spec(cfg)
    dtype = weights["final_norm"].dtype
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(lambda: spec.create(rows * pages, page, dtype))))
    budget = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", FIXED_CACHE_BYTES) // 2
    if cache_bytes > min(budget, FIXED_CACHE_BYTES):
        raise InvalidInputError(
            f"{rows} rows of {width} + {max_new_tokens} tokens need a {cache_bytes / 2**30:.1f} GiB cache, more than "
            f"{min(budget, FIXED_CACHE_BYTES) / 2**30:.1f} GiB (half the device's memory, at most "
            f"{FIXED_CACHE_BYTES // 2**30} GiB): use fewer rows (--max-num-seqs)")
    eos = np.zeros(cfg.vocab_size, bool)
    eos[[t for t in dict.fromkeys(tuple(tokenizer.eos_token_ids) + tuple(cfg.eos_token_ids)) if t < cfg.vocab_size]] = True

    @jax.jit
    def answer(weights, tokens, lengths, stops):
        cache = spec.create(rows * pages, page, dtype)
        batch = AttentionBatch(spec.tables(jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages)))
        positions = jnp.where(jnp.arange(width)[None, :] < lengths[:, None], jnp.arange(width)[None, :], -1)
        logits, _, cache = family.forward(weights, cfg, tokens, positions, cache, batch, (lengths - 1)[:, None])
        first = jnp.argmax(logits[:, 0].astype(jnp.float32), axis=-1).astype(jnp.int32)
        out = jnp.zeros((rows, max_new_tokens), jnp.int32).at[:, 0].set(first)

        def more(carry):
            step, _, _, _, stopped = carry
            return (step < max_new_tokens) & ~jnp.all(stopped)

        def decode(carry):
            step, last, cache, out, stopped = carry
            logits, _, cache = family.forward(weights, cfg, last[:, None], (lengths + step - 1)[:, None], cache, batch,
                                              jnp.zeros((rows, 1), jnp.int32))
            token = jnp.argmax(logits[:, 0].astype(jnp.float32), axis=-1).astype(jnp.int32)
            return step + 1, token, cache, out.at[:, step].set(token), stopped | stops[token]

        steps, _, _, out, _ = jax.lax.while_loop(more, decode, (jnp.int32(1), first, cache, out, stops[first]))
        return out, steps

    with Progress(len(todo), "Generating answers", unit="answer", enabled=progress) as bar, \
            open(path, "a", encoding="utf-8") as f:
        for start in range(0, len(todo), rows):
            chunk = todo[start:start + rows]
            tokens = np.zeros((rows, width), np.int32)
            lengths = np.ones(rows, np.int32)  # padding rows: one token, their answers dropped
            for r, i in enumerate(chunk):
                tokens[r, :len(ids[i])] = ids[i]
                lengths[r] = len(ids[i])
            out, steps = jax.device_get(answer(weights, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(eos)))
            for r, i in enumerate(chunk):
                new = [int(t) for t in out[r, :steps]]
                end = next((j for j, t in enumerate(new) if eos[t]), None)
                answer_ = Answer(i, 0, len(ids[i]), tuple(ids[i]) + tuple(new if end is None else new[:end + 1]))
                done[(i, 0)] = answer_
                f.write(answer_.to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(chunk))
    return [done[key] for key in sorted(done) if key[0] < len(prompts) and key[1] == 0]

"""Self-distillation of the DSpark drafter (`weld train-draft`), after DeepSpec's recipe.

Four stages, each resumable in the output directory (a rerun with the same settings picks up
where the last one stopped):

1. Answers (`distill.generate` -> data/sequences.jsonl): the target's own answers to a prompt
   set, greedy and at its sampling defaults. A share of the prompts (`eval_fraction`) is held
   out: their greedy answers only measure the drafter.
2. Features (`build_features` -> data/features/): one pass of the target over every answer,
   keeping per position the residual streams after the drafter's target layers (its context, f16)
   and the target's next-token distribution as its `TEACHER_TOP` most likely tokens (the teacher).
3. Training (`train` -> checkpoint/): each step draws answers and anchor positions in them; the
   drafter sees the context before the anchor and predicts the k tokens after it, the Markov
   head reading the true previous tokens (teacher forcing). The loss, per drafted slot j
   (0-based) weighted by exp(-j / position_decay) (early slots decide most of the acceptance):
     ce_weight   * cross-entropy to the target's token
   + tv_weight   * total variation 1/2 sum |p - q| to the target's distribution p
   + conf_weight * BCE of the confidence against [argmax q == the target's token]
   q is the drafter's softmax over its draft vocabulary (`dspark.DraftConfig.draft_vocab_size`:
   the tokens most frequent in the training answers, `draft_vocabulary`; the whole vocabulary
   when 0); teacher mass and labels outside it are out of its reach. The optimizer state is
   saved every `save_every` steps.
4. Report (`evaluate`): on the held-out answers, the drafter drafts on its own (its Markov head
   reading its own drafts) and greedy verification would keep the leading drafts equal to the
   target's tokens: the mean acceptance length (1 + accepted drafts: tokens per round),
   acceptance per position, and what the confidence head would send.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from weld.config import TRAIN_FEATURES
from weld.engine.spec import distill, dspark
from weld.engine.spec.distill import read_prompts  # noqa: F401  (re-exported: `train.read_prompts`)
from weld.engine.spec.features import target_hidden_states
from weld.models.common.layers import linear
from weld.models.family import output_matrix
from weld.utils.errors import InvalidInputError
from weld.utils.progress import Progress, progress_enabled

TEACHER_TOP = 32  # teacher tokens kept per position (their share of its mass is recorded)
FEATURES_DIR = "features"
CHECKPOINT_DIR = "checkpoint"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    lr: float = 1e-3
    warmup: int = 20
    batch_size: int = 4  # answers per step
    anchors: int = 16  # blocks per answer per step
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    position_decay: float = 4.0  # slot j weighs exp(-j / position_decay)
    clip_norm: float = 1.0
    save_every: int = 100  # steps between checkpoints
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "anchors", "save_every"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise InvalidInputError(f"the learning rate must be > 0, got {self.lr}")
        if not self.position_decay > 0:
            raise InvalidInputError(f"position_decay must be > 0, got {self.position_decay}")

    def slot_weights(self, k: int) -> np.ndarray:
        """[k]: exp(-j / position_decay), normalized to sum to 1."""
        w = np.exp(-np.arange(k) / self.position_decay)
        return (w / w.sum()).astype(np.float32)


# ----- data -----

@dataclasses.dataclass
class Dataset:
    """Answers (prompt + the target's continuation) with what the target computed over them.

    Per-position arrays are flat over every answer's positions ([total, ...]); answer i's rows
    are offsets[i] .. offsets[i] + lengths[i]. They may be memory maps."""

    tokens: np.ndarray  # int32 [total]
    offsets: np.ndarray  # int64 [N]
    lengths: np.ndarray  # int32 [N]
    prompt_lengths: np.ndarray  # int32 [N]
    # What the target computed (None: computed inside each training step, `online_teacher`):
    features: np.ndarray | None = None  # f16 [total, len(target_layers) * d]: the drafter's context
    teacher_ids: np.ndarray | None = None  # int32 [total, K]: the target's most likely next tokens after each position
    teacher_probs: np.ndarray | None = None  # f16 [total, K]: their probabilities (temperature 1)

    def __len__(self) -> int:
        return len(self.lengths)

    def answer(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i] + self.lengths[i]]

    def subset(self, rows: np.ndarray) -> "Dataset":
        """The answers `rows` (the per-position arrays are shared, not copied)."""
        return dataclasses.replace(self, offsets=self.offsets[rows], lengths=self.lengths[rows],
                                   prompt_lengths=self.prompt_lengths[rows])


def _teacher(family: Any, weights: dict, cfg: Any, tokens: jax.Array, *, layers: tuple[int, ...], top: int):
    """Target features f16 [b, t, n * d] and the teacher's top tokens and probabilities [b, t, top].

    Matrix products at full precision, so that features are the model's wherever they are made
    (a TPU's default multiplies f32 in one bf16 pass). Measured on SmolLM2 (2026-12-06): TPU
    features at either precision are within 1-2% of the CPU's, as close as the CPU's integer
    kernels are to its exact f32 path, so precision does not explain why drafters trained on a
    TPU failed on the CPU (benchmarks/results/spec_dspark_2026-12-06_evening.md)."""
    with jax.default_matmul_precision("highest"):
        features, final = target_hidden_states(family, weights, cfg, tokens, layers)
        probs = jax.nn.softmax(family.lm_head(weights, cfg, final).astype(jnp.float32), axis=-1)
    values, ids = top_k_by_chunks(probs, top)
    return features.astype(jnp.float16), ids.astype(jnp.int32), values.astype(jnp.float16)


def top_k_by_chunks(x: jax.Array, k: int, chunk: int = 128) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` over the last axis, exact, from the k chunks of `chunk` entries with
    the largest maxima (each of the k largest entries lies in one of them): two small top-ks instead
    of one over the whole row, 2.6x faster on a TPU v5e over 49,152 tokens. Ties may pick other
    indices of the same value."""
    *lead, v = x.shape
    groups = -(-v // chunk)
    if groups <= k:
        return jax.lax.top_k(x, k)
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, groups * chunk - v)], constant_values=-jnp.inf)
    blocks = padded.reshape(*lead, groups, chunk)
    _, chosen = jax.lax.top_k(blocks.max(axis=-1), k)  # [..., k]
    candidates = jnp.take_along_axis(blocks, chosen[..., None], axis=-2).reshape(*lead, k * chunk)
    values, at = jax.lax.top_k(candidates, k)
    return values, jnp.take_along_axis(chosen, at // chunk, axis=-1) * chunk + at % chunk


def _write_json(path: pathlib.Path, document: dict) -> None:
    """Writes a JSON file atomically (a crash leaves the old one or the new one)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(tmp, path)


def token_dataset(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], k: int) -> Dataset:
    """The answers alone (nothing the target computed). Answers whose continuation is shorter
    than k + 1 tokens (no room for one block) are dropped."""
    keep = [i for i, (s, p) in enumerate(zip(sequences, prompt_lengths)) if len(s) - p >= k + 1 and p >= 1]
    if not keep:
        raise InvalidInputError(f"no answer has a continuation of at least k + 1 = {k + 1} tokens")
    lengths = np.asarray([len(sequences[i]) for i in keep], np.int32)
    return Dataset(tokens=np.concatenate([np.asarray(sequences[i], np.int32) for i in keep]),
                   offsets=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), lengths=lengths,
                   prompt_lengths=np.asarray([prompt_lengths[i] for i in keep], np.int32))


def build_features(family: Any, target_weights: dict, target_cfg: Any, cfg: dspark.DraftConfig,
                   sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                   directory: str | pathlib.Path | None = None, batch_tokens: int = 4096,
                   progress: bool | None = None) -> Dataset:
    """Runs the target once over every answer and keeps what training reads (`token_dataset`'s
    answers, with the target's features and teacher).

    directory: where the arrays live (memory maps; a rerun keeps the batches already done), or
    None to keep them in memory. Answers go through in batches of about batch_tokens tokens, all
    padded to the longest answer rounded up to 64: one program (a TPU compiles SmolLM2's in ~35 s,
    longer than it takes to run it over a million tokens)."""
    answers = token_dataset(sequences, prompt_lengths, cfg.block_size)
    tokens, offsets, lengths = answers.tokens, answers.offsets, answers.lengths
    total, width = int(lengths.sum()), len(cfg.target_layers) * cfg.hidden_size
    fingerprint = hashlib.sha256(tokens.tobytes() + json.dumps(
        [list(cfg.target_layers), TEACHER_TOP, target_cfg.num_layers, target_cfg.hidden_size]).encode()).hexdigest()
    arrays = {"features": ((total, width), np.float16), "teacher_ids": ((total, TEACHER_TOP), np.int32),
              "teacher_probs": ((total, TEACHER_TOP), np.float16)}
    order = np.argsort(-lengths, kind="stable")  # longest first
    batches, start = [], 0
    width_t = -(-int(lengths.max()) // 64) * 64
    while start < len(order):
        count = max(1, batch_tokens // width_t)
        batches.append((order[start:start + count], width_t))
        start += count
    done = 0
    if directory is not None:
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        index_path = directory / "index.json"
        index = json.loads(index_path.read_text()) if index_path.is_file() else {}
        if index.get("fingerprint") != fingerprint:  # other answers or another drafter: start over
            index = {"fingerprint": fingerprint, "batches_done": 0}
            _write_json(index_path, index)
        done = index["batches_done"]
        out = {name: np.lib.format.open_memmap(directory / f"{name}.npy", mode="r+" if done else "w+",
                                               dtype=dtype, shape=shape) for name, (shape, dtype) in arrays.items()}
    else:
        out = {name: np.zeros(shape, dtype) for name, (shape, dtype) in arrays.items()}
    run = jax.jit(functools.partial(_teacher, family), static_argnames=("cfg", "layers", "top"))
    with Progress(len(batches), "Target features", unit="batch", enabled=progress) as bar:
        bar.update(done)
        for number, (rows, width_t) in enumerate(batches):
            if number < done:
                continue
            batch = np.zeros((len(rows), width_t), np.int32)
            for r, i in enumerate(rows):
                batch[r, :lengths[i]] = tokens[offsets[i]:offsets[i] + lengths[i]]
            got = jax.device_get(run(target_weights, cfg=target_cfg, tokens=jnp.asarray(batch),
                                     layers=cfg.target_layers, top=TEACHER_TOP))
            for name, value in zip(("features", "teacher_ids", "teacher_probs"), got):
                for r, i in enumerate(rows):
                    out[name][offsets[i]:offsets[i] + lengths[i]] = value[r, :lengths[i]]
            if directory is not None:
                for array in out.values():
                    array.flush()
                _write_json(index_path, {"fingerprint": fingerprint, "batches_done": number + 1})
            bar.update(1)
    return dataclasses.replace(answers, **out)


def sample_blocks(data: Dataset, rows: np.ndarray, num_anchors: int, k: int, rng: np.random.Generator,
                  vocab_place: np.ndarray | None = None, width: int | None = None, features: bool = True) -> dict:
    """A batch of blocks: answers `rows`, right-padded to `width` tokens (default: the longest,
    rounded up to 64), and anchors drawn in each answer's continuation so that the k tokens after
    the anchor are the target's (anchor in [prompt_length - 1, length - 1 - k]).

    teacher_index / label_index: each teacher token's and label's row in the drafter's head:
    vocab_place[id] (`draft_vocabulary`; its size where the id is outside it), or the id itself
    when there is no draft vocabulary (vocab_place None).

    features: gather the context features f32 [B, width, n * d] here ("features"); False leaves
    "feature_rows" int32 [B, width] instead (each position's row of data.features, -1 for
    padding) for `gather_features` on a device that holds them.

    A data set without the target's arrays (`token_dataset`) gives "tokens" int32 [B, width]
    and "window" int32 [B, A, k] (the position before each slot) instead of the features and
    the teacher, for `online_teacher` to compute inside the step."""
    lengths, prompts = data.lengths[rows], data.prompt_lengths[rows]
    width = width or -(-int(lengths.max()) // 64) * 64
    low = prompts - 1
    high = lengths - 1 - k
    anchors = low[:, None] + (rng.random((len(rows), num_anchors)) * (high - low + 1)[:, None]).astype(np.int64)
    window = anchors[..., None] + np.arange(k)  # [B, A, k]: the position before each slot
    inside = np.arange(width)[None, :] < lengths[:, None]  # [B, width]
    feature_rows = np.where(inside, data.offsets[rows][:, None] + np.arange(width)[None, :], -1)
    tokens = np.where(inside, data.tokens[np.maximum(feature_rows, 0)], 0).astype(np.int32)
    flat = data.offsets[rows][:, None, None] + window  # [B, A, k]: the flat row of each window position
    positions = np.where(inside, np.arange(width)[None, :], -1)
    take = lambda idx: np.take_along_axis(tokens, idx.reshape(len(rows), -1), axis=1).reshape(idx.shape)  # noqa: E731
    labels = take(window + 1).astype(np.int32)
    place = (lambda ids: ids) if vocab_place is None else (lambda ids: vocab_place[ids])  # noqa: E731
    batch = dict(ctx_positions=positions.astype(np.int32),
                 anchor_tokens=take(anchors).astype(np.int32), anchor_positions=anchors.astype(np.int32),
                 prev_tokens=take(window).astype(np.int32), labels=labels, label_index=place(labels))
    if data.teacher_ids is None:  # online: the step runs the target over these tokens
        return {**batch, "tokens": tokens, "window": window.astype(np.int32)}
    batch["teacher_index"] = place(data.teacher_ids[flat.reshape(-1)].reshape(flat.shape + (-1,)))
    batch["teacher_probs"] = data.teacher_probs[flat.reshape(-1)].reshape(flat.shape + (-1,)).astype(np.float32)
    if features:
        batch["features"] = gather_features(data.features, feature_rows)
    else:
        batch["feature_rows"] = feature_rows.astype(np.int32)
    return batch


def gather_features(source: Any, feature_rows: Any, columns: int | None = None, dtype: Any = np.float32) -> Any:
    """[B, width, n * d] of `dtype`: source's rows feature_rows [B, width] (-1: zeros), their
    first `columns` columns (default: all; `resident_features` pads them). numpy in, numpy out
    (a memory map reads only those rows); a device array in, a device array out."""
    xp = np if isinstance(source, np.ndarray) else jnp
    rows = xp.maximum(feature_rows, 0)
    picked = source[rows.reshape(-1)].reshape(rows.shape + (source.shape[1],))[..., :columns].astype(dtype)
    return xp.where((feature_rows >= 0)[..., None], picked, xp.zeros((), dtype))


def online_teacher(family: Any, target_weights: dict, target_cfg: Any, batch: dict, *, layers: tuple[int, ...],
                   vocab_place: jax.Array | None = None) -> dict:
    """An online batch (`sample_blocks` on a `token_dataset`) made whole on the device: the
    target runs over its tokens (`_teacher`, as `build_features` runs it) and gives the context
    features (zeros past each answer's end, f16 as stored) and the teacher at the blocks' slots.
    The same batch `build_features`' arrays give, without holding them for every answer."""
    batch = dict(batch)
    tokens, window = batch.pop("tokens"), batch.pop("window")
    features, ids, probs = _teacher(family, target_weights, target_cfg, tokens, layers=layers, top=TEACHER_TOP)
    inside = (batch["ctx_positions"] >= 0)[..., None]
    batch["features"] = jnp.where(inside, features.astype(jnp.float32), jnp.float32(0))
    b, a, k = window.shape
    at = lambda x: jnp.take_along_axis(x, window.reshape(b, a * k)[..., None], axis=1).reshape(b, a, k, -1)  # noqa: E731
    ids = at(ids)
    batch["teacher_index"] = ids if vocab_place is None else vocab_place[ids]
    batch["teacher_probs"] = at(probs).astype(jnp.float32)
    return batch


# A TPU lays an array out in tiles 128 wide. A gather from an array whose rows are not a multiple
# of that wide first copies the whole array into a padded layout, every call: on a v5e, 3.5 GB of
# SmolLM2's features (1,728 columns) took 3.6 GB of temporaries, 9 GB of them ran out of memory;
# at 1,792 columns the gather takes none (XLA's memory analysis of the compiled program).
LANES = 128


# What the device keeps free beside the features and the training step's own memory (its
# arguments, temporaries and outputs, as XLA's memory analysis of the compiled step gives them):
# a step's gathered features and allocator slack.
RESIDENT_MARGIN = 256 << 20


def free_device_memory() -> int | None:
    """Bytes the device has free, None where it does not say (the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if stats.get("bytes_limit") else None


def resident_features(features: np.ndarray, room: int) -> jax.Array | None:
    """The features copied to the device once, when they fit in `room` bytes with
    RESIDENT_MARGIN to spare, so that each step gathers its rows there instead of sending them;
    None where they do not fit (the host gathers). Their columns are padded with zeros to a
    multiple of LANES (`gather_features` takes the first ones)."""
    padded = features.shape[0] * -(-features.shape[1] // LANES) * LANES * features.itemsize
    return padded_on_device(features, LANES) if padded + RESIDENT_MARGIN <= room else None


def compiled_step(step: Any, *args: Any) -> tuple[Any, int | None]:
    """`step` compiled for these arguments' shapes, and the device memory one call of it takes
    (arguments, temporaries and outputs not written over donated arguments; None where XLA
    does not say)."""
    compiled = step.lower(*args).compile()
    try:
        memory = compiled.memory_analysis()
        used = (memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
                - memory.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without the analysis
        used = None
    return compiled, used


def padded_on_device(array: np.ndarray, multiple: int, rows_per_copy: int = 1 << 16) -> jax.Array:
    """array [n, c] on the device as [n', c'] (c' and n' rounded up to `multiple` and to
    rows_per_copy, zeros there), copied a slab of rows at a time: the host never holds a padded
    copy of the whole, nor the device two copies."""
    n, c = array.shape
    slab = min(rows_per_copy, n)
    out = jnp.zeros((-(-n // slab) * slab, -(-c // multiple) * multiple), array.dtype)
    for start in range(0, n, slab):
        rows = array[start:start + slab]
        out = put_rows(out, np.pad(rows, ((0, slab - len(rows)), (0, out.shape[1] - c))), start)
    return out


@functools.partial(jax.jit, donate_argnums=0)
def put_rows(out: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """out with rows [r, c] written at row `start`, in place (out is donated)."""
    return jax.lax.dynamic_update_slice(out, rows, (start, 0))


def draft_vocabulary(data: Dataset, size: int, vocab_size: int) -> np.ndarray:
    """The `size` tokens most frequent in the answers' continuations (then the lowest ids),
    ascending: a drafter's draft vocabulary."""
    counts = np.zeros(vocab_size, np.int64)
    for i in range(len(data)):
        np.add.at(counts, data.answer(i)[data.prompt_lengths[i]:], 1)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[:size]).astype(np.int32)


def vocab_places(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 [vocab_size]: each token's row among `ids`, len(ids) for tokens outside them."""
    place = np.full(vocab_size, len(ids), np.int32)
    place[ids] = np.arange(len(ids), dtype=np.int32)
    return place


# ----- the loss -----

def loss_and_metrics(params: dict, batch: dict, target_weights: dict, *, cfg: dspark.DraftConfig,
                     train: TrainConfig) -> tuple[jax.Array, dict]:
    """The weighted loss of one batch of blocks (`sample_blocks`), and its parts. target_weights:
    `shared_weights` (with the draft vocabulary's head rows under one)."""
    context = dspark.project_context(params, cfg, batch["features"].astype(jnp.float32))  # f16 from the host
    kv = dspark.context_kv(params, cfg, context, batch["ctx_positions"])
    embed = target_weights["embed"]
    hidden = dspark.backbone(params, cfg, embed, kv, batch["ctx_positions"], batch["anchor_tokens"],
                             batch["anchor_positions"])  # [B, A, k, d]
    markov = dspark.markov_features(params, embed, batch["prev_tokens"])  # [B, A, k, r]
    head = target_weights["draft_head"] if "draft_head" in target_weights else output_matrix(target_weights)
    logits = linear(hidden, head).astype(jnp.float32) + linear(markov, params["markov_out"]).astype(jnp.float32)
    confidence = dspark.confidence(params, hidden, markov)
    log_q = jax.nn.log_softmax(logits, axis=-1)  # [B, A, k, c]
    # The teacher's top tokens scattered onto the candidates (those not among them are dropped).
    p = jnp.zeros(logits.shape, jnp.float32)
    lead = tuple(i[..., None] for i in jnp.indices(batch["teacher_index"].shape[:-1], sparse=True))
    p = p.at[lead + (batch["teacher_index"],)].add(batch["teacher_probs"], mode="drop")
    labels = batch["label_index"]
    reachable = labels < logits.shape[-1]  # a label outside the draft vocabulary cannot be drafted
    ce = jnp.where(reachable, -jnp.take_along_axis(log_q, jnp.minimum(labels, logits.shape[-1] - 1)[..., None],
                                                    axis=-1)[..., 0], 0.0)  # [B, A, k]
    tv = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1)
    hit = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    conf = jnp.clip(confidence, 1e-6, 1 - 1e-6)
    bce = -(hit * jnp.log(conf) + (1 - hit) * jnp.log(1 - conf))
    w = jnp.asarray(train.slot_weights(cfg.block_size))  # [k]
    per_slot = lambda x: jnp.sum(jnp.mean(x, axis=(0, 1)) * w)  # noqa: E731
    loss = train.ce_weight * per_slot(ce) + train.tv_weight * per_slot(tv) + train.conf_weight * per_slot(bce)
    metrics = dict(loss=loss, ce=ce.mean(), tv=tv.mean(), conf_bce=bce.mean(), top1=hit.mean(),
                   # teacher-forced acceptance: leading slots the argmax gets right / expected under sampling
                   greedy_len=jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1).mean(),
                   sampled_len=jnp.sum(jnp.cumprod(1 - tv, axis=-1), axis=-1).mean())
    return loss, metrics


def _optax():
    try:
        import optax
    except ImportError:
        raise InvalidInputError("training a drafter needs optax: pip install 'weld[train]'") from None
    return optax


def make_optimizer(train: TrainConfig):
    optax = _optax()
    schedule = optax.warmup_cosine_decay_schedule(0.0, train.lr, min(train.warmup, train.steps),
                                                  max(train.steps, train.warmup + 1), end_value=train.lr * 0.1)
    # flatten: one update over a single vector instead of one per leaf (compiles in half the time)
    return optax.flatten(optax.chain(optax.clip_by_global_norm(train.clip_norm),
                                     optax.adamw(schedule, weight_decay=0.0)))


def make_train_step(cfg: dspark.DraftConfig, train: TrainConfig, optimizer):
    optax = _optax()
    grad_fn = jax.value_and_grad(functools.partial(loss_and_metrics, cfg=cfg, train=train), has_aux=True)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch, target_weights):
        (_, metrics), grads = grad_fn(params, batch, target_weights)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return step


def shared_weights(target_weights: dict, draft_vocab: np.ndarray | None = None) -> dict:
    """The only target weights the drafter reads: its embedding and LM head, and under a draft
    vocabulary the head's rows of it ("draft_head", gathered once)."""
    shared = {name: target_weights[name] for name in ("embed", "lm_head") if name in target_weights}
    if draft_vocab is not None:
        shared["draft_head"] = jnp.asarray(output_matrix(target_weights)[jnp.asarray(draft_vocab)], jnp.float32)
    return shared


# ----- checkpoints -----

class Checkpoint:
    """Training state in `directory`: params and optimizer state (npz of their leaves), the step
    reached, the data order's random state and the settings that must match to resume."""

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)

    def save(self, step: int, params: Any, opt_state: Any, order_state: dict, settings: dict,
             history: list[dict]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        leaves = {f"{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves((params, opt_state)))}
        tmp = self.directory / "state.tmp.npz"
        np.savez(tmp, **leaves)
        os.replace(tmp, self.directory / "state.npz")
        _write_json(self.directory / "state.json", {"step": step, "rng": order_state,
                                                    "settings": settings, "history": history})

    def load(self, params: Any, opt_state: Any, settings: dict):
        """(step, params, opt_state, rng, history) saved here, shaped as the given trees; None if
        nothing is saved. Raises InvalidInputError when it was saved with other settings."""
        meta_path, state_path = self.directory / "state.json", self.directory / "state.npz"
        if not (meta_path.is_file() and state_path.is_file()):
            return None
        meta = json.loads(meta_path.read_text())
        if meta["settings"] != settings:
            changed = sorted(k for k in set(settings) | set(meta["settings"])
                             if settings.get(k) != meta["settings"].get(k))
            raise InvalidInputError(f"{self.directory} holds a run with other settings ({', '.join(changed)}): "
                                    "use the same settings to resume, or another --out")
        template, tree = jax.tree.flatten((params, opt_state))
        with np.load(state_path) as saved:
            leaves = [saved[f"{i}"] for i in range(len(template))]
        for i, (a, b) in enumerate(zip(leaves, template)):
            if a.shape != np.shape(b):
                raise InvalidInputError(f"{state_path}: leaf {i} has shape {a.shape}, expected {np.shape(b)}")
        params, opt_state = jax.tree.unflatten(tree, [jnp.asarray(x) for x in leaves])
        rng = np.random.default_rng()
        rng.bit_generator.state = meta["rng"]
        return meta["step"], params, opt_state, rng, meta["history"]


# ----- training and evaluation -----

def train(params: dict, cfg: dspark.DraftConfig, target_weights: dict, data: Dataset, train_cfg: TrainConfig,
          progress: bool | None = None, log_every: int = 10, checkpoint: Checkpoint | None = None,
          settings: dict | None = None, draft_vocab: np.ndarray | None = None,
          target: tuple[Any, Any] | None = None, log: Any = None) -> tuple[dict, list[dict]]:
    """Runs train_cfg.steps optimizer steps (resuming from `checkpoint` when it holds a run of
    the same `settings`); returns the trained params and the logged metrics. draft_vocab: the
    draft vocabulary's ids (`draft_vocabulary`) when cfg has one.

    data without the target's arrays (`token_dataset`) trains online: each step's batch is made
    whole by running the target (`online_teacher`); target: (family, config) of target_weights,
    which must then be the whole target's."""
    if bool(cfg.draft_vocab_size) != (draft_vocab is not None):
        raise ValueError(f"draft_vocab_size is {cfg.draft_vocab_size}: pass draft_vocab exactly when it is not 0")
    if (data.features is None) != (target is not None):
        raise ValueError("pass target (family, config) exactly when the data set holds no features (online)")
    place = None if draft_vocab is None else vocab_places(draft_vocab, cfg.vocab_size)
    teach = None
    if target is not None:  # the target's weights are the program's argument (not constants in it)
        teach = functools.partial(jax.jit(functools.partial(online_teacher, target[0]),
                                          static_argnames=("target_cfg", "layers")),
                                  target_weights, target_cfg=target[1], layers=cfg.target_layers,
                                  vocab_place=None if place is None else jnp.asarray(place))
    target_weights = shared_weights(target_weights, draft_vocab)
    params = jax.tree.map(jnp.copy, params)  # the step donates its params: keep the caller's
    optimizer = make_optimizer(train_cfg)
    opt_state = optimizer.init(params)
    step = make_train_step(cfg, train_cfg, optimizer)
    rng = np.random.default_rng(train_cfg.seed)
    history, start = [], 0
    settings = settings or {}
    if checkpoint is not None:
        resumed = checkpoint.load(params, opt_state, settings)
        if resumed is not None:
            start, params, opt_state, rng, history = resumed
    width = -(-int(data.lengths.max()) // 64) * 64  # one program shape for every step
    resident, free = None, free_device_memory()
    if teach is None and free is not None:  # stored features: on the device if they fit beside the step
        shapes = sample_blocks(data, np.zeros(train_cfg.batch_size, np.int64), train_cfg.anchors, cfg.block_size,
                               np.random.default_rng(0), place, width, features=False)
        rows = shapes.pop("feature_rows")
        shapes = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in shapes.items()}
        shapes["features"] = jax.ShapeDtypeStruct(rows.shape + data.features.shape[1:], data.features.dtype)
        step, step_bytes = compiled_step(step, params, opt_state, shapes, target_weights)
        if step_bytes is not None:
            resident = resident_features(data.features, free - step_bytes)
            if log is not None:
                log(f"features: {data.features.nbytes / 1e9:.2f} GB, "
                    f"{'on the device' if resident is not None else 'gathered on the host'} "
                    f"({free / 1e9:.2f} GB free, the step takes {step_bytes / 1e9:.2f} GB)")
    gather = jax.jit(gather_features, static_argnames=("columns", "dtype"))

    def next_batch() -> tuple[dict, dict]:
        """The next step's batch on the device, and the data order's random state after it (what
        a checkpoint after that step saves). Made a step ahead, in a thread, while the device runs
        the current step: on a TPU with the features on the host, gathering and sending a batch
        (f16, 25 MB for SmolLM2 at 16 x 448) took longer than the step."""
        rows = rng.choice(len(data), size=train_cfg.batch_size, replace=len(data) < train_cfg.batch_size)
        batch = sample_blocks(data, rows, train_cfg.anchors, cfg.block_size, rng, place, width, features=False)
        if teach is None and resident is None:
            batch["features"] = gather_features(data.features, batch.pop("feature_rows"), dtype=data.features.dtype)
        return jax.device_put(batch), rng.bit_generator.state

    with concurrent.futures.ThreadPoolExecutor(1) as ahead, \
            Progress(train_cfg.steps, "Training drafter", unit="step",
                     enabled=progress_enabled() if progress is None else progress) as bar:
        bar.update(start)
        upcoming = ahead.submit(next_batch) if start < train_cfg.steps else None
        for i in range(start, train_cfg.steps):
            batch, order_state = upcoming.result()
            upcoming = ahead.submit(next_batch) if i + 1 < train_cfg.steps else None
            if teach is not None:
                batch = teach(batch=batch)
            elif resident is not None:
                batch["features"] = gather(resident, batch.pop("feature_rows"), columns=data.features.shape[1],
                                             dtype=data.features.dtype)  # as the host sends them
            params, opt_state, metrics = step(params, opt_state, batch, target_weights)
            if i % log_every == 0 or i == train_cfg.steps - 1:
                metrics = {k: round(float(v), 4) for k, v in jax.device_get(metrics).items()}
                history.append({"step": i, **metrics})
                bar.set_postfix(loss=metrics["loss"], top1=metrics["top1"], len=metrics["greedy_len"])
            bar.update(1)
            if checkpoint is not None and ((i + 1) % train_cfg.save_every == 0 or i + 1 == train_cfg.steps):
                checkpoint.save(i + 1, params, opt_state, order_state, settings, history)
    return params, history


def _draft_blocks(params: dict, target_weights: dict, features: jax.Array, ctx_positions: jax.Array,
                  anchor_tokens: jax.Array, anchor_positions: jax.Array, *, cfg: dspark.DraftConfig) -> dspark.Proposal:
    """Greedy proposals for rows [b] of features [b, t, n * d]: the serving path end to end."""
    context = dspark.project_context(params, cfg, features)
    kv = dspark.context_kv(params, cfg, context, ctx_positions)
    return dspark.propose(params, cfg, target_weights, kv, ctx_positions, anchor_tokens, anchor_positions)


def evaluate(params: dict, cfg: dspark.DraftConfig, target_weights: dict, data: Dataset, num_anchors: int = 16,
             seed: int = 1) -> dict:
    """Greedy acceptance on `data` (greedy answers) with the drafter drafting on its own (Markov
    head on its drafts; params as `save` takes them, with the draft vocabulary's ids under one):
    accepted = leading drafts equal to the target's tokens (of k).
    Returns accept_len (mean accepted drafts), mean_acceptance_length (1 + accept_len: tokens
    per verification round), per_position (share of blocks whose first j + 1 drafts are all
    right), sent (drafts the confidence threshold would send) and accepted_of_sent."""
    if not len(data):
        return {}
    rng = np.random.default_rng(seed)
    params = dspark.serving_params(params, cfg, target_weights)
    target_weights = shared_weights(target_weights)
    run = jax.jit(functools.partial(_draft_blocks, cfg=cfg))
    accepted, sent = [], []
    for row in range(len(data)):  # one answer's anchors at a time: a row per anchor
        batch = sample_blocks(data, np.asarray([row]), num_anchors, cfg.block_size, rng)
        proposal = run(params, target_weights, np.repeat(batch["features"], num_anchors, axis=0),
                       np.repeat(batch["ctx_positions"], num_anchors, axis=0), batch["anchor_tokens"][0],
                       batch["anchor_positions"][0])
        tokens, num = jax.device_get((proposal.tokens, proposal.num_drafts))
        accepted.append(np.cumprod(tokens == batch["labels"][0], axis=-1).sum(-1))
        sent.append(num)
    accepted, sent = np.concatenate(accepted), np.concatenate(sent)
    per_position = [round(float(np.mean(accepted > j)), 4) for j in range(cfg.block_size)]
    return dict(blocks=int(len(accepted)), accept_len=round(float(accepted.mean()), 4),
                mean_acceptance_length=round(1 + float(accepted.mean()), 4), per_position=per_position,
                sent=round(float(sent.mean()), 4),
                accepted_of_sent=round(float(np.minimum(accepted, sent).sum() / max(sent.sum(), 1)), 4))


def split_prompts(num_prompts: int, eval_fraction: float, seed: int) -> np.ndarray:
    """bool [num_prompts]: which prompts are held out (their answers only measure the drafter)."""
    held = np.zeros(num_prompts, bool)
    count = int(round(num_prompts * eval_fraction)) if num_prompts > 1 else 0
    held[np.random.default_rng(seed).permutation(num_prompts)[:count]] = True
    return held


def read_init(directory: str | pathlib.Path) -> tuple[dict, dspark.DraftConfig]:
    """The drafter `--init` names (read before the slow stages, so a bad one fails at once)."""
    try:
        return dspark.load(directory)
    except (ValueError, OSError) as err:
        raise InvalidInputError(f"--init {directory}: {err}") from None


def starting_params(directory: str | pathlib.Path, cfg: dspark.DraftConfig, vocab: np.ndarray | None,
                    saved_drafter: tuple[dict, dspark.DraftConfig] | None = None) -> dict:
    """A saved drafter's weights (f32) to train on from (`--init`): fine-tuning it, or moving it to
    features computed elsewhere. It must have cfg's shape and the same draft vocabulary.
    saved_drafter: `read_init(directory)` when already read."""
    params, saved = saved_drafter or read_init(directory)
    params = dict(params)
    if saved != cfg:
        changed = sorted(k for k, v in cfg.to_dict().items() if saved.to_dict().get(k) != v)
        raise InvalidInputError(f"--init {directory}: that drafter differs from this one in {', '.join(changed)}")
    ids = params.pop(dspark.VOCAB_TENSOR, None)
    if (ids is None) != (vocab is None) or (ids is not None and not np.array_equal(np.asarray(ids), vocab)):
        raise InvalidInputError(f"--init {directory}: its draft vocabulary is not the one these answers give")
    return params


def load_target(model: str | None, dtype: Any = "auto", progress: bool | None = None):
    """(family, weights, config, source, tokenizer) of the target, its weights prepared as an
    engine's on this device (packed for the CPU kernels where they run), without the engine's KV
    cache."""
    from weld.engine.llm import load_tokenizer, resolve_dtype
    from weld.models.family import WeightTarget
    from weld.weights import load_model, resolve_model

    dtype = resolve_dtype(dtype)
    loaded = load_model(resolve_model(model), dtype=dtype, progress=progress)
    target = WeightTarget.on_this_host("xla", dtype)
    weights = loaded.family.prepare_weights(loaded.weights, loaded.cfg, target)
    return loaded.family, weights, loaded.cfg, loaded.source, load_tokenizer(loaded)


def train_draft(model: str | None, data_path: str | Sequence[str], out: str, *, train_cfg: TrainConfig, draft_overrides: dict,
                max_prompts: int | None = None, max_new_tokens: int = 256, samples: int = 1, chat: bool = True,
                eval_fraction: float = 0.05, progress: bool | None = None, log=print,
                engine_args: dict | None = None, init: str | None = None, features: str = "stored",
                fixed_answers: bool | None = None) -> dict:
    """`weld train-draft`: answers, features, training, report, the drafter; every stage resumes
    from what `out` already holds. Returns a summary (also saved with the drafter).

    features: "stored" runs the target once over every answer before training and keeps what
    it computed on disk (~3.5 KB a token for SmolLM2's three target layers); "online" runs it
    inside each training step instead (nothing stored: for answers whose features would not fit,
    on an accelerator where the target's pass costs little beside the step).

    fixed_answers: the greedy answers from `distill.generate_fixed` (one program, engine_args'
    max_num_seqs rows at a time) instead of the engine; None: so on an accelerator (not the CPU,
    whose engine runs the native kernels) when every answer is greedy (samples 1)."""
    if features not in TRAIN_FEATURES:
        raise InvalidInputError(f"features must be one of {', '.join(TRAIN_FEATURES)}, got {features!r}")
    started = time.perf_counter()
    _optax()  # fail before the slow part
    out_dir = pathlib.Path(out)
    prompts = distill.read_prompt_files(data_path)[:max_prompts]
    saved_drafter = None if init is None else read_init(init)
    data_dir = out_dir / "data"
    log(f"answers: {len(prompts)} prompts x {samples} (greedy{', then sampled' if samples > 1 else ''}), "
        f"up to {max_new_tokens} new tokens -> {data_dir / distill.SEQUENCES_FILE}")
    engine = {"max_model_len": None, "max_num_seqs": 64, "kv_cache_memory_gb": 1.0, **(engine_args or {})}
    answers = distill.complete_answers(data_dir, len(prompts), samples)
    if fixed_answers is None:
        fixed_answers = samples == 1 and jax.default_backend() != "cpu"
    if answers is None and not fixed_answers:  # answers to generate: the engine
        from weld.engine.llm import LLM

        llm = LLM(model, progress=progress, **engine)
        answers = distill.generate(llm, prompts, data_dir, max_new_tokens=max_new_tokens, samples=samples,
                                   chat=chat, seed=train_cfg.seed, progress=progress, log=log)
        family, target_weights, target_cfg, source = llm.model.family, llm.model.weights, llm.cfg, llm.model.source
        del llm  # the KV cache is not needed any more
    else:  # the target's weights alone: every answer is there, or one fixed program makes them
        family, target_weights, target_cfg, source, tokenizer = load_target(model, engine.get("dtype", "auto"),
                                                                            progress)
        if answers is None:
            if samples != 1:
                raise InvalidInputError(f"answers from one fixed program are greedy only; --samples {samples} "
                                        "needs the engine")
            answers = distill.generate_fixed(family, target_weights, target_cfg, tokenizer, prompts, data_dir,
                                             max_new_tokens=max_new_tokens, chat=chat, rows=engine["max_num_seqs"],
                                             progress=progress, log=log)
        else:
            log(f"{data_dir / distill.SEQUENCES_FILE}: all {len(answers)} answers already generated")
    source = source.name
    try:
        cfg = dspark.DraftConfig.for_target(target_cfg, **draft_overrides)
    except ValueError as err:  # a drafter this target cannot feed, e.g. target layers out of range
        raise InvalidInputError(str(err)) from None
    held = split_prompts(len(prompts), eval_fraction, train_cfg.seed)
    answers = [a for a in answers if not held[a.prompt_index] or a.sample == 0]  # held out: greedy only
    sequences, prompt_lengths = [a.tokens for a in answers], [a.prompt_length for a in answers]
    if features == "online":  # the target's arrays for the held-out answers only, for the report
        data = token_dataset(sequences, prompt_lengths, cfg.block_size)
        evaluated = [i for i, a in enumerate(answers) if held[a.prompt_index]]
    else:
        data = build_features(family, target_weights, target_cfg, cfg, sequences, prompt_lengths,
                              directory=data_dir / FEATURES_DIR, progress=progress)
        target_weights = shared_weights(target_weights)  # all the drafter reads now: the layers' memory goes back
    kept = [a for a in answers if len(a.tokens) - a.prompt_length >= cfg.block_size + 1 and a.prompt_length >= 1]
    is_eval = np.asarray([bool(held[a.prompt_index]) for a in kept])
    train_data, eval_data = data.subset(np.flatnonzero(~is_eval)), data.subset(np.flatnonzero(is_eval))
    generated = int((data.lengths - data.prompt_lengths).sum())
    log(f"{len(train_data)} training / {len(eval_data)} held-out answers, {generated} generated tokens; drafter: "
        f"{cfg.num_layers} layer(s), k={cfg.block_size}, target layers {list(cfg.target_layers)}, "
        f"Markov rank {cfg.markov_rank}")
    vocab = draft_vocabulary(train_data, cfg.draft_vocab_size, cfg.vocab_size) if cfg.draft_vocab_size else None
    if vocab is not None:
        covered = float(np.mean(vocab_places(vocab, cfg.vocab_size)[np.concatenate(
            [eval_data.answer(i)[eval_data.prompt_lengths[i]:] for i in range(len(eval_data))] or [vocab[:1]])]
            < len(vocab)))
        log(f"draft vocabulary: the {len(vocab)} most frequent tokens, {covered:.1%} of the held-out answers' tokens")
    params = (dspark.init_params(cfg, seed=train_cfg.seed, target_weights=target_weights) if init is None
              else starting_params(init, cfg, vocab, saved_drafter))
    settings = {"draft": cfg.to_dict(), "train": dataclasses.asdict(train_cfg), "answers": len(answers),
                "tokens": int(data.lengths.sum())}
    if init is not None:  # (absent otherwise, so that runs saved before --init existed still resume)
        settings["init"] = str(init)
    if features != "stored":  # (likewise)
        settings["features"] = features
    params, history = train(params, cfg, target_weights, train_data, train_cfg, progress=progress,
                            checkpoint=Checkpoint(out_dir / CHECKPOINT_DIR), settings=settings, draft_vocab=vocab,
                            target=(family, target_cfg) if features == "online" else None, log=log)
    if vocab is not None:
        params = {**params, dspark.VOCAB_TENSOR: jnp.asarray(vocab)}
    # The held-out report measures the drafter as written, read back the way `--draft` reads it
    # (a TPU-trained drafter once scored 2.34 in memory and 1.17 from a file written in the wrong
    # memory order: `dspark.save`).
    dspark.save(out_dir, params, cfg)
    if features == "online" and len(eval_data):  # the report's features, after training (it starts at once)
        eval_data = build_features(family, target_weights, target_cfg, cfg, [sequences[i] for i in evaluated],
                                   [prompt_lengths[i] for i in evaluated], progress=progress)
    report = evaluate(dspark.load(out_dir)[0], cfg, target_weights, eval_data)
    data = [str(data_path)] if isinstance(data_path, (str, pathlib.Path)) else [str(path) for path in data_path]
    summary = dict(model=source, data=" + ".join(data), prompts=len(prompts), held_out_prompts=int(held.sum()),
                   samples_per_prompt=samples, max_new_tokens=max_new_tokens, features=features, answers=len(answers),
                   generated_tokens=generated, train_answers=len(train_data), eval_answers=len(eval_data),
                   **({} if init is None else {"init": str(init)}),
                   train=dataclasses.asdict(train_cfg), final=history[-1] if history else {}, held_out=report,
                   seconds=round(time.perf_counter() - started, 1))
    dspark.save(out_dir, params, cfg, metadata=summary)
    _write_json(out_dir / "report.json", summary)
    return summary

"""Self-distillation of the DSpark drafter on the target's own outputs (`weld train-draft`).

1. The target continues prompts from a text file (greedy by default) through the serving engine.
2. `features.target_hidden_states` runs the target's own forward over each prompt + continuation once, keeping
   the chosen layers' residual streams (the drafter's context) and the final hidden states.
3. Each step draws sequences and anchor positions in their continuations; the drafter sees the
   context before the anchor and predicts the k tokens after it, the Markov head reading the true
   previous tokens (teacher forcing). The loss (weights after DeepSpec's recipe):
     ce_weight   * cross-entropy to the target's token
   + tv_weight   * total variation 1/2 sum |p - q| to the target's distribution p (temperature 1)
   + conf_weight * BCE of the confidence against [argmax q == the target's token]
   The target's logits come from its stored final hidden states through its LM head, per step.
4. Held-out sequences measure the greedy acceptance length with the drafter drafting on its own
   (`dspark.propose`): for greedy data it is exactly what greedy verification would accept.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from weld.engine.spec import dspark
from weld.engine.spec.features import target_hidden_states
from weld.models.common.layers import linear
from weld.models.family import output_matrix
from weld.utils.errors import InvalidInputError
from weld.utils.progress import progress_enabled


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    lr: float = 1e-3
    warmup: int = 20
    batch_size: int = 4  # sequences per step
    anchors: int = 16  # blocks per sequence per step
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    clip_norm: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "anchors"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise InvalidInputError(f"the learning rate must be > 0, got {self.lr}")


@dataclasses.dataclass
class Dataset:
    """Sequences (prompt + the target's continuation) with the target's features, right-padded."""

    tokens: np.ndarray  # int32 [N, T]
    lengths: np.ndarray  # int32 [N]
    prompt_lengths: np.ndarray  # int32 [N]
    features: np.ndarray  # f32 [N, T, len(target_layers) * d]: the drafter's context
    final: np.ndarray  # f32 [N, T, d]: the target's final hidden states (LM head -> logits)

    def __len__(self) -> int:
        return len(self.tokens)

    def subset(self, rows: np.ndarray) -> "Dataset":
        return Dataset(*(getattr(self, f.name)[rows] for f in dataclasses.fields(self)))


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


def generate_sequences(llm: Any, prompts: Sequence[str], max_new_tokens: int, temperature: float = 0.0,
                       seed: int = 0, chat: bool = True) -> tuple[list[list[int]], list[int]]:
    """The target's continuations through the serving engine. Returns (prompt + output token ids,
    prompt lengths). chat: wrap each prompt as a user message in the model's chat template."""
    from weld.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=1.0, top_k=0,
                             seed=seed + i) for i in range(len(prompts))]
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(list(prompts), params)
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    return sequences, [len(o.prompt_token_ids) for o in outs]


def build_dataset(family: Any, target_weights: dict, target_cfg: Any, cfg: dspark.DraftConfig,
                  sequences: Sequence[Sequence[int]],
                  prompt_lengths: Sequence[int], chunk: int = 4, progress: bool | None = None) -> Dataset:
    """Runs the target over every sequence once and keeps what training reads. Sequences whose
    continuation is shorter than k + 1 tokens (no room for one block) are dropped."""
    from tqdm import tqdm

    k = cfg.block_size
    keep = [i for i, (s, p) in enumerate(zip(sequences, prompt_lengths)) if len(s) - p >= k + 1 and p >= 1]
    if not keep:
        raise InvalidInputError(f"no sequence has a continuation of at least k + 1 = {k + 1} tokens")
    sequences = [list(sequences[i]) for i in keep]
    width = -(-max(len(s) for s in sequences) // 16) * 16
    tokens = np.zeros((len(sequences), width), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)] = s
    run = jax.jit(functools.partial(target_hidden_states, family), static_argnames=("cfg", "layers"))
    features, final = [], []
    for start in tqdm(range(0, len(tokens), chunk), desc="Target features", unit="batch",
                      disable=not (progress_enabled() if progress is None else progress)):
        rows = tokens[start:start + chunk]
        padded = np.pad(rows, ((0, chunk - len(rows)), (0, 0)))  # one program shape for every chunk
        stacked, last = jax.device_get(run(target_weights, cfg=target_cfg, tokens=jnp.asarray(padded),
                                           layers=cfg.target_layers))
        features.append(np.asarray(stacked[:len(rows)], np.float32))
        final.append(np.asarray(last[:len(rows)], np.float32))
    return Dataset(tokens=tokens, lengths=np.asarray([len(s) for s in sequences], np.int32),
                   prompt_lengths=np.asarray([prompt_lengths[i] for i in keep], np.int32),
                   features=np.concatenate(features), final=np.concatenate(final))


def sample_blocks(data: Dataset, rows: np.ndarray, num_anchors: int, k: int, rng: np.random.Generator) -> dict:
    """A batch of blocks: anchors drawn in each row's continuation so that the k tokens after the
    anchor are the target's (anchor in [prompt_length - 1, length - 1 - k])."""
    low = data.prompt_lengths[rows] - 1
    high = data.lengths[rows] - 1 - k
    anchors = low[:, None] + (rng.random((len(rows), num_anchors)) * (high - low + 1)[:, None]).astype(np.int64)
    offsets = np.arange(k)
    seq = data.tokens[rows]  # [B, T]
    width = seq.shape[1]
    take = lambda a, idx: np.take_along_axis(a, idx.reshape(len(rows), -1), axis=1).reshape(idx.shape)  # noqa: E731
    window = anchors[..., None] + offsets  # [B, A, k]: the token before each slot
    final = data.final[rows[:, None, None], window]  # [B, A, k, d]: the target's state predicting each slot
    positions = np.where(np.arange(width)[None, :] < data.lengths[rows][:, None], np.arange(width)[None, :], -1)
    return dict(features=data.features[rows], ctx_positions=positions.astype(np.int32),
                anchor_tokens=take(seq, anchors).astype(np.int32), anchor_positions=anchors.astype(np.int32),
                prev_tokens=take(seq, window).astype(np.int32), labels=take(seq, window + 1).astype(np.int32),
                target_final=final)


def loss_and_metrics(params: dict, batch: dict, target_weights: dict, *, cfg: dspark.DraftConfig,
                     train: TrainConfig) -> tuple[jax.Array, dict]:
    """The weighted loss of one batch of blocks, and its parts."""
    context = dspark.project_context(params, cfg, batch["features"])
    kv = dspark.context_kv(params, cfg, context, batch["ctx_positions"])
    logits, confidence = dspark.teacher_forced(params, cfg, target_weights, kv, batch["ctx_positions"],
                                               batch["anchor_tokens"], batch["anchor_positions"],
                                               batch["prev_tokens"])  # [B, A, k, v], [B, A, k]
    target_logits = linear(batch["target_final"], output_matrix(target_weights)).astype(jnp.float32)
    p = jax.lax.stop_gradient(jax.nn.softmax(target_logits, axis=-1))
    log_q = jax.nn.log_softmax(logits, axis=-1)
    labels = batch["labels"]
    ce = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
    tv = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1)
    hit = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    conf = jnp.clip(confidence, 1e-6, 1 - 1e-6)
    bce = -(hit * jnp.log(conf) + (1 - hit) * jnp.log(1 - conf))
    loss = train.ce_weight * ce.mean() + train.tv_weight * tv.mean() + train.conf_weight * bce.mean()
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


def shared_weights(target_weights: dict) -> dict:
    """The only target weights the drafter reads: its embedding and LM head."""
    return {name: target_weights[name] for name in ("embed", "lm_head") if name in target_weights}


def _draft_blocks(params: dict, target_weights: dict, features: jax.Array, ctx_positions: jax.Array,
                  anchor_tokens: jax.Array, anchor_positions: jax.Array, *, cfg: dspark.DraftConfig) -> dspark.Proposal:
    """Greedy proposals for rows [b] of features [b, t, n * d]: the serving path end to end."""
    context = dspark.project_context(params, cfg, features)
    kv = dspark.context_kv(params, cfg, context, ctx_positions)
    return dspark.propose(params, cfg, target_weights, kv, ctx_positions, anchor_tokens, anchor_positions)


def evaluate(params: dict, cfg: dspark.DraftConfig, target_weights: dict, data: Dataset, num_anchors: int = 16,
             seed: int = 1) -> dict:
    """Greedy acceptance on `data` with the drafter drafting on its own (Markov head on its drafts):
    accept_len = leading drafts equal to the target's tokens (of k), sent = drafts the confidence
    threshold would send, accepted_of_sent = accepted among those."""
    rng = np.random.default_rng(seed)
    target_weights = shared_weights(target_weights)
    run = jax.jit(functools.partial(_draft_blocks, cfg=cfg))
    accepted, sent = [], []
    for row in range(len(data)):  # one sequence's anchors at a time: a row per anchor
        batch = sample_blocks(data, np.asarray([row]), num_anchors, cfg.block_size, rng)
        proposal = run(params, target_weights, np.repeat(batch["features"], num_anchors, axis=0),
                       np.repeat(batch["ctx_positions"], num_anchors, axis=0), batch["anchor_tokens"][0],
                       batch["anchor_positions"][0])
        tokens, num = jax.device_get((proposal.tokens, proposal.num_drafts))
        accepted.append(np.cumprod(tokens == batch["labels"][0], axis=-1).sum(-1))
        sent.append(num)
    accepted, sent = np.concatenate(accepted), np.concatenate(sent)
    return dict(accept_len=float(accepted.mean()), sent=float(sent.mean()),
                accepted_of_sent=float(np.minimum(accepted, sent).sum() / max(sent.sum(), 1)))


def train(params: dict, cfg: dspark.DraftConfig, target_weights: dict, data: Dataset, train_cfg: TrainConfig,
          progress: bool | None = None, log_every: int = 10) -> tuple[dict, list[dict]]:
    """Runs train_cfg.steps optimizer steps; returns the trained params and the logged metrics."""
    from tqdm import tqdm

    target_weights = shared_weights(target_weights)
    params = jax.tree.map(jnp.copy, params)  # the step donates its params: keep the caller's
    optimizer = make_optimizer(train_cfg)
    opt_state = optimizer.init(params)
    step = make_train_step(cfg, train_cfg, optimizer)
    rng = np.random.default_rng(train_cfg.seed)
    history = []
    bar = tqdm(range(train_cfg.steps), desc="Training drafter", unit="step",
               disable=not (progress_enabled() if progress is None else progress))
    for i in bar:
        rows = rng.choice(len(data), size=train_cfg.batch_size, replace=len(data) < train_cfg.batch_size)
        batch = {k: jnp.asarray(v) for k, v in sample_blocks(data, rows, train_cfg.anchors, cfg.block_size,
                                                            rng).items()}
        params, opt_state, metrics = step(params, opt_state, batch, target_weights)
        if i % log_every == 0 or i == train_cfg.steps - 1:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            history.append({"step": i, **metrics})
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.2f}",
                            len=f"{metrics['greedy_len']:.2f}")
    bar.close()
    return params, history


def train_draft(model: str | None, data_path: str, out: str, *, train_cfg: TrainConfig, draft_overrides: dict,
                max_prompts: int | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
                chat: bool = True, eval_fraction: float = 0.1, progress: bool | None = None,
                log=print) -> dict:
    """`weld train-draft`: generate, extract features, train, evaluate, save. Returns a summary."""
    from weld.engine.llm import LLM

    started = time.perf_counter()
    _optax()  # fail before the slow part
    prompts = read_prompts(data_path)[:max_prompts]
    llm = LLM(model, dtype="float32", max_model_len=None, kv_cache_memory_gb=0.25, progress=progress)
    try:
        cfg = dspark.DraftConfig.for_target(llm.cfg, **draft_overrides)
    except ValueError as err:  # a drafter this target cannot feed, e.g. target layers out of range
        raise InvalidInputError(str(err)) from None
    log(f"generating {max_new_tokens} tokens for {len(prompts)} prompts "
        f"({'greedy' if temperature == 0 else f'temperature {temperature}'})")
    sequences, prompt_lengths = generate_sequences(llm, prompts, max_new_tokens, temperature, train_cfg.seed, chat)
    target_weights, target_cfg = llm.model.weights, llm.cfg
    del llm.engine  # the KV cache is not needed any more
    data = build_dataset(llm.model.family, target_weights, target_cfg, cfg, sequences, prompt_lengths,
                         progress=progress)
    generated = int((data.lengths - data.prompt_lengths).sum())
    order = np.random.default_rng(train_cfg.seed).permutation(len(data))
    num_eval = int(round(len(data) * eval_fraction)) if len(data) > 1 else 0
    eval_data, train_data = data.subset(order[:num_eval]), data.subset(order[num_eval:])
    log(f"{len(train_data)} training / {len(eval_data)} held-out sequences, {generated} generated tokens; "
        f"drafter: {cfg.num_layers} layer(s), k={cfg.block_size}, target layers {list(cfg.target_layers)}")
    params = dspark.init_params(cfg, seed=train_cfg.seed, target_weights=target_weights)
    before = evaluate(params, cfg, target_weights, eval_data) if num_eval else {}
    params, history = train(params, cfg, target_weights, train_data, train_cfg, progress=progress)
    after = evaluate(params, cfg, target_weights, eval_data) if num_eval else {}
    summary = dict(model=llm.model.source.name, data=str(data_path), prompts=len(prompts),
                   generated_tokens=generated, train_sequences=len(train_data), eval_sequences=len(eval_data),
                   train=dataclasses.asdict(train_cfg), final=history[-1], eval_before=before, eval_after=after,
                   seconds=round(time.perf_counter() - started, 1))
    dspark.save(out, params, cfg, metadata=summary)
    return summary

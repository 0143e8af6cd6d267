"""A DSpark-style block drafter: k drafts from one parallel pass, conditioned on the target.

DSpark (Cheng et al. 2026, DeepSeek-AI x PKU, "Confidence-Scheduled Speculative Decoding with
Semi-Autoregressive Generation") drafts a whole block in parallel like DFlash, then fixes the
block's coherence with a tiny sequential Markov head and sends each request's drafts to
verification only as far as a confidence head trusts them. This is a small version of it:

Context. For every token the target has processed (positions < the anchor's), the residual
stream after a few target layers (the family's forward with capture_layers; features.py),
concatenated [n * d], is projected and normed:
  c = RMSNorm(W_fc x)                                                      [d]
and kept as the drafter's context (the runner can store c, or each layer's K/V of c, per token).

Block. The anchor (the last token, which the target has not processed yet) at position p, then k
mask slots at p+1..p+k: inputs E[anchor] and a learned mask vector m_mask. Each drafter layer is
a llama block whose queries are the block's slots and whose keys and values are the context's
(c at its positions) and the block's own; slots see the whole context and each other
(bidirectional within the block). h_j = RMSNorm(x_j) for mask slot j = 1..k.

Outputs, left to right (prev_1 = anchor, prev_j = draft_{j-1}):
  m_j      = W_in E[prev_j]                                                [r]
  logits_j = H h_j + W_out m_j             (H: the target's LM head; W_out: the low-rank Markov bias)
  conf_j   = sigmoid(w . [h_j; m_j] + b)   (P(draft j accepted | drafts before it accepted))
E and H are the target's embedding and LM head, shared and never trained. A request sends the
leading drafts whose survival prod_{i<=j} conf_i stays >= a threshold.

Draft vocabulary (as FR-Spec and EAGLE-3 do): a drafter may draft only among the
`draft_vocab_size` tokens most frequent in its training answers (`draft_vocab`, ids in
ascending order); then H and W_out have those rows only, which cuts the head's cost by
vocab_size / draft_vocab_size, and the loss's softmax runs over the same tokens. 0 = the whole
vocabulary. `serving_params` gathers those rows of the target's head once, at load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weld.engine.sampler import SamplingArrays, argmax
from weld.engine.spec.acceptance import draft_sample
from weld.models import llama
from weld.models.common.attention import dense_attention
from weld.models.common.layers import linear, rms_norm, swiglu, unpacked
from weld.models.common.rope import Rope
from weld.models.family import ModelConfig, output_matrix
from weld.models.common.spec import WeightSpec, iter_specs, map_specs, path_str

FORMAT = "weld-dspark-draft"
# Drafters that ship with weld (in weld/drafters/), by the file name of the target they were trained on.
SHIPPED = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m-instruct"}
WEIGHTS_FILE = "model.safetensors"
VOCAB_TENSOR = "draft_vocab"  # int32 [draft_vocab_size]: the token id of each row of the drafter's head
SCALES = ".q8_0_scales"  # a matrix's Q8_0 scales, f16 [rows, ceil(columns / 32)], beside its int8 codes


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """DeepSpec's choice of low, middle and high features: layers 1, L/2 - 1 and L - 4 (for
    fewer than 8 layers, three spread from the second to the second-to-last)."""
    if num_layers >= 8:
        return (1, num_layers // 2 - 1, num_layers - 4)
    if num_layers <= 3:
        return tuple(range(num_layers))
    return tuple(sorted({int(round(x)) for x in np.linspace(1, num_layers - 2, 3)}))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Shape of a drafter for one target. Frozen and hashable: a static argument of jit."""

    vocab_size: int  # the target's
    hidden_size: int  # the target's: the drafter shares its embedding and LM head
    target_num_layers: int
    target_layers: tuple[int, ...]  # whose outputs form the context, in this order
    num_layers: int = 1
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 1024
    block_size: int = 7  # k: drafts per block
    markov_rank: int = 64
    draft_vocab_size: int = 0  # tokens the drafter may draft (the most frequent in training); 0: all
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    confidence_threshold: float = 0.5  # default survival threshold for how many drafts to send

    def __post_init__(self):
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))

        def check(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"invalid draft config: {msg}")

        for name in ("vocab_size", "hidden_size", "target_num_layers", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "block_size", "markov_rank"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        check(isinstance(self.draft_vocab_size, int) and 0 <= self.draft_vocab_size <= self.vocab_size,
              f"draft_vocab_size must lie in [0, vocab_size={self.vocab_size}], got {self.draft_vocab_size!r}")
        check(len(self.target_layers) > 0, "target_layers is empty")
        check(len(set(self.target_layers)) == len(self.target_layers), f"target_layers repeat: {self.target_layers}")
        check(all(0 <= i < self.target_num_layers for i in self.target_layers),
              f"target_layers {self.target_layers} must lie in [0, {self.target_num_layers})")
        check(self.num_heads % self.num_kv_heads == 0,
              f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        check(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        check(0.0 <= self.confidence_threshold <= 1.0,
              f"confidence_threshold must lie in [0, 1], got {self.confidence_threshold}")

    @classmethod
    def for_target(cls, target: ModelConfig, **overrides: Any) -> "DraftConfig":
        """A drafter for any family's target (it reads only the fields every Config declares):
        the target's width, heads of 64 dims (one per 64 of the width), an MLP 8/3 as wide (a
        multiple of 64), with `overrides` applied."""
        d = target.hidden_size
        heads = max(1, d // 64)
        fields = dict(vocab_size=target.vocab_size, hidden_size=d, target_num_layers=target.num_layers,
                      target_layers=default_target_layers(target.num_layers), num_heads=heads, num_kv_heads=heads,
                      head_dim=64, intermediate_size=max(64, round(d * 8 / 3 / 64) * 64))
        fields.update({k: v for k, v in overrides.items() if v is not None})
        if fields.get("draft_vocab_size", 0) >= target.vocab_size:  # as many as there are: the whole vocabulary
            fields["draft_vocab_size"] = 0
        return cls(**fields)

    def check_target(self, target: ModelConfig) -> None:
        """Raises ValueError when this drafter was not made for `target`'s shapes."""
        for mine, theirs in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                             ("target_num_layers", "num_layers")):
            if getattr(self, mine) != getattr(target, theirs):
                raise ValueError(f"the drafter was made for a target with {theirs}={getattr(self, mine)}, "
                                 f"but this target has {theirs}={getattr(target, theirs)}")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "target_layers": list(self.target_layers)}

    @classmethod
    def from_dict(cls, fields: dict) -> "DraftConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown draft config fields {unknown}")
        return cls(**fields)


def _layer_config(cfg: DraftConfig) -> llama.Config:
    """The drafter's layers are llama blocks (whatever the target's family): this config declares them."""
    return llama.Config(architecture="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                        rope_theta=cfg.rope_theta, tie_word_embeddings=True)


def weight_specs(cfg: DraftConfig) -> dict:
    """The drafter's trained weights, declared once. Matrices are [out, in]."""
    d, r = cfg.hidden_size, cfg.markov_rank
    return {
        "fc": WeightSpec((d, len(cfg.target_layers) * d), ("embed", "target_stack")),
        "context_norm": WeightSpec((d,), ("embed",), init="ones"),
        "mask_embed": WeightSpec((d,), ("embed",)),
        "layers": llama.weight_specs(_layer_config(cfg))["layers"],
        "final_norm": WeightSpec((d,), ("embed",), init="ones"),
        "markov_in": WeightSpec((r, d), ("markov", "embed")),
        "markov_out": WeightSpec((cfg.draft_vocab_size or cfg.vocab_size, r), ("vocab", "markov"), init="zeros"),
        "confidence": WeightSpec((d + r,), (None,), init="zeros"),
        "confidence_bias": WeightSpec((1,), (None,), init="zeros"),
    }


def init_params(cfg: DraftConfig, seed: int = 0, dtype: Any = jnp.float32, target_weights: dict | None = None) -> dict:
    """Fresh weights for training: norms 1, the Markov bias and confidence 0 (the drafter starts as
    a plain parallel drafter at confidence 1/2), matrices N(0, 1 / fan_in), the mask vector small.
    With target_weights, the final norm is scaled so the first logits through the shared LM head
    have unit spread (a random direction at the target's own scale saturates the softmax)."""
    rng = np.random.default_rng(seed)

    def init(_, spec: WeightSpec):
        if spec.init == "ones":
            x = np.ones(spec.shape)
        elif spec.init == "zeros":
            x = np.zeros(spec.shape)
        elif len(spec.shape) == 1:
            x = 0.02 * rng.standard_normal(spec.shape)
        else:
            x = rng.standard_normal(spec.shape) / np.sqrt(spec.shape[-1])
        return jnp.asarray(x, dtype)

    params = map_specs(init, weight_specs(cfg))
    if target_weights is not None:  # logit = H h, h of unit RMS: its spread is ~ sqrt(d) * rms(H)
        head = np.asarray(unpacked(output_matrix(target_weights)), np.float32)
        scale = 1.0 / (np.sqrt(cfg.hidden_size) * np.sqrt(np.mean(head * head)))
        params["final_norm"] = jnp.full((cfg.hidden_size,), scale, dtype)
    return params


def draft_head(params: dict, target_weights: dict) -> Any:
    """The rows of the LM head the drafter scores [n, d]: `serving_params`' gathered rows of the
    draft vocabulary, or the target's whole head."""
    return params["draft_head"] if "draft_head" in params else output_matrix(target_weights)


def serving_params(params: dict, cfg: DraftConfig, target_weights: dict) -> dict:
    """params with, under a draft vocabulary, the target head's rows of it (f32 [n, d]) gathered
    once ("draft_head"), so that no round gathers them again."""
    if not cfg.draft_vocab_size:
        return params
    rows = output_matrix(target_weights)[params["draft_vocab"]]
    return {**params, "draft_head": jnp.asarray(rows, jnp.float32)}


def quantized(params: dict) -> dict:
    """params with every matrix (the drafter's own and `serving_params`' draft head) in Q8_0
    blocks, for the CPU's native integer kernel: a round then reads about one byte a weight
    instead of four, and its activations take one int8 digit (not the two of the "int8" mode:
    a block's rows make these matmuls compute-bound, and a draft needs no more). Vectors (norms,
    the mask slot, the confidence head) and ids stay as they are."""
    from weld.models.common import quant

    def convert(x):
        if isinstance(x, jax.Array) and x.ndim == 2 and jnp.issubdtype(x.dtype, jnp.floating):
            q = quant.quantize(np.asarray(x, np.float32), "int8")  # Q8_0's codes and scales
            return quant.QuantWeight(q.codes, q.scales, q.mins, q.n, q.k, "q8_0")
        return x

    return jax.tree.map(convert, params)


def draft_ids(params: dict, index: jax.Array) -> jax.Array:
    """Token ids of places `index` among the scored rows (the draft vocabulary, or the identity)."""
    return params["draft_vocab"][index] if "draft_vocab" in params else index


# ----- forward -----

def rope(cfg: DraftConfig, x: jax.Array, positions: jax.Array) -> jax.Array:
    """The drafter's rotary embedding of x [b, t, heads, e] at positions [b, t] (plain, theta from cfg)."""
    return Rope(cfg.head_dim, cfg.rope_theta, max_position_embeddings=1)(x, positions)


def layer(cfg: DraftConfig, lw: dict, x: jax.Array, positions: jax.Array, attend,
          rows: slice = slice(None)) -> jax.Array:
    """One drafter layer (a llama block) over slots x [b, n, d] at positions [b, n]; attend(q, k, v)
    -> [b, m, h, e] is the attention of queries q [b, m, h, e] over whatever the slots see (the
    context and the block's keys k and values v [b, n, kv, e]). rows: the slots whose outputs
    are wanted ([b, m, d] out); every slot is still a key and a value (a serving block's last
    layer: its anchor slot's output is never read)."""
    b, n, _ = x.shape
    h, kv, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    y = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
    x, out_positions = x[:, rows], positions[:, rows]
    q = rope(cfg, linear(y[:, rows], lw["wq"]).reshape(b, x.shape[1], h, e), out_positions)
    k = rope(cfg, linear(y, lw["wk"]).reshape(b, n, kv, e), positions)
    v = linear(y, lw["wv"]).reshape(b, n, kv, e)
    x = x + linear(attend(q, k, v).astype(x.dtype).reshape(b, x.shape[1], h * e), lw["wo"])
    return x + swiglu(rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps), lw["w_gate"], lw["w_up"], lw["w_down"])


def project_context(params: dict, cfg: DraftConfig, target_hidden: jax.Array) -> jax.Array:
    """The context c [b, t, d] of target features [b, t, len(target_layers) * d] (features.py)."""
    return rms_norm(linear(target_hidden, params["fc"]), params["context_norm"], cfg.rms_norm_eps)


def context_kv(params: dict, cfg: DraftConfig, context: jax.Array,
               positions: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Each drafter layer's keys and values [b, c, kv, e] of the context c [b, c, d] at positions
    [b, c] (rotary applied): what a runner may cache per token instead of c."""
    b, c, _ = context.shape
    kv, e = cfg.num_kv_heads, cfg.head_dim
    return [(rope(cfg, linear(context, lw["wk"]).reshape(b, c, kv, e), positions),
             linear(context, lw["wv"]).reshape(b, c, kv, e)) for lw in params["layers"]]


def backbone(params: dict, cfg: DraftConfig, embed: jax.Array, ctx_kv: list, ctx_positions: jax.Array,
             anchor_tokens: jax.Array, anchor_positions: jax.Array) -> jax.Array:
    """The parallel pass over blocks: h [b, n, k, d] of the k mask slots of every block.

    ctx_kv: `context_kv` of the row's context; ctx_positions int32 [b, c] (-1 = padding).
    anchor_tokens, anchor_positions int32 [b, n]: n blocks per row (1 when serving; many in
    training), each seeing the context positions before its anchor's and its own slots.
    """
    b, n = anchor_tokens.shape
    s, d = cfg.block_size + 1, cfg.hidden_size
    x = jnp.concatenate([embed[anchor_tokens][:, :, None, :],
                         jnp.broadcast_to(params["mask_embed"].astype(embed.dtype), (b, n, s - 1, d))],
                        axis=2).reshape(b, n * s, d)  # the blocks' slots one after another
    slot_positions = (anchor_positions[..., None] + jnp.arange(s)).reshape(b, n * s)
    slot_anchor = jnp.repeat(anchor_positions, s, axis=1)  # [b, n*s]: each slot's block's anchor position
    sees_context = (ctx_positions[:, None, :] >= 0) & (ctx_positions[:, None, :] < slot_anchor[:, :, None])
    block = jnp.repeat(jnp.arange(n), s)
    sees_slot = jnp.broadcast_to(block[:, None] == block[None, :], (b, n * s, n * s))  # its own block, both ways
    visible = jnp.concatenate([sees_context, sees_slot], axis=2)  # [b, n*s, c + n*s]
    for lw, (ctx_k, ctx_v) in zip(params["layers"], ctx_kv):
        def attend(q, k, v):
            keys = jnp.concatenate([ctx_k.astype(k.dtype), k], axis=1)
            values = jnp.concatenate([ctx_v.astype(v.dtype), v], axis=1)
            return dense_attention(q, keys, values, visible)[0]

        x = layer(cfg, lw, x, slot_positions, attend)
    x = x.reshape(b, n, s, d)[:, :, 1:]
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def markov_features(params: dict, embed: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """m = W_in E[prev] [..., r] for the token before each slot."""
    return linear(embed[prev_tokens], params["markov_in"])


def confidence(params: dict, hidden: jax.Array, markov: jax.Array) -> jax.Array:
    """conf [...] of slots with hidden [..., d] and Markov features [..., r]."""
    features = jnp.concatenate([hidden, markov.astype(hidden.dtype)], axis=-1).astype(jnp.float32)
    return jax.nn.sigmoid(features @ params["confidence"] + params["confidence_bias"][0])


def slot_outputs(params: dict, head_logits: jax.Array, hidden: jax.Array,
                 markov: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits f32 [..., v], confidence [...]) of slots with hidden [..., d], their LM-head logits
    H h [..., v] (`head_logits`: one product for a whole block) and Markov features [..., r]."""
    logits = head_logits.astype(jnp.float32) + linear(markov, params["markov_out"]).astype(jnp.float32)
    return logits, confidence(params, hidden, markov)


def teacher_forced(params: dict, cfg: DraftConfig, target_weights: dict, ctx_kv: list, ctx_positions: jax.Array,
                   anchor_tokens: jax.Array, anchor_positions: jax.Array,
                   prev_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Training's forward: the Markov head reads the true previous tokens prev_tokens [b, n, k]
    (the anchor, then the target's tokens) instead of the drafts, so all slots run at once.
    Returns (logits f32 [b, n, k, v] (v: the draft vocabulary's size), confidence [b, n, k])."""
    embed = target_weights["embed"]
    hidden = backbone(params, cfg, embed, ctx_kv, ctx_positions, anchor_tokens, anchor_positions)
    return slot_outputs(params, linear(hidden, draft_head(params, target_weights)), hidden,
                        markov_features(params, embed, prev_tokens))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
    """One block of drafts per row."""

    tokens: jax.Array  # i32 [b, k]
    num_drafts: jax.Array  # i32 [b]: how many leading drafts to send (survival >= threshold)
    confidence: jax.Array  # f32 [b, k]
    draft_probs: jax.Array | None  # f32 [b, k, v]: q of sampled drafts (rejection_accept); None if greedy


def num_to_verify(confidence: jax.Array, threshold: float | jax.Array) -> jax.Array:
    """Leading drafts [b] whose survival prod_{i<=j} conf_i is >= threshold (confidence [b, k])."""
    survival = jnp.cumprod(confidence, axis=-1)
    return jnp.sum(jnp.cumprod(survival >= threshold, axis=-1), axis=-1).astype(jnp.int32)


def propose(params: dict, cfg: DraftConfig, target_weights: dict, ctx_kv: list, ctx_positions: jax.Array,
            anchor_tokens: jax.Array, anchor_positions: jax.Array, sampling: SamplingArrays | None = None,
            threshold: float | jax.Array | None = None) -> Proposal:
    """Drafts k tokens after each row's anchor (int32 [b], at anchor_positions [b]).

    ctx_kv / ctx_positions: the row's context (`context_kv`; positions >= the anchor's are ignored).
    sampling: None drafts greedily (deterministic drafts); otherwise each slot is drawn under the
    row's sampling parameters (`draft_sample`, noise apart from the target's) and draft_probs
    holds the q to verify against. threshold: default cfg.confidence_threshold; 0 sends all k.
    """
    embed = target_weights["embed"]
    hidden = backbone(params, cfg, embed, ctx_kv, ctx_positions, anchor_tokens[:, None],
                      anchor_positions[:, None])[:, 0]  # [b, k, d]
    head_logits = linear(hidden, draft_head(params, target_weights))  # [b, k, n]: the head read once per block
    prev = anchor_tokens
    tokens, confidence, probs = [], [], []
    for j in range(cfg.block_size):  # the Markov head is sequential: slot j reads draft j-1
        logits, conf = slot_outputs(params, head_logits[:, j], hidden[:, j], markov_features(params, embed, prev))
        if sampling is None:
            prev = draft_ids(params, argmax(logits))
        else:
            index, q = draft_sample(logits, dataclasses.replace(sampling, position=anchor_positions + 1 + j))
            prev = draft_ids(params, index)
            if "draft_vocab" in params:  # q over the whole vocabulary, for rejection sampling
                q = jnp.zeros((q.shape[0], cfg.vocab_size), q.dtype).at[:, params["draft_vocab"]].set(q)
            probs.append(q)
        tokens.append(prev)
        confidence.append(conf)
    confidence = jnp.stack(confidence, axis=1)
    threshold = cfg.confidence_threshold if threshold is None else threshold
    return Proposal(tokens=jnp.stack(tokens, axis=1), num_drafts=num_to_verify(confidence, threshold),
                    confidence=confidence, draft_probs=jnp.stack(probs, axis=1) if probs else None)


# ----- checkpoints -----

def shipped_drafter(target_path: str | pathlib.Path) -> pathlib.Path | None:
    """The directory of the drafter weld ships for the model at target_path, or None."""
    name = SHIPPED.get(pathlib.Path(target_path).name)
    if name is None:
        return None
    directory = pathlib.Path(__file__).resolve().parents[2] / "drafters" / name
    return directory if (directory / "config.json").is_file() else None


def _leaf(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def save(directory: str | pathlib.Path, params: dict, cfg: DraftConfig, metadata: dict | None = None) -> None:
    """Writes config.json and model.safetensors: one tensor per declared weight, the matrices in
    Q8_0 blocks (int8 codes, and their f16 scales under name + SCALES; version 2: about half the
    bytes of f16, and what the CPU's kernels run, `quantized`, unchanged), vectors f16; and the
    draft vocabulary's ids under a draft vocabulary. `load` also reads version 1 (all f16)."""
    from safetensors.numpy import save_file

    from weld.models.common import quant

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, _ in iter_specs(weight_specs(cfg)):
        # C order: safetensors writes an array's buffer as it lies in memory, and a TPU's arrays
        # can reach the host in another order (a TPU-trained drafter was saved scrambled that way)
        value = np.ascontiguousarray(_leaf(params, path), np.float32)
        if value.ndim == 2:
            tensors[path_str(path)], tensors[path_str(path) + SCALES] = quant.q8_0(value)
        else:
            tensors[path_str(path)] = value.astype(np.float16)
    if cfg.draft_vocab_size:
        tensors[VOCAB_TENSOR] = np.ascontiguousarray(params[VOCAB_TENSOR], np.int32)
    document = {"format": FORMAT, "version": 2, "config": cfg.to_dict(), **({"training": metadata} if metadata else {})}
    # each file under a temporary name, then renamed: an interrupted save leaves no half-written file
    save_file(tensors, str(directory / (WEIGHTS_FILE + ".tmp")), metadata={"format": FORMAT})
    os.replace(directory / (WEIGHTS_FILE + ".tmp"), directory / WEIGHTS_FILE)
    (directory / "config.json.tmp").write_text(json.dumps(document, indent=2) + "\n")
    os.replace(directory / "config.json.tmp", directory / "config.json")


def load(directory: str | pathlib.Path, dtype: Any = jnp.float32) -> tuple[dict, DraftConfig]:
    """Reads a drafter written by `save`, checking every name and shape."""
    from safetensors.numpy import load_file

    from weld.models.common import quant

    directory = pathlib.Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory}: no config.json (expected a drafter written by `weld train-draft`)")
    document = json.loads(config_path.read_text())
    if document.get("format") != FORMAT:
        raise ValueError(f"{config_path}: format is {document.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(document.get("config"), dict):
        raise ValueError(f"{config_path}: no \"config\" object")
    try:
        cfg = DraftConfig.from_dict(document["config"])
    except TypeError as err:  # a field of the wrong type
        raise ValueError(f"{config_path}: {err}") from None
    try:
        tensors = load_file(str(directory / WEIGHTS_FILE))
    except OSError:
        raise
    except Exception as err:  # safetensors' own error for a torn or foreign file
        raise ValueError(f"{directory / WEIGHTS_FILE}: not a readable safetensors file ({err})") from None
    specs = weight_specs(cfg)
    version = document.get("version", 1)
    if version not in (1, 2):
        raise ValueError(f"{config_path}: version {version!r} is not one this weld reads (1, 2)")
    expected = {path_str(path) for path, _ in iter_specs(specs)} | ({VOCAB_TENSOR} if cfg.draft_vocab_size else set())
    if version == 2:  # the matrices' Q8_0 scales
        expected |= {path_str(path) + SCALES for path, spec in iter_specs(specs) if len(spec.shape) == 2}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{directory / WEIGHTS_FILE}: missing tensors {missing}, unexpected tensors {unexpected}")

    def read(path: tuple, spec: WeightSpec) -> jax.Array:
        name = path_str(path)
        array = tensors[name]
        if array.shape != spec.shape:
            raise ValueError(f"{name} has shape {array.shape}, expected {spec.shape}")
        if name + SCALES in tensors:
            scales = tensors[name + SCALES]
            want = (spec.shape[0], -(-spec.shape[1] // quant.BLOCK))
            if array.dtype != np.int8 or scales.shape != want or scales.dtype != np.float16:
                raise ValueError(f"{name}: Q8_0 blocks must be int8 codes {spec.shape} and f16 scales {want}, "
                                 f"got {array.dtype} and {scales.dtype} {scales.shape}")
            array = quant.q8_0_values(array, scales)
        return jnp.asarray(array, dtype)

    params = map_specs(read, specs)
    if cfg.draft_vocab_size:
        ids = np.asarray(tensors[VOCAB_TENSOR])
        if (ids.shape != (cfg.draft_vocab_size,) or ids.dtype != np.int32 or np.any(np.diff(ids) <= 0)
                or ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(f"{VOCAB_TENSOR} must hold {cfg.draft_vocab_size} ascending int32 token ids below "
                             f"{cfg.vocab_size}, got {ids.dtype} {ids.shape}")
        params[VOCAB_TENSOR] = jnp.asarray(ids)
    return params, cfg

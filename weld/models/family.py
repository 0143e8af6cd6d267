"""The model contract: what a family module provides, and what the engine reads from its Config.

A family is one module in `weld/models/` (llama, deepseek, gemma3, gpt_oss, ...), built from
`weld.models.common`. The registry (`weld.models.FAMILIES`) lists the modules; the engine,
the loaders and the drafters reach a model only through these names, never through a
family's private helpers or by probing with `hasattr`.

Weight-tree conventions every family keeps (the drafters share them): `weights["embed"]`
[vocab, d] is the input embedding and `weights.get("lm_head", weights["embed"])` the output
matrix, in either weight form (`layers.unpacked` gives the plain matrix).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from weld.models.common.cache import AttentionBatch, Cache, CacheSpec
from weld.models.common.checkpoint import KeyMap


@runtime_checkable
class ModelConfig(Protocol):
    """The Config fields the engine reads, declared by every family's frozen Config dataclass."""

    architecture: str  # the variant, e.g. "qwen3_moe"
    vocab_size: int
    hidden_size: int  # width of the residual stream (what capture_layers returns per layer)
    num_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: Any  # `common.moe.MoE` of the routed experts, or None: a dense model (what bench floors count)


ENGINE_CONFIG_FIELDS = tuple(ModelConfig.__annotations__)


@dataclasses.dataclass(frozen=True)
class WeightTarget:
    """Where prepared weights will run: `backend` "xla" (fused matrices) or "megakernel" (the
    tree as declared); `pack_for_cpu_kernels`: f32 on the CPU with the native kernels built, so
    projections are packed in panels (`layers.PackedWeight`). Quantization happens earlier, at
    load (`weld.weights.load_model`'s quantization), by the declaration (`WeightSpec.quantize`)."""

    backend: str = "xla"
    pack_for_cpu_kernels: bool = False
    # Fuse q/k/v, gate/up and the like into one matrix: not for weights split over a mesh, whose
    # rows would then mix the parts across devices (`weld.models.common.sharding`).
    fuse: bool = True

    @classmethod
    def on_this_host(cls, backend: str, dtype: Any, one_device: bool = True) -> "WeightTarget":
        """Where a model of `dtype` runs here: packed for the native CPU kernels when it is f32 on
        one device and they are built; fused unless split over a mesh."""
        import jax.numpy as jnp

        from weld.kernels import cpu as cpu_kernels

        return cls(backend, one_device and dtype == jnp.float32 and cpu_kernels.available(), fuse=one_device)


@runtime_checkable
class ModelFamily(Protocol):
    """A family module. Its functions are pure; the cache is passed in, returned and donated."""

    NAME: str
    HF_ARCHITECTURES: Mapping[str, str]  # HF `architectures` entries and `model_type`s -> Config.architecture
    GGUF_ARCHITECTURES: Mapping[str, str]  # llama.cpp's `general.architecture` -> Config.architecture
    Config: type  # frozen dataclass with the ModelConfig fields; Config.from_hf(config.json dict) and
    #               Config.from_gguf(metadata, shapes {name: shape}, read(name) -> np.ndarray)

    def weight_specs(self, cfg: Any) -> dict:
        """The abstract weight tree (`WeightSpec` leaves: shape, logical axes, init)."""

    def hf_keymap(self, cfg: Any) -> KeyMap:
        """transformers' safetensors names -> tree paths."""

    def gguf_keymap(self, cfg: Any) -> KeyMap:
        """llama.cpp's GGUF names -> tree paths."""

    def cache_spec(self, cfg: Any) -> CacheSpec:
        """The per-layer state the model needs; the engine sizes and creates every cache from it."""

    def prepare_weights(self, weights: dict, cfg: Any, target: WeightTarget) -> dict:
        """The loaded tree in the weight forms for `target` (fusing, packing, quantizing)."""

    def embed_tokens(self, weights: dict, cfg: Any, tokens: Any) -> Any:
        """Input embeddings [..., d] of token ids (with any scaling the family applies)."""

    def lm_head(self, weights: dict, cfg: Any, hidden: Any) -> Any:
        """Logits [..., vocab] of final-normed hidden states (with any soft-capping)."""

    def forward(self, weights: dict, cfg: Any, tokens: Any, positions: Any, cache: Cache, batch: AttentionBatch,
                logits_indices: Any = None, capture_layers: tuple[int, ...] = ()) -> tuple[Any, Any, Cache]:
        """(logits f32 [b, n, v], hidden [b, t, d] or the captured streams, the new cache)."""

    def megakernel(self, cfg: Any) -> Callable:
        """The TPU decode megakernel's forward for cfg (same contract for few tokens per row);
        ValueError when the family or this config has none."""


def check_config(cfg: Any) -> None:
    """Raises TypeError when a Config lacks a field the engine reads."""
    missing = [name for name in ENGINE_CONFIG_FIELDS
               if name not in {f.name for f in dataclasses.fields(cfg)} and not hasattr(type(cfg), name)]
    if missing:
        raise TypeError(f"{type(cfg).__module__}.{type(cfg).__name__} lacks the engine's Config fields {missing}")


def output_matrix(weights: dict) -> Any:
    """The output (LM head) matrix of any family's tree: the embedding when tied."""
    return weights.get("lm_head", weights["embed"])


"""Rotary position embeddings: frequency tables (default, linear, llama3, yarn) and their application.

A `Rope` is hashable (part of a frozen Config, so a static jit argument): its table is computed
once per distinct Rope. Two layouts: rotate-half (HF Llama, NeoX: dims [0, e/2) pair with
[e/2, e)) and interleaved (DeepSeek's `rope_interleave`: dims 2i and 2i+1 pair). HF applies the
interleaved form by de-interleaving (evens, then odds) and rotating halves, so the output is
de-interleaved; weld does the same, and since q and k go through the same permutation their
dot products are those of the interleaved rotation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from weld.models.common.rounding import rounded


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling. `kind` is one of default, linear, llama3, yarn."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None  # yarn (DeepSeek): cos/sin scale = mscale(f, mscale) / mscale(f, mscale_all_dim)
    mscale_all_dim: float | None = None
    truncate: bool = True

    SUPPORTED = ("default", "linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context extended `factor` times: 0.1 m ln(f) + 1 (1 if f <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scaling_from_hf(scaling: Mapping[str, Any] | None) -> RopeScaling:
    """A HF `rope_scaling` / `rope_parameters` dict as a RopeScaling (ValueError if unsupported)."""
    if not scaling:
        return RopeScaling()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "dynamic":
        # Dynamic NTK only changes frequencies beyond the trained context, which weld's
        # max_position_embeddings forbids; within it, it equals the default.
        kind = "default"
    if kind not in RopeScaling.SUPPORTED:
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: {RopeScaling.SUPPORTED})")
    optional = lambda key: None if scaling.get(key) is None else float(scaling[key])  # noqa: E731
    return RopeScaling(
        kind=kind,
        factor=float(scaling.get("factor") or 1.0),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=scaling.get("original_max_position_embeddings"),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        attention_factor=optional("attention_factor"),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        truncate=bool(scaling.get("truncate", True)),
    )


def rope_from_hf(cfg: Mapping[str, Any], layer_type: str | None = None) -> tuple[float, RopeScaling]:
    """(theta, scaling) of a HF config in either spelling: `rope_theta` + `rope_scaling` (hub
    checkpoints) or `rope_parameters` (transformers 5), optionally per layer type
    (`rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}`)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):  # per layer type
        params = params.get(layer_type or "full_attention") or params.get("full_attention")
    scaling = cfg.get("rope_scaling")
    if params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = params
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
    return theta, rope_scaling_from_hf(scaling)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling,
                  max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] and the factor applied to cos/sin (yarn's mscale)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = scaling.kind
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        old_ctx = scaling.original_max_position_embeddings or 8192
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        old_ctx = scaling.original_max_position_embeddings or max_position_embeddings
        factor = scaling.factor
        mscale = scaling.attention_factor
        if mscale is None:
            if scaling.mscale and scaling.mscale_all_dim:
                mscale = yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
            else:
                mscale = yarn_mscale(factor)

        def correction_dim(num_rotations: float) -> float:
            return (head_dim * math.log(old_ctx / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

        low = correction_dim(scaling.beta_fast)
        high = correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv, mscale
    raise ValueError(f"unsupported rope scaling {kind!r}; weld supports {RopeScaling.SUPPORTED}")


def rope_angles(positions: jax.Array, inv_freq: np.ndarray, mscale: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [b, t, 1, e] of positions [b, t] in the rotate-half layout: cos of each frequency
    twice, sin as (-sin, sin), so a rotation is x cos + swap_halves(x) sin.

    Materialized (an optimization barrier): fused into the rotation, XLA:CPU recomputed cos and
    sin for every head and element (SmolLM2's decode step at 16 rows: ~5% of it). A forward
    computes them once for all its layers (`decoder.Rows.rope_angles`)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [b, t, e/2]
    c, s = jnp.cos(freqs) * mscale, jnp.sin(freqs) * mscale
    cos, sin = jax.lax.optimization_barrier((jnp.concatenate([c, c], axis=-1), jnp.concatenate([-s, s], axis=-1)))
    return cos[:, :, None, :], sin[:, :, None, :]


def rotate(x: jax.Array, angles: tuple[jax.Array, jax.Array], interleaved: bool = False) -> jax.Array:
    """x [b, t, heads, e] rotated by `rope_angles` (rotate-half layout; `interleaved`: the pairs
    are (2i, 2i+1), and the output comes de-interleaved, as HF's)."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    cos, sin = angles
    half, dtype = x.shape[-1] // 2, x.dtype
    x = x.astype(jnp.float32)
    swapped = jnp.concatenate([x[..., half:], x[..., :half]], axis=-1)
    # each product rounded on its own (`rounded`): one result whatever program this is fused into
    return (rounded(x * cos) + rounded(swapped * sin)).astype(dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, mscale: float,
               interleaved: bool = False) -> jax.Array:
    """Rotates x [b, t, heads, e] by positions [b, t] (`rope_angles`, then `rotate`)."""
    return rotate(x, rope_angles(positions, inv_freq, mscale), interleaved)


@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotary embedding of one attention kind: over `dim` dims of each head, base `theta`,
    `scaling`, optional per-frequency divisors (GGUF's rope_freqs), and the pair layout."""

    dim: int
    theta: float = 10000.0
    scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    freq_factors: tuple[float, ...] | None = None
    interleaved: bool = False

    def __post_init__(self):
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"rotary dims must be even and positive, got {self.dim}")
        if self.scaling.kind not in RopeScaling.SUPPORTED:
            raise ValueError(f"rope scaling {self.scaling.kind!r} is not supported "
                             f"(supported: {RopeScaling.SUPPORTED})")
        if self.freq_factors is not None and len(self.freq_factors) != self.dim // 2:
            raise ValueError(f"rope_freqs has {len(self.freq_factors)} entries, expected {self.dim // 2}")

    def tables(self) -> tuple[np.ndarray, float]:
        """(inv_freq [dim // 2] float64, the cos/sin factor)."""
        return _tables(self)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [b, t, heads, dim] rotated by positions [b, t]."""
        return self.rotate(x, self.angles(positions))

    def angles(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`rope_angles` of positions [b, t] under this rope."""
        inv_freq, mscale = self.tables()
        return rope_angles(positions, inv_freq, mscale)

    def rotate(self, x: jax.Array, angles: tuple[jax.Array, jax.Array]) -> jax.Array:
        """x [b, t, heads, dim] rotated by `angles` (from `angles`, computed once per forward)."""
        return rotate(x, angles, self.interleaved)


@functools.lru_cache(maxsize=64)
def _tables(rope: Rope) -> tuple[np.ndarray, float]:
    inv_freq, mscale = rope_inv_freq(rope.dim, rope.theta, rope.scaling, rope.max_position_embeddings)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / np.asarray(rope.freq_factors, dtype=np.float64)
    return inv_freq, mscale

"""Linear attention with a recurrent state: the gated delta rule (Gated DeltaNet: Qwen3-Next,
Qwen3.5; Kimi Delta Attention: Kimi Linear) and its short causal convolution, with a state slot
per sequence (`cache.RecurrentState`).

Per token t and value head h (k-heads are shared by r = Hv / Hk value heads, as GQA shares
K/V heads), with q and k L2-normalised (q also scaled by dk^-1/2), β = sigmoid(b) and the
log-decay g ≤ 0 (one per head; KDA's is one per key channel):

    S_t = exp(g_t) S_{t-1}                      S: [dk, dv] per head, f32
    S_t = S_t + k_t ⊗ β_t (v_t - S_tᵀ k_t)      (the delta rule)
    o_t = S_tᵀ q_t

Two forms compute it: `delta_rule_recurrent`, one token after another (decode, and the
reference twin), and `delta_rule_chunked`, the parallel form over chunks of C tokens (prefill):
within a chunk, with γ the cumulative sum of g and Γ_ij = exp(γ_i - γ_j) (i ≥ j, else 0),

    T  = (I + strict_lower(diag(β) K Kᵀ ∘ Γ))⁻¹          (a unit-triangular solve)
    U  = T diag(β) V,  W = T diag(β exp(γ)) K
    V' = U - W S,  O = (Q ∘ exp(γ)) S + ((Q Kᵀ) ∘ Γ) V',  S ← exp(γ_C) S + (K ∘ exp(γ_C - γ))ᵀ V'

A padding token (position -1) gets β = 0 and g = 0: it leaves the state as it was.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from weld.models.common.cache import Recurrent, RecurrentState, gather_slots, scatter_slots
from weld.models.common.decoder import Rows
from weld.models.common.layers import linear
from weld.models.common.quant import concat_rows, take_columns, take_rows
from weld.models.common.spec import WeightSpec

CHUNK = 64  # tokens per chunk of the parallel form
RECURRENT_UP_TO = 8  # rows of at most this many tokens (decode, verification) step token by token
KINDS = ("gdn", "kda")


@dataclasses.dataclass(frozen=True)
class DeltaNet:
    """One family's gated-delta-rule layer (hashable: derived from its Config).

    kind "gdn" (Gated DeltaNet: Qwen3-Next, Qwen3.5): a log-decay per value head from its own
    projection a, g = -exp(A_log) softplus(a + dt_bias); k-heads shared by Hv / Hk value heads;
    the output gated by silu(z), z from a full projection.
    kind "kda" (Kimi Delta Attention): a log-decay per key channel from a low-rank projection,
    g = -exp(A_log[h]) softplus(x W_faᵀ W_fbᵀ + dt_bias); as many k- as v-heads; the output gated
    by sigmoid(x W_gaᵀ W_gbᵀ) (rank k_dim both). With `gate_lower_bound` lb (FLA's "safe gate",
    GLM-5-Next's `linear_lower_bound`), g = lb · sigmoid(exp(A_log[h]) (x W_faᵀ W_fbᵀ + dt_bias)),
    so every decay stays above exp(lb)."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_width: int
    norm_eps: float = 1e-6  # of the gated output norm
    kind: str = "gdn"
    gate_lower_bound: float | None = None  # KDA only: a floor (< 0) on the log-decay
    # The value heads' order as the checkpoint stores them: grouped by key head (HF: key head j
    # serves value heads j r .. j r + r - 1) or tiled (llama.cpp's Qwen3.5 GGUFs: value head p is
    # served by key head p mod Hk).
    tiled_v_heads: bool = False
    # The fused q/k/v channels (GDN's w_qkv rows, the conv's rows and the conv windows' channels)
    # in this many groups, each [q | k | v] of its share of the heads (`grouped_channels`): the
    # tensor-parallel megakernel's layout, where each device's contiguous share is its own heads'
    # channels. 1: [q_all | k_all | v_all]. The XLA forward reads either. Tiled value heads are
    # put in grouped order for it (`value_head_order`): a device's key heads then serve its own.
    shards: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"invalid linear attention: kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "kda" and (self.num_k_heads != self.num_v_heads or self.k_dim != self.v_dim):
            raise ValueError("invalid linear attention: KDA has as many key as value heads, of one size")
        if self.gate_lower_bound is not None and (self.kind != "kda" or not self.gate_lower_bound < 0):
            raise ValueError(f"invalid linear attention: a gate lower bound ({self.gate_lower_bound}) must be < 0, "
                             "and only KDA has one")
        for name in ("num_k_heads", "num_v_heads", "k_dim", "v_dim", "conv_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"invalid linear attention: {name} must be a positive integer, got {value!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"invalid linear attention: {self.num_v_heads} value heads are not a multiple of "
                             f"{self.num_k_heads} key heads")
        if self.conv_width < 2:
            raise ValueError(f"invalid linear attention: conv width {self.conv_width} < 2")
        if self.shards > 1 and self.num_k_heads % self.shards:
            raise ValueError(f"invalid linear attention: {self.num_k_heads} key heads do not split into "
                             f"{self.shards} groups")

    @property
    def tiled_sharing(self) -> bool:
        """Whether the computation shares key heads tiled (value head p served by key head p mod
        Hk): a tiled checkpoint's order, unless the layout regrouped it (`value_head_order`)."""
        return self.tiled_v_heads and self.num_v_heads != self.num_k_heads and self.shards == 1

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_channels(self) -> int:
        """q, k and v go through the causal conv together: [q_all | k_all | v_all]."""
        return 2 * self.key_dim + self.value_dim

    def cache(self) -> Recurrent:
        return Recurrent(self.conv_channels, self.conv_width, (self.num_v_heads, self.k_dim, self.v_dim))


def value_head_order(net: DeltaNet) -> np.ndarray | None:
    """The stored value head at each value head position of the layout, or None where the two
    agree. Tiled value heads (`DeltaNet.tiled_v_heads`) cannot be split with their key heads into
    `shards` groups (key head j's value heads are j, j + Hk, ...), so that layout puts them in
    grouped order: position j r + m holds stored head m Hk + j. A relabelling of the value heads
    (every tensor indexed by one moves with it: `group_channels`), so the model computes the same."""
    r = net.num_v_heads // net.num_k_heads
    if not (net.tiled_v_heads and r > 1 and net.shards > 1):
        return None
    heads = np.arange(net.num_v_heads)
    return heads % r * net.num_k_heads + heads // r


def grouped_channels(net: DeltaNet) -> np.ndarray:
    """The flat channel ([q_all | k_all | v_all]) at each position of the grouped layout
    (`DeltaNet.shards` groups, each [q | k | v] of 1/shards of the key heads and the value heads
    they serve)."""
    kd, vd, n = net.key_dim // net.shards, net.value_dim // net.shards, net.shards
    return np.concatenate([np.r_[g * kd:(g + 1) * kd, net.key_dim + g * kd:net.key_dim + (g + 1) * kd,
                                 2 * net.key_dim + g * vd:2 * net.key_dim + (g + 1) * vd] for g in range(n)])


def _value_channels(net: DeltaNet, heads: np.ndarray) -> np.ndarray:
    """The channels of value heads `heads`, head by head."""
    return (heads[:, None] * net.v_dim + np.arange(net.v_dim)).reshape(-1)


def stored_channels(net: DeltaNet) -> np.ndarray:
    """The stored flat channel at each position of the layout: `grouped_channels`, with tiled
    value heads regrouped (`value_head_order`)."""
    order, heads = grouped_channels(net), value_head_order(net)
    if heads is None:
        return order
    return np.concatenate([np.arange(2 * net.key_dim), 2 * net.key_dim + _value_channels(net, heads)])[order]


def group_channels(net: DeltaNet, lw: dict) -> None:
    """One layer's weights, loaded flat, in `net.shards` groups, in place: GDN's w_qkv rows and
    the conv's (KDA's three convs fused first); tiled value heads in grouped order
    (`value_head_order`: the value channels of w_qkv and the conv, w_z's rows, w_b's, w_a's,
    A_log, dt_bias and w_out's columns). A no-op for shards 1 and other layers."""
    fuse_convs(lw)
    if net.shards == 1 or "conv" not in lw:
        return
    order = stored_channels(net)
    heads = value_head_order(net)
    if heads is not None:
        values = _value_channels(net, heads)
        lw["w_z"], lw["w_out"] = take_rows(lw["w_z"], values), take_columns(lw["w_out"], values)
        lw.update({name: take_rows(lw[name], heads) for name in ("w_b", "w_a")})
        lw.update({name: lw[name][heads] for name in ("A_log", "dt_bias")})
    lw["conv"] = lw["conv"][order]
    if "w_qkv" in lw:
        lw["w_qkv"] = take_rows(lw["w_qkv"], order)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(Σx² + eps) over the last axis (as FLA and transformers write it)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x: jax.Array, window: jax.Array, w: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The depthwise causal convolution of x [b, t, C] (no bias, no activation) continuing from
    window [b, C, K-1] (the row's last K-1 earlier inputs, oldest first; zeros for a fresh row)
    with w [C, K]: out_t = Σ_j w[:, j] u_{t-K+1+j}. Returns (out [b, t, C], the new window
    [b, C, K-1]: the last K-1 inputs up to each row's lengths[b]-th token)."""
    t, width = x.shape[1], w.shape[1]
    ext = jnp.concatenate([jnp.swapaxes(window, 1, 2).astype(x.dtype), x], axis=1)  # [b, t + K - 1, C]
    out = sum(ext[:, j:j + t] * w[:, j].astype(x.dtype) for j in range(width))
    new = jax.vmap(lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, width - 1, axis=0))(ext, lengths)
    return out, jnp.swapaxes(new, 1, 2).astype(jnp.float32)


def delta_rule_recurrent(q, k, v, g, beta, state) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token. q, k [b, t, h, dk] (normalised, q scaled), v [b, t, h, dv],
    g [b, t, h] (or [b, t, h, dk]) log-decays, beta [b, t, h], state [b, h, dk, dv] f32.
    Returns (o [b, t, h, dv] f32, the final state)."""

    per_channel = g.ndim == 4

    def step(s, inputs):  # s [b, h, dk, dv]; one token of each
        q_t, k_t, v_t, g_t, b_t = inputs
        s = s * (jnp.exp(g_t)[..., :, None] if per_channel else jnp.exp(g_t)[..., None, None])
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in its chunked parallel form (same contract as `delta_rule_recurrent`).
    The tokens are padded to whole chunks of min(chunk, t) with β = g = 0; each chunk's
    intra-chunk terms are formed inside the loop over chunks, so memory holds one chunk's
    [c, c] (per-channel decay: [c, c, dk]) products at a time. Every exponent is ≤ 0."""
    b, t, h, dk = q.shape
    c = min(chunk, t)
    pad = -t % c
    n = (t + pad) // c
    per_channel = g.ndim == 4

    def chunks(a):  # [b, t, h, ...] -> [n, b, h, c, ...] f32
        a = jnp.pad(a.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(jnp.moveaxis(a.reshape((b, n, c) + a.shape[2:]), 3, 2), 1, 0)

    lower = jnp.tril(jnp.ones((c, c), bool))
    strict = lower & ~jnp.eye(c, dtype=bool)

    def step(s, xs):  # s [b, h, dk, dv]; one chunk of each, [b, h, c, ...]
        q_c, k_c, v_c, g_c, beta_c = xs
        gamma = jnp.cumsum(g_c, axis=2)  # [b, h, c] or [b, h, c, dk]
        if per_channel:  # Σ_d x_id k_jd exp(γ_id - γ_jd) for i >= j
            diff = jnp.where(lower[..., None], gamma[:, :, :, None] - gamma[:, :, None], 0.0)
            decay = jnp.where(lower[..., None], jnp.exp(diff), 0.0)  # [b, h, c, c, dk]
            pair = lambda x: jnp.einsum("bhid,bhjd,bhijd->bhij", x, k_c, decay)
        else:
            decay = jnp.where(lower, jnp.exp(jnp.where(lower, gamma[..., :, None] - gamma[..., None, :], 0.0)), 0.0)
            pair = lambda x: jnp.einsum("bhid,bhjd->bhij", x, k_c) * decay
        kb = k_c * beta_c[..., None]
        a = jnp.eye(c, dtype=jnp.float32) + jnp.where(strict, pair(kb), 0.0)
        gexp = jnp.exp(gamma) if per_channel else jnp.exp(gamma)[..., None]
        # One solve for U and W together: two independent solves may run at once, and XLA:CPU's
        # LAPACK solver waits on the same thread pool it splits its batch over, so two of them
        # can take every worker and wait forever (seen on the 2-core box).
        rhs = jnp.concatenate([v_c * beta_c[..., None], kb * gexp], axis=-1)
        uw = jax.lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)
        u, w = uw[..., :v_c.shape[-1]], uw[..., v_c.shape[-1]:]
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c * gexp, s) + jnp.einsum("bhij,bhjv->bhiv", pair(q_c), v_new)
        last = gamma[:, :, -1]  # [b, h] or [b, h, dk]
        rest = jnp.exp(last[:, :, None] - gamma) if per_channel else jnp.exp(last[..., None] - gamma)[..., None]
        carry = jnp.exp(last)[..., None] if per_channel else jnp.exp(last)[..., None, None]
        s = s * carry + jnp.einsum("bhck,bhcv->bhkv", k_c * rest, v_new)
        return s, o

    state, o = jax.lax.scan(step, state.astype(jnp.float32), tuple(chunks(x) for x in (q, k, v, g, beta)))
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * c, -1)[:, :, :t]  # o [n, b, h, c, dv] -> [b, h, t, dv]
    return jnp.swapaxes(o, 1, 2), state


def delta_rule(q, k, v, g, beta, state) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in the form that suits the row length: token by token up to
    RECURRENT_UP_TO tokens (decode, verification), else in chunks (prefill)."""
    if q.shape[1] <= RECURRENT_UP_TO:
        return delta_rule_recurrent(q, k, v, g, beta, state)
    return delta_rule_chunked(q, k, v, g, beta, state)


def delta_net_core(net: DeltaNet, qkv: jax.Array, beta: jax.Array, g: jax.Array, conv: jax.Array,
                   positions: jax.Array, state: RecurrentState) -> tuple[jax.Array, RecurrentState]:
    """One row group's recurrence. qkv [b, t, C] (before the conv: [q_all | k_all | v_all], or
    grouped as `net.shards` says, as conv [C, K] and the windows are),
    beta [b, t, Hv] (after the sigmoid), g [b, t, Hv] or [b, t, Hv, dk] log-decays, conv [C, K];
    positions [b, t] (-1: padding); state: the rows' conv windows and states (zero for rows that
    start at position 0). Returns (o [b, t, Hv, dv] f32, the rows' new state)."""
    bsz, t = positions.shape
    valid = positions >= 0
    mixed, window = causal_conv(qkv, state.conv, conv, jnp.sum(valid, axis=1).astype(jnp.int32))
    mixed = jax.nn.silu(mixed.astype(jnp.float32))
    if net.shards > 1:  # grouped channels (`DeltaNet.shards`) back in the flat order
        mixed = jnp.take(mixed, np.argsort(grouped_channels(net)), axis=-1)
    kd, r = net.key_dim, net.num_v_heads // net.num_k_heads
    q = l2norm(mixed[..., :kd].reshape(bsz, t, net.num_k_heads, net.k_dim)) * net.k_dim ** -0.5
    k = l2norm(mixed[..., kd:2 * kd].reshape(bsz, t, net.num_k_heads, net.k_dim))
    v = mixed[..., 2 * kd:].reshape(bsz, t, net.num_v_heads, net.v_dim)
    if r > 1:  # each key head serves r value heads (`DeltaNet.tiled_sharing`: which ones)
        share = (lambda x: jnp.tile(x, (1, 1, r, 1))) if net.tiled_sharing else (lambda x: jnp.repeat(x, r, axis=2))
        q, k = share(q), share(k)
    mask = valid.reshape(valid.shape + (1,) * (g.ndim - 2))
    o, s = delta_rule(q, k, v, jnp.where(mask, g, 0.0), jnp.where(valid[..., None], beta, 0.0), state.state)
    return o, RecurrentState(conv=window, state=s)


def gated_rms_norm(o: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, activation) -> jax.Array:
    """weight · RMSNorm(o) · activation(gate) per head over the last axis, in f32 (the output norm)."""
    o = o.astype(jnp.float32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * o * activation(gate.astype(jnp.float32))


def row_states(pool: RecurrentState, slots: jax.Array, positions: jax.Array) -> RecurrentState:
    """The states of rows with slots [b] (-1: none) from the slot pools: zero for a row without a
    slot or whose first position is not > 0 (a fresh sequence starts from nothing)."""
    slots = jnp.where(positions[:, 0] > 0, slots, -1)
    return RecurrentState(conv=gather_slots(pool.conv, slots), state=gather_slots(pool.state, slots))


def write_rows(pool: RecurrentState, slots: jax.Array, positions: jax.Array, new: RecurrentState) -> RecurrentState:
    """The slot pools with each row's new state in its slot (a row without a valid token writes nothing)."""
    slots = jnp.where(jnp.any(positions >= 0, axis=1), slots, -1)
    return RecurrentState(conv=scatter_slots(pool.conv, slots, new.conv),
                          state=scatter_slots(pool.state, slots, new.state))


# ----- the layer -----

def inputs(net: DeltaNet) -> tuple[tuple[str, int], ...]:
    """The layer's input projections of the normed x, (name, rows), in the order `fuse_inputs`
    stacks them: GDN's flat layout of Qwen3.5 (Qwen3-Next's per-key-head groups are reordered to
    it at load); KDA's q, k, v, β and the two low-rank down-projections."""
    if net.kind == "gdn":
        return (("w_qkv", net.conv_channels), ("w_z", net.value_dim), ("w_b", net.num_v_heads),
                ("w_a", net.num_v_heads))
    return (("w_q", net.key_dim), ("w_k", net.key_dim), ("w_v", net.value_dim), ("w_b", net.num_v_heads),
            ("w_fa", net.k_dim), ("w_ga", net.k_dim))


INPUT_NAMES = ("w_qkv", "w_z", "w_b", "w_a", "w_q", "w_k", "w_v", "w_fa", "w_ga")  # of either kind
CONVS = ("conv_q", "conv_k", "conv_v")  # KDA's convs, one per stream (one "conv" [C, K] once prepared)


def delta_net_specs(net: DeltaNet, d: int) -> dict:
    """One linear-attention layer's weights: the input projections [rows, d] (`inputs`), the
    conv [C, K] (KDA: one per q/k/v stream), A_log and dt_bias, the output norm [dv] (a plain
    scale), w_out [d, Hv dv]; KDA also the up-projections w_fb and w_gb [Hv dv, dk]."""
    hv, vd = net.num_v_heads, net.value_dim
    big = ("w_qkv", "w_z", "w_q", "w_k", "w_v")
    low_rank = ("w_fa", "w_ga")  # KDA's down-projections to rank k_dim: every head's, whole under TP
    spec = {name: WeightSpec((rows, d), (None if name in low_rank else "linear_heads", "embed"),
                             quantize="linear" if name in big else None)
            for name, rows in inputs(net)}
    spec.update(norm=WeightSpec((net.v_dim,), (None,), init="ones"),
                w_out=WeightSpec((d, vd), ("embed", "linear_heads"), quantize="linear"),
                A_log=WeightSpec((hv,), ("linear_heads",), init="zeros"))
    if net.kind == "gdn":
        spec.update(conv=WeightSpec((net.conv_channels, net.conv_width), ("linear_heads", None)),
                    dt_bias=WeightSpec((hv,), ("linear_heads",), init="ones"))
    else:
        spec.update({name: WeightSpec((net.key_dim, net.conv_width), ("linear_heads", None)) for name in CONVS})
        spec.update(dt_bias=WeightSpec((vd,), ("linear_heads",), init="zeros"),
                    w_fb=WeightSpec((vd, net.k_dim), ("linear_heads", None)),
                    w_gb=WeightSpec((vd, net.k_dim), ("linear_heads", None)))
    return spec


def fuse_inputs(net: DeltaNet, lw: dict) -> None:
    """Concatenates the input projections into one `w_in` (one matmul instead of four or six;
    `delta_net_layer` takes either form) and KDA's convs into one `conv`, in place."""
    names = [name for name, _ in inputs(net)]
    if names[0] in lw:
        fused = concat_rows([lw[name] for name in names])
        if fused is not None:  # matrices of different forms stay apart
            for name in names:
                del lw[name]
            lw["w_in"] = fused
    fuse_convs(lw)


def fuse_convs(lw: dict) -> None:
    """KDA's three convs (q, k, v) as one `conv` [C, K], in place (GDN has one already)."""
    if CONVS[0] in lw:
        lw["conv"] = jnp.concatenate([lw.pop(name) for name in CONVS])


def kda_log_decay(net: DeltaNet, a_log: jax.Array, f: jax.Array) -> jax.Array:
    """KDA's log-decays [..., H, dk] of the forget projection f [..., H, dk] (dt_bias added):
    -exp(A_log[h]) softplus(f), or lb · sigmoid(exp(A_log[h]) f) with a gate lower bound lb."""
    rate = jnp.exp(a_log.astype(jnp.float32).reshape(-1))[:, None]
    if net.gate_lower_bound is not None:
        return net.gate_lower_bound * jax.nn.sigmoid(rate * f)
    return -rate * jax.nn.softplus(f)


def delta_net_layer(net: DeltaNet, lw: dict, y: jax.Array, rows: Rows,
                    pool: RecurrentState) -> tuple[jax.Array, RecurrentState]:
    """A linear-attention layer on normed y [N, d] -> ([N, d], the slot pools with every row's
    new state). Each row reads its slot's state (zero for a row starting at position 0) and
    writes back the state after its last valid token."""
    names, widths = zip(*inputs(net))
    if "w_in" in lw:
        parts = dict(zip(names, jnp.split(linear(y, lw["w_in"]), list(itertools.accumulate(widths))[:-1], axis=-1)))
    else:
        parts = {name: linear(y, lw[name]) for name in names}
    hv = net.num_v_heads
    if net.kind == "gdn":
        qkv, gate, activation = parts["w_qkv"], parts["w_z"], jax.nn.silu
        g = -jnp.exp(lw["A_log"].astype(jnp.float32)) * jax.nn.softplus(parts["w_a"].astype(jnp.float32) + lw["dt_bias"].astype(jnp.float32))
    else:
        qkv, activation = jnp.concatenate([parts["w_q"], parts["w_k"], parts["w_v"]], axis=-1), jax.nn.sigmoid
        if net.shards > 1:  # the conv's channels are grouped
            qkv = jnp.take(qkv, grouped_channels(net), axis=-1)
        f = linear(parts["w_fa"], lw["w_fb"]).astype(jnp.float32) + lw["dt_bias"].astype(jnp.float32)
        g = kda_log_decay(net, lw["A_log"], f.reshape(-1, hv, net.k_dim))  # [N, Hv, dk]
        gate = linear(parts["w_ga"], lw["w_gb"])
    beta = jax.nn.sigmoid(parts["w_b"].astype(jnp.float32))
    conv = lw["conv"] if "conv" in lw else jnp.concatenate([lw[name] for name in CONVS])

    def run(pool: RecurrentState, positions, slots, qkv, beta, g):
        o, new = delta_net_core(net, qkv, beta, g, conv, positions, row_states(pool, slots, positions))
        return o, write_rows(pool, slots, positions, new)

    o, pool = rows.recur(run, pool, qkv, beta, g)  # [N, Hv, dv]
    o = gated_rms_norm(o, gate.reshape(o.shape), lw["norm"], net.norm_eps, activation).astype(y.dtype)
    return linear(o.reshape(o.shape[0], -1), lw["w_out"]), pool

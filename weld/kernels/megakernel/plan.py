"""The static weight-stream schedule of the decode megakernel and its VMEM budget.

Pure Python: no jax. Given a dense decoder's shapes (plain numbers in a `MegakernelSpec`,
never a model `Config`: kernels may not import models), list every DMA tile the kernel moves
from HBM into its VMEM ring, in stream order:

    for each layer: q, k, v, o, gate, up, down   (row tiles of each [out, in] matrix)
    then the LM head                              (vocabulary tiles of [vocab, hidden])

A linear-attention layer (`linear_layers`: Gated DeltaNet or KDA) streams its input projections,
KDA's two low-rank up-projections and its output projection in place of q, k, v, o (see
`linear_matrices`); a hybrid model (3 linear : 1 full, Qwen3-Next, Kimi Linear) is one weight
stream over both kinds, in layer order.

A sparse (mixture-of-experts) layer streams q, k, v, o, the shared expert's gate, up, down (if
the model has one), then, for each routed pair p = (token, choice) of the call, the chosen
expert's gate, up and down tiles (`Tile.pair` = p). Which expert a pair reads is known only
inside the kernel, after the router: those tiles name a slot of the schedule, the kernel
fills in the expert (its DMAs start once the layer is routed). A step reads the experts its
tokens chose and no other.

The matrices are the model's own (per-layer buffers, not fused or stacked copies), so the
kernel reads the very arrays the XLA path uses.

Weights are stored [out, in] and a tile is a block of whole rows, so a tile computes a slice of
the output features from the full input vector: y[:, r0:r0+rows] = x @ W[r0:r0+rows].T.

The VMEM budget is the ring (depth x the largest tile), the KV tiles (K and V, double
buffered) and the activations of the step. `fit_plan` checks it against the VMEM of a TPU
generation and, when over, shrinks the ring (never below 2 slots: one computing, one in
flight); it raises `VmemBudgetError` with both numbers when even that does not fit.
"""

from __future__ import annotations

import dataclasses
import math

MIB = 1 << 20

# VMEM per TensorCore, and HBM bandwidth, per TPU generation.
# VMEM: JAX 0.10.2 jax/_src/pallas/mosaic/tpu_info.py (`vmem_capacity_bytes`: v5e 128 MiB,
#   v6e 128 MiB, 7/7x 64 MiB); for v7 also the seed article (shared/seeds/004: "每个 TensorCore
#   带有 64 MiB 的 VMEM").
# HBM bandwidth per chip, published: v5e 819 GB/s (https://cloud.google.com/tpu/docs/v5e, "HBM2
#   capacity and bandwidth: 16 GB, 819 GBps"); v6e 1638 GB/s (https://cloud.google.com/tpu/docs/v6e,
#   "HBM bandwidth per chip: 1638 GBps"); TPU7x (Ironwood) 7.37 TB/s per chip (Google's Ironwood
#   announcement; the seed article quotes 7380 GB/s). A TPU7x chip has two TensorCores and JAX
#   exposes each as a device: tpu_info.py gives 3.7e12 B/s per TensorCore, which is what one
#   single-core kernel can draw on.
TPU_GENERATIONS = {
    "v5e": {"vmem_bytes": 128 * MIB, "hbm_bytes_per_s": 819e9, "tensorcores_per_chip": 1},
    "v6e": {"vmem_bytes": 128 * MIB, "hbm_bytes_per_s": 1638e9, "tensorcores_per_chip": 1},
    "v7": {"vmem_bytes": 64 * MIB, "hbm_bytes_per_s": 7370e9, "tensorcores_per_chip": 2},
}

# Mosaic needs VMEM of its own (internal scratch, spills, semaphores): plan for this fraction.
USABLE_VMEM_FRACTION = 0.85
MIN_RING_DEPTH = 2  # one slot computing, one in flight: below this nothing overlaps
INT4_GROUP = 128  # inputs per scale and min of int4 experts (`MegakernelSpec.int4_experts`)
LANES = 128  # a TPU vreg's lanes: a VMEM slice narrower than its buffer must cover whole lane tiles


def ring_width(kind: str, cols: int) -> int:
    """The elements a ring slot holds per row of a `kind` tile of `cols` inputs (int4: packed bytes
    of whole groups)."""
    return -(-cols // INT4_GROUP) * INT4_GROUP // 2 if kind == "int4" else cols


def ring_key(kind: str, cols: int, whole_heads: bool = False, transposed: bool = False) -> tuple[str, int, bool]:
    """The weight ring a `kind` tile of `cols` inputs streams through: one ring per kind for the
    widths of whole lane tiles (a tile takes the slot's first columns), and a ring of its own for
    each other width, exactly that wide (Mosaic slices a VMEM buffer's last dimension only in
    whole 128-lane tiles or whole: SmolLM2's 576 inputs beside its 1536). Tiles of whole heads
    (MLA's W_UK / W_UV, `HEAD_ALIGN` heads tall) get a ring of their own width too: in the
    shared one their height would multiply the widest matrix's row. Transposed tiles
    (`stored_transposed`: [cols, rows] slots, rows on the lanes) share one ring per kind."""
    width = ring_width(kind, cols)
    if transposed:
        return kind, 0, True
    return kind, 0 if width % LANES == 0 and not whole_heads else width, False


def stored_transposed(rows: int, cols: int) -> bool:
    """Whether a TPU keeps a [rows, cols] matrix (or each [rows, cols] of a stack) column-major:
    XLA's default layout puts a dimension of whole 128-lane tiles minor when the last one is not
    (gpt-oss's [4096, 2880] q, SmolLM2's [49152, 576] LM head; checked against libtpu by
    tests/kernels/test_megakernel_compile.py). The kernel streams such a matrix as it lies, its
    transpose [cols, rows] in tiles of columns: a row-major operand would make XLA copy the whole
    matrix into that layout on every call."""
    return cols % LANES != 0 and rows % LANES == 0


HEAD_ALIGN = 8  # whole-head tiles hold a multiple of this many heads: a f32 tile's sublanes, so that a
# looped tile's head offset into [tokens, heads, dims] buffers is provably aligned (Mosaic refuses it otherwise)


def lane_span(n: int) -> int:
    """`n` rounded up to whole 128-lane tiles (Mosaic moves a contiguous slice by DMA only in
    multiples of 512 bytes: 128 f32)."""
    return -(-n // LANES) * LANES


TRACED_ROW_LANES = 2 * LANES  # the narrowest row Mosaic stores at a traced row index (libtpu 0.0.42:
# a [1, 128] or [1, 64] product there is "dynamic store with unaligned indices", [1, 192] and [1, 256]
# are taken; compiled in isolation for v5e)


def traced_row_width(n: int) -> int:
    """Columns a row of `n` is written as at a traced row: whole lane tiles, at least
    `TRACED_ROW_LANES`."""
    return max(lane_span(n), TRACED_ROW_LANES)


def pair_row_width(tiles, name: str, width: int) -> int:
    """Columns of a buffer that a routed pair's `name` tiles (of a `width`-row matrix) are
    written into at the pair's traced row: each tile as `traced_row_width` of its rows, so a
    short last tile (gpt-oss's 2,880 = 11 x 256 + 64) reaches past the matrix."""
    return max([traced_row_width(width)] + [t.row_start + traced_row_width(t.rows) for t in tiles
                                            if t.pair >= 0 and t.matrix == name])


class VmemBudgetError(ValueError):
    """The plan does not fit the target's VMEM even with the smallest ring."""


@dataclasses.dataclass(frozen=True)
class MegakernelSpec:
    """The shapes of a dense decoder layer stack, as plain numbers."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    num_layers: int
    weight_bytes: int = 2  # bytes per weight element (bf16 = 2, int8 = 1, f32 = 4)
    kv_bytes: int = 2  # bytes per cached K/V element
    act_bytes: int = 4  # activations are f32 in VMEM
    batch: int = 1  # sequences (rows) per call
    tokens_per_row: int = 1  # 1 for decode, k + 1 for a speculative verify block
    page_size: int = 16
    pages_per_kv_tile: int = 8
    kv_ring_depth: int = 2  # KV tiles in the attention's ring: depth - 1 in flight while one computes
    scale_bytes: int = 0  # bytes of per-output-channel scale per weight row (int8 weights: 4, f32)
    # matrices streamed as floats of float_bytes beside int8 ones (names of `matrices`: the ones a
    # model's declaration leaves unquantized, e.g. MLA's W_UK / W_UV, linear attention's small
    # projections); they travel in a float ring of their own
    float_matrices: tuple[str, ...] = ()
    float_bytes: int = 4
    # routed experts as int4 per group of INT4_GROUP inputs (codes 2 per byte, an f32 scale and min
    # per group and row: the seeds' int4 g128 experts), beside int8 (or float) matrices
    int4_experts: bool = False
    # switches of the dense family (the kernel reads them; the budget counts their vectors)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rms_norm_eps: float = 1e-6
    rope_mscale: tuple[float, ...] = ()  # per rotary table, a factor on its cos / sin (yarn); empty: 1
    # mixture of experts: the sparse layers' routed experts (stacks [E, out, in]), each token
    # choosing top_k of num_experts, and a shared expert of shared_intermediate (0: none)
    sparse_layers: tuple[int, ...] = ()
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    shared_expert_gate: bool = False  # Qwen3-Next: the shared expert's output times sigmoid(x . g)
    router_bias: bool = False  # a bias added to the router's scores (gpt-oss, DeepSeek-V3's correction)
    # expert parallelism: this device holds num_experts of the num_experts x expert_shards routed
    # experts (shard s: experts [s E, (s + 1) E)), its router rows and bias those experts'
    expert_shards: int = 1
    # experts over data-parallel ranks too: a sparse layer routes the tokens of all moe_ranks ranks
    # (each device holding 1 / expert_shards of the experts, expert_shards counting every rank's)
    moe_ranks: int = 1
    # multi-head latent attention (DeepSeek, Kimi K2), absorbed: attention="mla", then num_kv_heads
    # is 1 and head_dim is kv_lora_rank + rope_dim (the latent cache's width: c_kv | k_pe); the
    # query is q (or q_a -> norm -> q_b when q_lora_rank > 0) of num_heads x (nope_dim + rope_dim)
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0
    rope_interleaved: bool = False  # DeepSeek's pairs (2i, 2i + 1), de-interleaved as HF does
    attn_scale: float = 0.0  # the softmax scale; 0: head_dim ** -0.5
    rope: bool = True  # False: no rotary embedding anywhere (Kimi Linear's NoPE MLA)
    rotary_dim: int = 0  # GQA: RoPE over the first rotary_dim dims of each head (Qwen3-Next); 0: all
    output_gate: bool = False  # GQA: W_q's rows per head are [q | gate], out = (o * sigmoid(gate)) W_o^T
    # linear attention (the gated delta rule over a per-sequence state): the layers in
    # linear_layers, kind "gdn" (Gated DeltaNet) or "kda" (Kimi Delta Attention); the others attend
    linear_layers: tuple[int, ...] = ()
    linear_kind: str = "gdn"
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_width: int = 0
    linear_norm_eps: float = 1e-6  # of the gated output norm
    gate_lower_bound: float = 0.0  # KDA's floor (< 0) on the log-decay; 0: none
    tiled_v_heads: bool = False  # value head p is served by key head p mod Hk (else p // (Hv / Hk))
    # KV heads fewer than the tensor-parallel devices (GQA): the pools hold all kv_pool_heads KV
    # heads on every device (replicated), every device projects and writes all of them (the
    # replicas stay equal) and attends its query heads over its num_kv_heads of them, from head
    # (tensor index x kv_pool_heads / devices); 0: the pools hold num_kv_heads
    kv_pool_heads: int = 0
    # sliding windows and page groups: per layer, its window (0: the whole context) and the page
    # group whose block table it reads (the block tables hold page_groups tables side by side,
    # `weld.models.common.cache.CacheSpec.page_groups`); empty: no windows, one group
    layer_windows: tuple[int, ...] = ()
    layer_groups: tuple[int, ...] = ()
    page_groups: int = 1
    # rotary tables: per layer, which of rope_tables inverse-frequency rows it rotates with
    # (Gemma 3: local and global bases); empty: table 0 everywhere
    layer_rope: tuple[int, ...] = ()
    rope_tables: int = 1
    # Gemma 3's switches: a norm on each sub-layer's output before the residual add (sandwich
    # norms), the dense MLP's activation, a factor on the embedding rows, a soft cap on the logits
    sandwich_norms: bool = False
    mlp_activation: str = "silu"  # or "gelu_tanh"
    embed_scale: float = 1.0
    logit_softcap: float = 0.0  # 0: none; else cap tanh(logits / cap)
    # gpt-oss's switches: a learned sink logit per head in every softmax's denominator; routed
    # experts with biases (gate, up, down) and the clamped SwiGLU
    attention_sinks: bool = False
    expert_bias: bool = False
    expert_activation: str = "swiglu"  # or "clamped_swiglu": min(g, limit), clip(u, +-limit), (u + 1) g sigmoid(alpha g)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it sees the whole context)."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    def group(self, layer: int) -> int:
        """The page group whose block table `layer` reads."""
        return self.layer_groups[layer] if self.layer_groups else 0

    def rope_table(self, layer: int) -> int:
        return self.layer_rope[layer] if self.layer_rope else 0

    def _positive(self, names: tuple[str, ...], when: str = "") -> None:
        """Raises ValueError naming the first of `names` that is not a positive int."""
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MegakernelSpec.{name} must be a positive int{when}, got {value!r}")

    def __post_init__(self):
        self._positive(("hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim", "vocab", "num_layers",
                        "weight_bytes", "kv_bytes", "act_bytes", "batch", "tokens_per_row", "page_size",
                        "pages_per_kv_tile", "kv_ring_depth"))
        if not isinstance(self.scale_bytes, int) or self.scale_bytes < 0:
            raise ValueError(f"MegakernelSpec.scale_bytes must be a non-negative int, got {self.scale_bytes!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.kv_pool_heads and (self.kv_pool_heads % self.num_kv_heads or self.attention != "gqa"):
            raise ValueError(f"kv_pool_heads ({self.kv_pool_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}), with GQA")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"MegakernelSpec.attention must be 'gqa' or 'mla', got {self.attention!r}")
        if self.mla:
            self._positive(("kv_lora_rank", "nope_dim", "rope_dim", "v_dim"), " with MLA")
            if self.num_kv_heads != 1 or self.head_dim != self.kv_lora_rank + self.rope_dim:
                raise ValueError(f"MLA attends over one latent head of kv_lora_rank + rope_dim = "
                                 f"{self.kv_lora_rank + self.rope_dim} dims: num_kv_heads must be 1 and head_dim "
                                 f"that, got {self.num_kv_heads} and {self.head_dim}")
        if self.sparse_layers:
            if not all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.sparse_layers):
                raise ValueError(f"sparse_layers {self.sparse_layers} must lie in [0, {self.num_layers})")
            self._positive(("num_experts", "top_k", "expert_intermediate", "expert_shards", "moe_ranks"),
                           " with sparse layers")
            if self.expert_shards % self.moe_ranks:
                raise ValueError(f"expert_shards ({self.expert_shards}) must count every one of the {self.moe_ranks} "
                                 "ranks' shards")
            if self.top_k > self.routed_experts:
                raise ValueError(f"top_k ({self.top_k}) exceeds the routed experts ({self.routed_experts})")
        if not isinstance(self.rotary_dim, int) or self.rotary_dim < 0 or self.rotary_dim % 2 \
                or self.rotary_dim > self.head_dim or (self.rotary_dim and self.mla):
            raise ValueError(f"MegakernelSpec.rotary_dim must be even, at most head_dim ({self.head_dim}) and GQA's "
                             f"only, got {self.rotary_dim!r}")
        if self.output_gate and self.mla:
            raise ValueError("an output gate is GQA's (MLA has none)")
        self._positive(("page_groups", "rope_tables"))
        for name, bound in (("layer_windows", None), ("layer_groups", self.page_groups),
                            ("layer_rope", self.rope_tables)):
            values = getattr(self, name)
            if values and (len(values) != self.num_layers or any(
                    not isinstance(v, int) or v < 0 or (bound is not None and v >= bound) for v in values)):
                raise ValueError(f"MegakernelSpec.{name} must be empty or one int per layer ({self.num_layers}) in "
                                 f"[0, {bound if bound is not None else 'inf'}), got {values!r}")
        if self.rope_mscale and len(self.rope_mscale) != self.rope_tables:
            raise ValueError(f"MegakernelSpec.rope_mscale must be empty or one factor per rotary table "
                             f"({self.rope_tables}), got {self.rope_mscale!r}")
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"MegakernelSpec.mlp_activation must be 'silu' or 'gelu_tanh', got {self.mlp_activation!r}")
        if self.expert_activation not in ("swiglu", "clamped_swiglu"):
            raise ValueError(f"MegakernelSpec.expert_activation must be 'swiglu' or 'clamped_swiglu', got "
                             f"{self.expert_activation!r}")
        if self.logit_softcap < 0:
            raise ValueError(f"MegakernelSpec.logit_softcap must be >= 0 (0: none), got {self.logit_softcap}")
        if self.linear_layers:
            if not all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.linear_layers):
                raise ValueError(f"linear_layers {self.linear_layers} must lie in [0, {self.num_layers})")
            if self.linear_kind not in ("gdn", "kda"):
                raise ValueError(f"MegakernelSpec.linear_kind must be 'gdn' or 'kda', got {self.linear_kind!r}")
            self._positive(("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim", "conv_width"),
                           " with linear layers")
            if self.linear_v_heads % self.linear_k_heads or self.conv_width < 2:
                raise ValueError(f"linear attention needs value heads ({self.linear_v_heads}) a multiple of key heads "
                                 f"({self.linear_k_heads}) and a conv width >= 2 (got {self.conv_width})")
            if self.linear_kind == "kda" and (self.linear_k_heads != self.linear_v_heads
                                              or self.linear_k_dim != self.linear_v_dim):
                raise ValueError("KDA has as many key as value heads, of one size")
            if self.gate_lower_bound > 0 or (self.gate_lower_bound and self.linear_kind != "kda"):
                raise ValueError(f"a gate lower bound ({self.gate_lower_bound}) must be < 0, and only KDA has one")

    @property
    def pool_kv_heads(self) -> int:
        """KV heads the pools hold and the k / v projections make (`kv_pool_heads`)."""
        return self.kv_pool_heads or self.num_kv_heads

    @property
    def tokens(self) -> int:
        """Activation rows of one call: batch x tokens_per_row."""
        return self.batch * self.tokens_per_row

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    @property
    def q_lora(self) -> bool:
        return self.mla and self.q_lora_rank > 0

    @property
    def rope_dims(self) -> int:
        """The rotated dims of each head: all of them, the first rotary_dim, or MLA's rope part."""
        return self.rope_dim if self.mla else (self.rotary_dim or self.head_dim)

    @property
    def q_proj_dim(self) -> int:
        """Rows of the query projection: the heads' queries (with an output gate, and their gates;
        MLA: nope + rope dims per head)."""
        if self.mla:
            return self.num_heads * (self.nope_dim + self.rope_dim)
        return self.num_heads * self.head_dim * (2 if self.output_gate else 1)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over paged K/V (or MLA's latent pages): all but the linear ones."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_k_heads * self.linear_k_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_v_heads * self.linear_v_dim

    @property
    def conv_channels(self) -> int:
        """q, k and v go through the short causal conv together: [q_all | k_all | v_all]."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def decay_width(self) -> int:
        """Log-decays per token: one per value head (GDN), one per head and key channel (KDA)."""
        return self.linear_value_dim if self.linear_kind == "kda" else self.linear_v_heads

    def state_bytes(self) -> int:
        """One sequence's recurrent state in one linear layer: the conv window and the delta-rule
        state [Hv, dk, dv], both f32."""
        return 4 * (self.conv_channels * (self.conv_width - 1)
                    + self.linear_v_heads * self.linear_k_dim * self.linear_v_dim)

    def linear_matrices(self) -> list[tuple[str, int, int]]:
        """A linear-attention layer's matrices in stream order. GDN: the conv's input [q | k | v],
        the output gate z, beta and the decay's a; KDA: q, k, v, beta, the decay's and the output
        gate's low-rank down-projections, then their up-projections (whose input is the former's
        output); both: the output projection."""
        d, kd, vd, hv, dk = self.hidden, self.linear_key_dim, self.linear_value_dim, self.linear_v_heads, self.linear_k_dim
        out = [("w_out", d, vd)]
        if self.linear_kind == "gdn":
            return [("w_qkv", self.conv_channels, d), ("w_z", vd, d), ("w_b", hv, d), ("w_a", hv, d)] + out
        return [("w_q", kd, d), ("w_k", kd, d), ("w_v", vd, d), ("w_b", hv, d), ("w_fa", dk, d), ("w_ga", dk, d),
                ("w_fb", vd, dk), ("w_gb", vd, dk)] + out

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    def head_rows(self, name: str) -> int:
        """Rows per head of a matrix whose tiles must hold whole heads (MLA's W_UK, W_UV), else 1."""
        return {"w_uk": self.nope_dim, "w_uv": self.v_dim}.get(name, 1) if self.mla else 1

    def attention_matrices(self) -> list[tuple[str, int, int]]:
        """The attention's matrices in stream order. MLA: the query (or its LoRA pair), the joint
        KV down-projection, W_UK [heads x nope, latent] (folded into the query), W_UV [heads x
        v, latent] (applied to the attention's latent output), the output projection."""
        d = self.hidden
        if not self.mla:
            q, kv = self.num_heads * self.head_dim, self.pool_kv_heads * self.head_dim
            return [("q", self.q_proj_dim, d), ("k", kv, d), ("v", kv, d), ("o", d, q)]
        nh, r = self.num_heads, self.kv_lora_rank
        q_out = self.q_proj_dim
        query = [("q_a", self.q_lora_rank, d), ("q_b", q_out, self.q_lora_rank)] if self.q_lora else [("q", q_out, d)]
        return query + [("kv_a", r + self.rope_dim, d), ("w_uk", nh * self.nope_dim, r), ("w_uv", nh * self.v_dim, r),
                        ("o", d, nh * self.v_dim)]

    @property
    def routed_experts(self) -> int:
        """The experts the router chooses among: every device's (`expert_shards` x num_experts)."""
        return self.num_experts * self.expert_shards

    @property
    def moe_tokens(self) -> int:
        """Rows a sparse layer routes: every data-parallel rank's tokens (`moe_ranks`)."""
        return self.tokens * self.moe_ranks

    @property
    def pairs(self) -> int:
        """Routed (token, choice) pairs of one call in a sparse layer."""
        return self.moe_tokens * self.top_k

    def shard(self, tensor: int, expert_shards: int = 1, expert_ranks: int = 1) -> "MegakernelSpec":
        """This spec as one of `tensor` tensor-parallel devices runs it (`weld.models.megakernel`'s
        `local_config`, in the kernel's terms): heads (GQA: and KV heads; MLA: query heads, the
        latent whole; KV heads fewer than `tensor` whole on every device, each attending with one),
        linear-attention heads, the dense MLP's intermediate (where a layer is dense), the
        vocabulary and the shared expert split `tensor` ways; the routed experts
        `expert_shards` ways (x `expert_ranks` data-parallel ranks when the experts are split
        over them too: the sparse layers then route every rank's tokens), each expert's FFN over
        the tensor / expert_shards devices of a shard. ValueError naming what does not split."""
        if tensor == 1 and expert_ranks == 1:
            return self
        dense = len(self.sparse_layers) < self.num_layers
        split = {"num_heads": tensor, "vocab": tensor}
        whole_kv = {}
        if not self.mla and self.num_kv_heads < tensor and not tensor % self.num_kv_heads:
            whole_kv = dict(kv_pool_heads=self.num_kv_heads, num_kv_heads=1)
        elif not self.mla:
            split["num_kv_heads"] = tensor
        if dense:
            split["intermediate"] = tensor
        if self.linear_layers:
            split.update(linear_k_heads=tensor, linear_v_heads=tensor)
        if self.sparse_layers:
            split.update(num_experts=expert_shards * expert_ranks, expert_intermediate=tensor // expert_shards,
                         shared_intermediate=tensor)
        if tensor % expert_shards:
            raise ValueError(f"{expert_shards} expert shards do not divide {tensor} tensor-parallel devices")
        bad = [f"{name} {getattr(self, name)} over {k}" for name, k in split.items() if getattr(self, name) % k]
        if bad:
            raise ValueError(f"this spec does not split over {tensor} devices: {', '.join(bad)}")
        moe = dict(expert_shards=expert_shards * expert_ranks, moe_ranks=expert_ranks) if self.sparse_layers else {}
        return dataclasses.replace(self, **moe, **whole_kv,
                                   **{name: getattr(self, name) // k for name, k in split.items()})

    def matrices(self, layer: int = 0) -> list[tuple[str, int, int]]:
        """A layer's static weight matrices in stream order: (name, rows = out, cols = in). A
        sparse layer's routed experts come after these, per pair (`expert_matrices`)."""
        d, f = self.hidden, self.intermediate
        attention = self.linear_matrices() if layer in self.linear_layers else self.attention_matrices()
        if layer not in self.sparse_layers:
            return attention + [("gate", f, d), ("up", f, d), ("down", d, f)]
        s = self.shared_intermediate
        return attention + ([("shared_gate", s, d), ("shared_up", s, d), ("shared_down", d, s)] if s else [])

    def expert_matrices(self) -> list[tuple[str, int, int]]:
        """One expert's matrices (rows of its stacks [E, out, in]), streamed once per routed pair."""
        d, i = self.hidden, self.expert_intermediate
        return [("gate", i, d), ("up", i, d), ("down", d, i)]

    def kind(self, name: str, expert: bool = False) -> str:
        """How matrix `name` (a routed expert's: `expert`) streams: "int4" (packed codes, scales and
        mins per group), "int8" (codes and a scale per row) or "float"."""
        if expert and self.int4_experts:
            return "int4"
        return "int8" if self.scale_bytes and name not in self.float_matrices else "float"

    def transposed(self, name: str, rows: int, cols: int, expert: bool = False) -> bool:
        """Whether matrix `name` ([rows, cols]) streams from its transpose (`stored_transposed`):
        int8 and float matrices multiplied as they are (not MLA's whole-head W_UK / W_UV, nor
        int4 experts, which unpack by row)."""
        return self.kind(name, expert) != "int4" and self.head_rows(name) == 1 and stored_transposed(rows, cols)

    def tile_bytes(self, name: str, rows: int, cols: int, expert: bool = False) -> int:
        """Bytes of `rows` rows of matrix `name`: its elements, and its scales (and mins) when
        quantized; an int4 row is padded to whole groups."""
        kind = self.kind(name, expert)
        if kind == "int4":
            groups = -(-cols // INT4_GROUP)
            return rows * groups * (INT4_GROUP // 2 + 8)
        if kind == "float":
            return rows * cols * (self.float_bytes if self.scale_bytes else self.weight_bytes)
        return rows * (cols * self.weight_bytes + self.scale_bytes)

    def layer_weight_bytes(self, layer: int = 0) -> int:
        """Bytes a call streams for one layer: a sparse layer's experts once per routed pair (under
        expert parallelism, the expected share: a pair's expert is fetched only by the devices
        holding it, 1 / expert_shards of the pairs when the choices spread evenly)."""
        static = sum(self.tile_bytes(n, r, c) for n, r, c in self.matrices(layer))
        if layer in self.sparse_layers:
            experts = self.pairs * sum(self.tile_bytes(n, r, c, expert=True) for n, r, c in self.expert_matrices())
            static += experts // self.expert_shards
        return static

    def conv_bytes(self) -> int:
        """A linear layer's conv weights [C, K], read whole into VMEM (f32) beside the stream."""
        return 4 * self.conv_channels * self.conv_width if self.linear_layers else 0

    def router_bytes(self) -> int:
        """A sparse layer's router [E, hidden], read whole into VMEM (f32) beside the stream, and
        with expert biases each routed pair's bias rows (gate, up, down; f32)."""
        if not self.sparse_layers:
            return 0
        biases = self.pairs * 4 * (2 * self.expert_intermediate + self.hidden) if self.expert_bias else 0
        return 4 * self.num_experts * self.hidden + biases

    def lm_head_bytes(self) -> int:
        return self.vocab * (self.hidden * self.weight_bytes + self.scale_bytes)


@dataclasses.dataclass(frozen=True)
class Tile:
    """One DMA of the weight stream: rows [row_start, row_start + rows) of one matrix."""

    index: int  # position in the stream
    layer: int  # -1 for the LM head
    matrix: str  # q | k | v | o | gate | up | down | shared_gate | shared_up | shared_down | lm_head
    row_start: int
    rows: int
    cols: int
    nbytes: int
    pair: int = -1  # a routed expert's tile: the (token, choice) pair whose expert it reads; -1: static
    transposed: bool = False  # streamed from the matrix's transpose ([cols, rows]: `stored_transposed`)

    @property
    def key(self) -> tuple[int, str, int]:
        """What the kernel asks for: (layer, matrix, pair)."""
        return self.layer, self.matrix, self.pair


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: MegakernelSpec
    tiles: tuple[Tile, ...]
    ring_depth: int
    slot_bytes: int  # every ring slot is [max tile rows, max tile cols] (see make_plan); a mixed model: one of each ring
    ring_bytes: int
    kv_bytes: int
    activation_bytes: int
    generation: str | None = None
    vmem_limit_bytes: int | None = None

    @property
    def vmem_bytes(self) -> int:
        return self.ring_bytes + self.kv_bytes + self.activation_bytes

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tiles)


def row_tiles(rows: int, tile_rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of each tile of a `rows`-tall matrix; the last one may be shorter."""
    return [(start, min(tile_rows, rows - start)) for start in range(0, rows, tile_rows)]


def stream_schedule(spec: MegakernelSpec, *, tile_rows: int = 256, vocab_tile_rows: int = 256) -> list[Tile]:
    """Every weight tile of one decode step, in the order the kernel streams them.

    The order never stops at a layer boundary: the tile after layer i's last `down` tile is
    layer i+1's first `qkv` tile, and after the last layer the stream runs on into the LM head.
    A matrix whose row count is not a multiple of the tile rows ends in one shorter tile.
    """
    if tile_rows <= 0 or vocab_tile_rows <= 0:
        raise ValueError(f"tile_rows ({tile_rows}) and vocab_tile_rows ({vocab_tile_rows}) must be positive")
    tiles: list[Tile] = []

    def add(layer: int, name: str, rows: int, cols: int, per_tile: int, pair: int = -1):
        transposed = spec.transposed(name, rows, cols, pair >= 0)
        for start, n in row_tiles(rows, per_tile):
            tiles.append(Tile(len(tiles), layer, name, start, n, cols, spec.tile_bytes(name, n, cols, pair >= 0),
                              pair, transposed))

    for layer in range(spec.num_layers):
        for name, rows, cols in spec.matrices(layer):
            per_head = spec.head_rows(name)  # whole heads per tile, HEAD_ALIGN of them or all
            heads = max(1, tile_rows // per_head)
            if per_head > 1:
                heads = min(rows // per_head, -(-heads // HEAD_ALIGN) * HEAD_ALIGN)
            add(layer, name, rows, cols, heads * per_head)
        if layer in spec.sparse_layers:
            for pair in range(spec.pairs):
                for name, rows, cols in spec.expert_matrices():
                    add(layer, name, rows, cols, tile_rows, pair)
    add(-1, "lm_head", spec.vocab, spec.hidden, vocab_tile_rows)
    return tiles


def kv_tile_bytes(spec: MegakernelSpec) -> int:
    """K and V rings of `kv_ring_depth` tiles of `pages_per_kv_tile` pages of token rows (KV x E
    lanes, padded to whole lane tiles; the rows' tiles stream as one sequence)."""
    width = -(-spec.pool_kv_heads * spec.head_dim // 128) * 128
    tile = spec.pages_per_kv_tile * spec.page_size * width * spec.kv_bytes
    return 2 * spec.kv_ring_depth * tile


def activation_bytes(spec: MegakernelSpec, tiles=()) -> int:
    """The kernel's VMEM besides the ring and KV tiles (decode.py allocates exactly these;
    `tiles`: the schedule, whose routed tiles set the pair buffers' widths, `pair_row_width`).

    Per activation row (batch x tokens_per_row), f32 unless noted: residual, normed input and
    the o / down output and the embedding row (4 x hidden), the query projection, q
    by head and the attention output (q_proj + 2 x q), k and v (2 x kv), the new K / V (cache
    dtype), gate and up (2 x intermediate), the whole row of logits (they leave VMEM once, at the
    end) and the greedy id. Plus the small per-layer vectors held whole: two norms per layer, the
    final norm, the rope frequencies, and the qkv / o biases and q / k norms where the model has
    them. Linear-attention layers add their projections' outputs per row, the conv weights of a
    layer and two rows' recurrent states (double buffered). And each row's embedding (an input).
    """
    q, kv, d, e = spec.num_heads * spec.head_dim, spec.pool_kv_heads * spec.head_dim, spec.hidden, spec.head_dim
    a = spec.act_bytes
    per_row = (a * (4 * d + spec.q_proj_dim + 2 * q + 2 * kv + 2 * spec.intermediate + spec.vocab) + 4
               + 2 * kv * spec.kv_bytes)
    vectors = spec.num_layers * (4 if spec.sandwich_norms else 2) * d + d
    vectors += spec.rope_tables * spec.rope_dims // 2 if spec.rope else 0
    fixed = 0
    if spec.qkv_bias:
        vectors += spec.num_layers * (spec.q_proj_dim + 2 * kv)
    if spec.o_bias:
        vectors += spec.num_layers * d
    if spec.qk_norm:
        vectors += spec.num_layers * 2 * e
    if spec.attention_sinks:
        vectors += spec.num_layers * spec.num_heads
    if spec.mla:  # per row: the q LoRA's output, the latent output's values; per layer: two norms
        per_row += a * (spec.q_lora_rank + spec.num_heads * spec.v_dim)
        vectors += spec.num_layers * (spec.kv_lora_rank + spec.q_lora_rank)
    if spec.linear_layers:
        # per row: the conv's input, the output gate, the decays, beta, the output (and KDA's two
        # low-rank inputs); per layer: A_log, dt_bias, the output norm; the layer's conv weights
        # and two rows' states
        vd, hv = spec.linear_value_dim, spec.linear_v_heads
        per_row += a * (spec.conv_channels + 2 * vd + spec.decay_width + hv
                        + (2 * spec.linear_k_dim if spec.linear_kind == "kda" else 0))
        vectors += spec.num_layers * (hv + (vd if spec.linear_kind == "kda" else hv) + spec.linear_v_dim)
        fixed += spec.conv_bytes() + 2 * spec.state_bytes()
    if spec.sparse_layers:
        # per row: the router's scores and the routing weights, the normed input the pairs read;
        # per pair: the expert's gate and up; the shared expert's gate and up; the chosen experts'
        # ids (SMEM) and the router
        # (experts over data-parallel ranks: per row of every rank, its scores, input and output)
        per_row += a * 2 * spec.shared_intermediate
        # (per pair its gate and up, per row the routed outputs' sum: rows written at a traced
        # row, `pair_row_width` wide)
        inter = spec.expert_intermediate
        per_moe_row = a * (spec.routed_experts + spec.top_k + d) + 4 * spec.top_k \
            + spec.top_k * a * (pair_row_width(tiles, "gate", inter) + pair_row_width(tiles, "up", inter)) \
            + a * pair_row_width(tiles, "down", d) + (a * d if spec.moe_ranks > 1 else 0)
        if spec.expert_bias:  # each pair's bias rows (gate, up, down), as wide as rows at a traced row
            per_moe_row += spec.top_k * a * (2 * traced_row_width(inter) + traced_row_width(d))
        fixed += spec.moe_tokens * per_moe_row
        vectors += spec.num_layers * ((spec.num_experts if spec.router_bias else 0)
                                      + (d if spec.shared_expert_gate else 0))
        vectors += spec.num_experts * d  # the router, read whole (the pairs' bias rows are counted per row)
    return spec.tokens * per_row + 4 * vectors + fixed


def make_plan(spec: MegakernelSpec, *, ring_depth: int = 4, tile_rows: int = 256,
              vocab_tile_rows: int = 256) -> Plan:
    """The schedule and its VMEM bytes for a ring of `ring_depth` slots (no limit checked)."""
    if ring_depth < MIN_RING_DEPTH:
        raise ValueError(f"ring_depth must be >= {MIN_RING_DEPTH}, got {ring_depth}")
    tiles = stream_schedule(spec, tile_rows=tile_rows, vocab_tile_rows=vocab_tile_rows)
    # A slot is one rectangular VMEM buffer that any tile fits (stream.py slices it per tile), so
    # it is the most rows times the most columns, not the largest tile: keep vocab tiles no taller
    # than the others or the ring grows to vocab_tile_rows x intermediate. A model with int8 and
    # float matrices has a ring of each, slot for slot (and a ring per width off the lane tiles:
    # `ring_key`).
    rings: dict[tuple[str, int], list[Tile]] = {}
    for t in tiles:
        rings.setdefault(ring_key(spec.kind(t.matrix, t.pair >= 0), t.cols, spec.head_rows(t.matrix) > 1,
                                  t.transposed), []).append(t)
    slot = sum(spec.tile_bytes(kept[0].matrix, max(t.rows for t in kept), max(t.cols for t in kept), kept[0].pair >= 0)
               for kept in rings.values())
    return Plan(spec, tuple(tiles), ring_depth, slot, ring_depth * slot, kv_tile_bytes(spec),
                activation_bytes(spec, tiles))


def vmem_limit(generation: str) -> int:
    """Bytes of VMEM the kernel may plan for on one TensorCore of `generation`."""
    if generation not in TPU_GENERATIONS:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {sorted(TPU_GENERATIONS)}")
    return int(TPU_GENERATIONS[generation]["vmem_bytes"] * USABLE_VMEM_FRACTION)


def fit_plan(spec: MegakernelSpec, generation: str, *, ring_depth: int = 4, tile_rows: int = 256,
             vocab_tile_rows: int = 256) -> Plan:
    """The deepest ring (<= ring_depth) whose plan fits `generation`'s VMEM.

    Raises VmemBudgetError, stating the bytes needed and available, when even a ring of
    MIN_RING_DEPTH slots does not fit (then the tiles themselves must shrink).
    """
    limit = vmem_limit(generation)
    for depth in range(ring_depth, MIN_RING_DEPTH - 1, -1):
        plan = make_plan(spec, ring_depth=depth, tile_rows=tile_rows, vocab_tile_rows=vocab_tile_rows)
        if plan.vmem_bytes <= limit:
            return dataclasses.replace(plan, generation=generation, vmem_limit_bytes=limit)
    raise VmemBudgetError(
        f"megakernel plan needs {plan.vmem_bytes} B of VMEM with the smallest ring ({MIN_RING_DEPTH} slots of "
        f"{plan.slot_bytes} B, KV tiles {plan.kv_bytes} B, activations {plan.activation_bytes} B) but {generation} "
        f"allows {limit} B ({USABLE_VMEM_FRACTION:.0%} of {TPU_GENERATIONS[generation]['vmem_bytes']} B): "
        f"use smaller tile_rows ({tile_rows}) / vocab_tile_rows ({vocab_tile_rows}) or a smaller batch")


def step_bytes(spec: MegakernelSpec, context_len: int) -> int:
    """HBM bytes one call must move: all weights once (with their scales), each row's K/V (MLA:
    its latent) up to `context_len` tokens in every attention layer (whole pages), the new K/V
    written, each row's recurrent state read and written in every linear layer, the routers and
    convs, the embedding rows read and the f32 logits written."""
    pools = 1 if spec.mla else 2
    attending = len(spec.attention_layers)
    kv_token = spec.pool_kv_heads * spec.head_dim * spec.kv_bytes

    def pages(layer):  # a window's keys span at most window - 1 + page_size slots of whole pages
        window = spec.window(layer)
        seen = context_len if window is None else min(context_len, window + spec.page_size - 1)
        return math.ceil(seen / spec.page_size)
    kv_read = spec.batch * pools * spec.page_size * kv_token * sum(pages(i) for i in spec.attention_layers)
    kv_write = spec.tokens * attending * pools * kv_token
    states = 2 * spec.batch * len(spec.linear_layers) * spec.state_bytes() if spec.linear_layers else 0
    io = spec.tokens * (spec.hidden * spec.weight_bytes + spec.vocab * 4)
    weights = sum(spec.layer_weight_bytes(layer) for layer in range(spec.num_layers)) + spec.lm_head_bytes()
    side = len(spec.sparse_layers) * spec.router_bytes() + len(spec.linear_layers) * spec.conv_bytes()
    return weights + side + kv_read + kv_write + states + io


def step_floor_seconds(spec: MegakernelSpec, generation: str, context_len: int) -> float:
    """The HBM-bandwidth floor of one decode step on one chip of `generation`."""
    return step_bytes(spec, context_len) / TPU_GENERATIONS[generation]["hbm_bytes_per_s"]

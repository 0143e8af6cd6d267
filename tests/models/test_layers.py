"""linear's CPU forms (packed weights through the native kernel; otherwise a multiply +
reduction for 2..64 rows and a dot beyond), fused and packed projections."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld.kernels import cpu as cpu_kernels
from weld.models import llama
from weld.models.family import WeightTarget, output_matrix
from weld.models.common import layers, quant
from weld.models.common.spec import random_weights


def _hlo(fn, *args) -> str:
    """The compiled program of a fresh wrapper: JAX caches traces per function, and linear reads
    WELD_CPU_SMALL_MATMUL when traced."""
    return jax.jit(lambda *a: fn(*a)).lower(*args).compile().as_text()


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 65])
def test_linear_matches_numpy_at_every_row_count(rows):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96), np.float32)
    w = rng.standard_normal((40, 96), np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    got = np.asarray(jax.jit(layers.linear)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64) + b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (1, 16, 7), (2, 12, 64), (3, 5, 8), (5, 17, 24), (6, 33, 40),
                                   (13, 48, 100), (16, 960, 576)])
def test_packed_matmul_matches_numpy(m, n, k):
    """Every path of matmul.cc: one row (k a multiple of 4 or not), blocks of 6 rows and each
    remainder 1-5, full and padded last panels."""
    assert cpu_kernels.available(), cpu_kernels._state.get("error")
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((n, k), np.float32)
    packed = layers.pack_weight(jnp.asarray(w))
    assert packed.panels.shape == (-(-n // 16), k, 16) and packed.shape == (n, k)
    np.testing.assert_array_equal(np.asarray(packed.unpacked()), w)
    got = np.asarray(jax.jit(cpu_kernels.packed_matmul, static_argnums=2)(jnp.asarray(x), packed.panels, n))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_packed_matmul_gradients_match_numpy():
    """The kernel has no derivative of its own: its custom VJP (XLA on the panels) gives both
    cotangents, as the DSpark trainer needs through a packed LM head."""
    assert cpu_kernels.available(), cpu_kernels._state.get("error")
    rng = np.random.default_rng(7)
    m, n, k = 5, 37, 24  # a padded last panel
    x, w, c = (rng.standard_normal(s, np.float32) for s in ((m, k), (n, k), (m, n)))
    packed = layers.pack_weight(jnp.asarray(w))

    def loss(x, panels):
        return jnp.sum(cpu_kernels.packed_matmul(x, panels, n) * c)

    dx, dpanels = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x), packed.panels)
    np.testing.assert_allclose(np.asarray(dx), c @ w, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(layers.PackedWeight(dpanels, n).unpacked()), c.T @ x, rtol=1e-5, atol=1e-4)
    assert not np.asarray(dpanels).reshape(-1, 16)[:, n % 16:][-k:].any()  # the padding gets no gradient


def test_packed_weight_gathers_rows():
    """A packed tied embedding still serves lookups: indexing gives rows of the [n, k] matrix."""
    w = np.random.default_rng(1).standard_normal((37, 8), np.float32)
    packed = layers.pack_weight(jnp.asarray(w))
    ids = np.array([[0, 15, 16], [36, 3, 36]], np.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda p, i: p[i])(packed, jnp.asarray(ids))), w[ids])
    np.testing.assert_array_equal(np.asarray(layers.unpacked(packed)), w)
    assert layers.unpacked(w) is w


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_linear_on_packed_weights(rows, kernels, monkeypatch):
    """linear takes a PackedWeight: the native kernel for f32 rows (decode and prefill alike), XLA's
    dot on the panels with the kernels off; the same numbers either way."""
    monkeypatch.setenv("WELD_CPU_KERNELS", kernels)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96), np.float32)
    w = rng.standard_normal((40, 96), np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    packed = layers.pack_weight(jnp.asarray(w))
    args = (jnp.asarray(x), packed, jnp.asarray(b))
    assert ("weld_packed_matmul" in _hlo(layers.linear, *args)) == (kernels == "1")
    got = np.asarray(jax.jit(lambda *a: layers.linear(*a))(*args))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64) + b, rtol=1e-5, atol=1e-4)


def test_small_row_counts_reduce_and_others_dot(monkeypatch):
    """2..64 rows of f32 take the multiply + reduction (no dot in the program); 1 and 65 rows
    and bf16 a dot (native kernels off); WELD_CPU_SMALL_MATMUL=dot puts the dot back."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "0")
    w = jnp.ones((40, 96), jnp.float32)
    kinds = {}
    for rows in (1, 2, 64, 65):
        kinds[rows] = " dot(" in _hlo(layers.linear, jnp.ones((rows, 96), jnp.float32), w)
    assert kinds == {1: True, 2: False, 64: False, 65: True}
    assert " dot(" in _hlo(layers.linear, jnp.ones((16, 96), jnp.bfloat16), w.astype(jnp.bfloat16))  # f32 only
    monkeypatch.setenv("WELD_CPU_SMALL_MATMUL", "dot")
    assert " dot(" in _hlo(layers.linear, jnp.ones((16, 96), jnp.float32), w)
    monkeypatch.setenv("WELD_CPU_SMALL_MATMUL", "fast")
    with pytest.raises(ValueError, match="WELD_CPU_SMALL_MATMUL must be 'reduce' or 'dot', got 'fast'"):
        _hlo(layers.linear, jnp.ones((16, 96), jnp.float32), w)


def test_projections_sharing_an_input_keep_their_broadcasts_fused():
    """Two projections of one normed x (gate and up): neither may materialize the [out, rows, in]
    product, which XLA does when it merges their broadcasts (~100x slower)."""
    x = jnp.ones((16, 576), jnp.float32)  # SmolLM2's MLP shapes (compiled, not run)
    gate, up, down = jnp.ones((1536, 576)), jnp.ones((1536, 576)), jnp.ones((576, 1536))

    def mlp(x, gate, up, down):
        return layers.swiglu(layers.rms_norm(x, jnp.ones(576), 1e-6), gate, up, down)

    text = _hlo(mlp, x, gate, up, down)
    materialized = [line for line in text.splitlines() if re.search(r"= f32\[1536,16,576\]\S* fusion\(", line)]
    assert not materialized


CONFIGS = {
    "llama": llama.Config(architecture="llama", vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=2,
                          num_heads=6, num_kv_heads=2, head_dim=8),
    "qwen": llama.Config(architecture="qwen3", vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=12, qkv_bias=True, qk_norm=True),
}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_projections_compute_the_same_model(name, tied):
    """Fused and packed (projections and the LM head, or the tied embedding, which then serves
    lookups from its panels) compute the hidden states and logits of the separate matrices."""
    from weld.engine.spec import features

    cfg = dataclasses.replace(CONFIGS[name], tie_word_embeddings=tied)
    weights = random_weights(llama.weight_specs(cfg), seed=3, scale=0.5)
    fused = {**weights, "layers": [dict(lw) for lw in weights["layers"]]}
    llama.fuse_projections(fused)
    assert sorted(fused["layers"][0]) == sorted(
        {"attn_norm", "mlp_norm", "wo", "w_down", "wqkv", "w_gate_up"} | ({"bqkv", "q_norm", "k_norm"} if name == "qwen" else set()))
    assert "wq" in weights["layers"][0]  # only the copied layer dicts changed
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 7)), jnp.int32)
    hidden = jax.jit(functools.partial(features.target_hidden_states, llama), static_argnums=(1, 3))
    packed = {**fused, "layers": [dict(lw) for lw in fused["layers"]]}
    llama.prepare_projections(packed, WeightTarget(pack_for_cpu_kernels=True))
    assert isinstance(packed["layers"][0]["wqkv"], layers.PackedWeight)
    assert isinstance(output_matrix(packed), layers.PackedWeight)
    assert isinstance(packed["embed"], layers.PackedWeight) == tied  # an untied embedding only serves lookups
    logits = jax.jit(lambda w, h: layers.linear(h, output_matrix(w)))
    for t in (1, 7):  # 3 rows (the reduction, or the packed kernel) and 21 rows
        ref = hidden(weights, cfg, tokens[:, :t], (0,))
        for form in (fused, packed):
            got = hidden(form, cfg, tokens[:, :t], (0,))
            for a, b in zip(ref, got):
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(logits(form, got[1])), np.asarray(logits(weights, ref[1])),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "megakernel"])
def test_engine_fuses_projections_only_on_xla(tiny_llama_dir, backend):
    """The megakernel streams the separate matrices by name, so its engine keeps them."""
    from weld.engine.llm import LLM

    llm = LLM(model=str(tiny_llama_dir[0]), backend=backend, max_model_len=64, kv_cache_memory_gb=0.01)
    keys = set(llm.model.weights["layers"][0])
    assert ({"wqkv", "w_gate_up"} <= keys) == (backend == "xla")
    packed = isinstance(llm.model.weights["layers"][0]["wo"], layers.PackedWeight)
    assert packed == (backend == "xla")  # f32 on CPU with the kernels built: panels for them
    head = llm.model.weights.get("lm_head", llm.model.weights["embed"])
    assert isinstance(head, layers.PackedWeight) == (backend == "xla")
    assert ({"wq", "wk", "wv", "w_gate", "w_up"} <= keys) == (backend == "megakernel")


# ----- int8 per output channel in XLA: what the optimized program materializes -----

def _entry_values(hlo: str, dims: tuple[int, ...]) -> list[str]:
    """The ENTRY computation's instructions that produce a float array of shape dims: the buffers
    the program materializes (what happens inside a fusion is not among them)."""
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    shape = ",".join(str(d) for d in dims)
    return [line.strip() for line in entry.splitlines()
            if re.search(rf"= (f32|bf16|f16)\[{shape}\]", line)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_int8_channel_matmul_materializes_no_float_weights(dtype):
    """The seeds' int8 weights with bf16 activations and f32 accumulation: the program takes the
    s8 codes as its parameter and applies the scales to the [m, n] output, so no scaled float
    copy of the weights exists. On GPU and TPU XLA fuses the s8 -> float convert into the matmul
    (no float [n, k] buffer at all; benchmarks/gpu_int8_check.py checks it on a device); XLA:CPU
    converts into one buffer that feeds its matmul, and that convert must be all there is."""
    n, k, m = 384, 256, 4
    w = quant.quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), "int8_channel")
    x = jnp.ones((m, k), dtype)
    hlo = jax.jit(layers.linear).lower(x, w).compile().as_text()
    params = re.findall(r"parameter\(\d+\)", hlo)
    assert re.search(rf"s8\[{n},{k}\]", hlo) and len(params) >= 3  # x, the codes, the scales
    materialized = _entry_values(hlo, (n, k))
    assert len(materialized) <= 1, materialized  # at most one buffer, made from the codes alone (not scaled)
    for line in materialized:
        operands = re.search(r"(?:fusion|convert)\(([^)]*)\)", line).group(1).split(",")
        assert len(operands) == 1, materialized
    if jax.default_backend() == "cpu":
        assert len(materialized) == 1, materialized  # XLA:CPU's matmul takes a converted copy
    elif dtype == jnp.bfloat16:
        assert not materialized, materialized  # GPU / TPU: the convert lives inside the matmul
    y = np.asarray(layers.linear(x, w), np.float32)
    np.testing.assert_allclose(y, np.asarray(x, np.float32) @ np.asarray(w.unpacked()).T, rtol=2e-2, atol=2e-2)


def test_int4_g128_rows_layout_and_values_by_hand():
    """"int4_g128_rows", the rows form of int4 with a scale and min per 128 inputs (the seeds'
    int4 experts): byte j of a row holds input j's code in its low nibble and input j + kp / 2's
    in its high one (kp: k padded to whole groups); w = d c + mn per group. Its fit is
    "int4_g128"'s, so both forms give the same matrix; k = 300 leaves a partial last group."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 300)).astype(np.float32)
    q = quant.quantize(w, "int4_g128_rows")
    assert q.rows and q.shape == (5, 300) and q.codes.shape == (5, 192) and q.scales.shape == q.mins.shape == (5, 3)
    codes = np.asarray(q.codes)
    c = np.concatenate([codes & 15, codes >> 4], axis=1).astype(np.float32)  # [5, 384]: inputs 0..383
    d, mn = np.asarray(q.scales), np.asarray(q.mins)
    by_hand = (c.reshape(5, 3, 128) * d[:, :, None] + mn[:, :, None]).reshape(5, 384)[:, :300]
    np.testing.assert_allclose(np.asarray(q.unpacked()), by_hand, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(q.unpacked()), np.asarray(quant.quantize(w, "int4_g128").unpacked()))
    assert np.abs(by_hand - w).max() < 0.6 and np.abs(by_hand - w).mean() < 0.15  # 16 levels per group
    np.testing.assert_array_equal(np.asarray(q[jnp.asarray([3, 1])]), np.asarray(q.unpacked())[[3, 1]])
    x = rng.standard_normal((2, 300)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(layers.linear(jnp.asarray(x), q)), x @ by_hand.T, rtol=1e-4, atol=1e-4)
    both = quant.concat_rows([q, quant.quantize(w[:2], "int4_g128_rows")])
    np.testing.assert_array_equal(np.asarray(both.unpacked()), np.concatenate([by_hand, by_hand[:2]]))


def test_columns_of_a_matrix_are_taken_exactly_or_refused():
    """`quant.take_columns` (tiled value heads regrouped for the tensor-parallel megakernel): an
    array's and an "int8_channel" matrix's inputs reordered exactly (its per-output scales stay);
    a format whose scales span blocks of inputs is refused."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 64)).astype(np.float32)
    index = rng.permutation(64)[:48]
    np.testing.assert_array_equal(np.asarray(quant.take_columns(jnp.asarray(w), index)), w[:, index])
    q = quant.quantize(w, "int8_channel")
    taken = quant.take_columns(q, index)
    assert taken.shape == (6, 48) and taken.fmt == "int8_channel"
    np.testing.assert_array_equal(np.asarray(taken.unpacked()), np.asarray(q.unpacked())[:, index])
    with pytest.raises(ValueError, match="inputs of a int4_g128_rows matrix cannot be reordered"):
        quant.take_columns(quant.quantize(w, "int4_g128_rows"), index)


def test_the_int4_experts_mix_picks_a_format_per_kind():
    mix = "int8_channel_int4_experts"
    assert [quant.leaf_mode(kind, mix) for kind in ("linear", "head", "expert", None)] == \
        ["int8_channel", "int8_channel", "int4_g128_rows", None]
    assert quant.leaf_mode("expert", "int4") == "int4" and quant.leaf_mode("head", "int4") == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        quant.quantize(np.ones((2, 4), np.float32), mix)  # a mix names formats, it is not one


def test_host_joins_match_jnp_on_the_host_and_inside_a_trace():
    from weld.models.common import host

    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), jnp.full((1, 3), 7.0)
    joined = host.concatenate([a, b])
    assert isinstance(joined, jax.Array) and joined.devices() == b.devices()
    # committed as jnp's result would be: a jit call's program is looked up by it
    assert joined.committed is jnp.concatenate([a, b]).committed is False
    pinned = jax.device_put(b, jax.devices()[0])
    assert host.concatenate([a, pinned]).committed and host.stack([pinned, pinned]).committed
    assert host.asarray(a).committed is jnp.asarray(a).committed
    np.testing.assert_array_equal(joined, np.concatenate([a, np.asarray(b)]))
    np.testing.assert_array_equal(host.stack([a[0], a[1]]), a)
    traced = jax.jit(lambda x, y: host.concatenate([x, y], axis=0))(a, b)  # tracers: jnp's path
    np.testing.assert_array_equal(traced, joined)
    np.testing.assert_array_equal(jax.jit(lambda x: host.stack([x, x]))(b), np.stack([b, b]))

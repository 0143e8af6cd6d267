"""Real llama.cpp-converted GGUFs of the MoE / MLA families against transformers.

The fixtures in tests/data/gguf/ were written by llama.cpp's own converter (llama-cpp-python
0.3.36's vendored convert_hf_to_gguf.py, see tests/data/make_gguf_fixtures.py) from tiny random
HF models. Each test rebuilds the same HF model (same variant, seed and overrides) so the
comparison is against transformers, not against a stored output:
- the rebuilt HF weights equal the fixture's tensors where llama.cpp keeps the layout (a change
  in seeding or in the tiny models would otherwise show up as a puzzling logits mismatch);
- the Config weld parses from the GGUF metadata equals the one it parses from config.json
  (experts, top-k, routing, MLA dims, RoPE and its scaling, softmax scale, sparse layers ...);
- weld's prefill and paged decode logits on the GGUF equal transformers' (f32, atol 1e-4), which
  checks that the key maps undo what the converter does to the tensors (Mixtral's Q/K row
  permutation, DeepSeek's kv_b split into a transposed k_b and v_b, gpt-oss's de-interleaved
  gate/up and transposed expert stacks, stacked experts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.data.make_gguf_fixtures import OUT_DIR, VARIANTS, build_hf
from weld.models.common.cache import AttentionBatch
from weld.weights import ModelSource, load_model
from weld.weights.gguf import GGUFFile

PAGE = 4


@pytest.fixture(scope="module", params=VARIANTS)
def case(request, tmp_path_factory):
    variant = request.param
    path = OUT_DIR / f"{variant}.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing; run tests/data/make_gguf_fixtures.py")
    directory = tmp_path_factory.mktemp(f"gguf-{variant}")
    hf_model = build_hf(variant, directory)
    loaded = load_model(ModelSource("gguf", path, variant), dtype="float32", quantization="none")
    return variant, directory, hf_model, loaded, GGUFFile(path)


def test_rebuilt_hf_weights_equal_the_fixture(case):
    """Tensors the converter copies as they are: if these differ, the fixture and the rebuilt
    model are not the same model (re-run make_gguf_fixtures.py after changing the tiny models)."""
    variant, _, hf_model, _, gguf_file = case
    inner = hf_model.model
    same_layout = {"token_embd.weight": hf_model.get_input_embeddings().weight}
    if not hf_model.config.tie_word_embeddings:  # a tied head has no output.weight
        same_layout["output.weight"] = hf_model.get_output_embeddings().weight
    norms = {
        "output_norm.weight": inner.norm.weight,
        "blk.0.attn_norm.weight": inner.layers[0].input_layernorm.weight,
        "blk.0.ffn_norm.weight" if variant not in ("gpt_oss", *PLUS_ONE_NORMS) else "blk.0.post_attention_norm.weight":
            inner.layers[0].post_attention_layernorm.weight,
    }
    plus_one = variant in PLUS_ONE_NORMS  # the converter stores these (1 + w) norms as 1 + w
    for name, hf in {**same_layout, **norms}.items():
        want = hf.detach().float().numpy()
        if plus_one and name in norms:  # 1 + w rounded to f32: w back within an ulp of 1
            np.testing.assert_allclose(gguf_file.dequantize(name) - 1, want, atol=2e-7, rtol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(gguf_file.dequantize(name), want, err_msg=name)


PLUS_ONE_NORMS = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}


# Fields that describe the checkpoint rather than the model: DeepSeek's multi-token-prediction
# layers, which HF configs count (transformers builds none) and llama.cpp's converter drops; the
# order Qwen3.5's value heads are stored in (llama.cpp's converter tiles them; the same model).
NOT_COMPARED = {"cfg.num_mtp_layers", "cfg.linear.tiled_v_heads"}


def _differences(a, b, where: str = "cfg") -> list[str]:
    """Differences between two configs (dataclasses compared field by field, floats to f32 precision,
    since GGUF stores them as f32)."""
    if where in NOT_COMPARED:
        return []
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        if type(a) is not type(b):
            return [f"{where}: {type(a).__name__} != {type(b).__name__}"]
        return [d for f in dataclasses.fields(a)
                for d in _differences(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")]
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool) or \
            isinstance(b, float) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return [] if math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) else [f"{where}: {a!r} != {b!r}"]
    return [] if a == b else [f"{where}: {a!r} (GGUF) != {b!r} (HF)"]


def test_gguf_config_equals_hf_config(case):
    """Every field: architecture, experts, top-k, routing, scaling, groups, shared experts, MLA
    dims and softmax scale, RoPE (theta, YaRN and its mscale, interleaving), windows, sparse layers."""
    variant, directory, _, loaded, _ = case
    from_hf = loaded.family.Config.from_hf(json.loads((directory / "config.json").read_text()))
    assert from_hf.architecture == variant.split(":")[0]
    differences = _differences(loaded.cfg, from_hf)
    assert not differences, f"{variant}: " + "; ".join(differences)
    assert loaded.cfg.sparse_layers == from_hf.sparse_layers


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@functools.cache
def jitted_forward(forward):
    return jax.jit(forward, static_argnums=(1,))


def run(loaded, cache, ids, positions, block_tables):
    logits, _, cache = jitted_forward(loaded.family.forward)(
        loaded.weights, loaded.cfg, jnp.asarray(ids, jnp.int32), jnp.asarray(positions, jnp.int32), cache,
        AttentionBatch(loaded.family.cache_spec(loaded.cfg).tables(jnp.asarray(block_tables, jnp.int32))))
    return np.asarray(logits), cache


def test_prefill_then_paged_decode_match_hf(case):
    variant, _, hf_model, loaded, _ = case
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, loaded.cfg.vocab_size, 11).tolist()
    steps = 6
    full = prompt + rng.integers(0, loaded.cfg.vocab_size, steps).tolist()
    ref = hf_logits(hf_model, full)

    cache = loaded.family.cache_spec(loaded.cfg).create(num_pages=16, page_size=PAGE, dtype=jnp.float32, num_slots=1)
    table = [[9, 3, 14, 0, 6]]  # scattered, unordered pages
    logits, cache = run(loaded, cache, [prompt], [list(range(len(prompt)))], table)
    np.testing.assert_allclose(logits[0], ref[:len(prompt)], atol=1e-4, rtol=0, err_msg=f"{variant} prefill")
    for step in range(steps):  # one token at a time, crossing page boundaries
        pos = len(prompt) + step
        logits, cache = run(loaded, cache, [[full[pos]]], [[pos]], table)
        np.testing.assert_allclose(logits[0, 0], ref[pos], atol=1e-4, rtol=0, err_msg=f"{variant} decode step {step}")


@pytest.mark.parametrize("variant,key,value,needle", [
    ("qwen3_next", "qwen3next.ssm.time_step_rank", 0, "ssm.inner_size"),
    ("qwen3_next", "qwen3next.ssm.inner_size", 47, "ssm.inner_size"),
    ("kimi_linear", "kimi-linear.kda.head_dim", 0, "kda.head_dim"),
    ("kimi_linear", "kimi-linear.kda.head_dim", 5, "kda.head_dim"),
])
def test_bad_hybrid_metadata_is_a_clear_error(variant, key, value, needle):
    """Linear-attention sizes a GGUF states that do not fit its tensors: a ValueError naming the key."""
    gguf_file = GGUFFile(OUT_DIR / f"{variant}.gguf")
    from weld.models import family_for_gguf

    metadata = {**gguf_file.metadata, key: value}
    module = family_for_gguf(metadata["general.architecture"])
    shapes = {name: tuple(int(x) for x in reversed(t.shape)) for name, t in gguf_file.tensors.items()}
    with pytest.raises(ValueError, match=needle):
        module.Config.from_gguf(metadata, shapes)

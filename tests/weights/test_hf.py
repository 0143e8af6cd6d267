"""HF safetensors loading against transformers' own `save_pretrained` output, and the key map's errors."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from weld.models.common.spec import iter_specs
from weld.utils.errors import UnsupportedModelError
from weld.weights import ModelSource, load_model
from weld.weights.tree import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

# transformers name -> weld leaf, written out here so the test does not reuse weld's key map
LAYER_KEYS = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
              "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
              "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
              "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
              "post_attention_layernorm.weight": "mlp_norm", "mlp.gate_proj.weight": "w_gate",
              "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down"}
TOP_KEYS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}


def weld_leaf(weights: dict, hf_name: str):
    if hf_name in TOP_KEYS:
        return weights[TOP_KEYS[hf_name]]
    _, _, i, rest = hf_name.split(".", 3)
    return weights["layers"][int(i)][LAYER_KEYS[rest]]


def save_tiny(directory, arch: str, tied: bool = False, dtype=torch.float32, shard: str | None = None) -> dict:
    """A tiny random model saved by transformers; returns its state dict as numpy."""
    cfg = transformers.AutoConfig.for_model(
        arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb everything so nothing hides
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def load(directory, **kw):
    return load_model(ModelSource("hf", directory, directory.name), **kw)


def assert_same(m, state: dict, dtype=np.float32):
    names = [n for n in state if not (m.cfg.tie_word_embeddings and n == "lm_head.weight")]
    leaves = list(iter_specs(m.family.weight_specs(m.cfg)))
    assert len(leaves) == len(names)  # every leaf is filled, and from a distinct tensor
    for name in names:
        got = weld_leaf(m.weights, name)
        assert got.dtype == dtype, name
        np.testing.assert_array_equal(np.asarray(got, np.float32), state[name].astype(dtype).astype(np.float32),
                                      err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_single_file(tmp_path, arch):
    state = save_tiny(tmp_path, arch)
    assert (tmp_path / "model.safetensors").is_file()
    m = load(tmp_path)
    assert m.cfg.architecture == arch and m.gguf_metadata is None
    assert_same(m, state)


def test_sharded_and_tied(tmp_path):
    state = save_tiny(tmp_path, "llama", tied=True, shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    m = load(tmp_path)
    assert m.cfg.tie_word_embeddings and "lm_head" not in m.weights
    assert_same(m, state)


def test_bfloat16_checkpoint(tmp_path):
    state = save_tiny(tmp_path, "llama", dtype=torch.bfloat16)
    m = load(tmp_path, dtype="bfloat16")
    assert_same(m, state, dtype=jnp.bfloat16)
    m32 = load(tmp_path)  # and widened to float32 exactly
    assert_same(m32, state)


def test_ignores_rotary_buffers(tmp_path):
    state = save_tiny(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    assert_same(load(tmp_path), state)


# ----- errors: each a one-line CheckpointError naming the tensor -----

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    save_tiny(single, "llama")
    save_tiny(sharded, "llama", shard="20KB")
    return single, sharded


def edited(saved_dir, tmp_path, edit) -> object:
    """A copy of a saved model whose model.safetensors tensors `edit` changed in place."""
    directory = tmp_path / "model"
    shutil.copytree(saved_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")
    return directory


def load_error(directory) -> str:
    with pytest.raises(CheckpointError) as e:
        load(directory)
    message = str(e.value)
    assert "\n" not in message and str(directory) in message
    return message


def test_unmapped_tensor(saved, tmp_path):
    def add(t):
        t["model.layers.1.mlp.extra_proj.weight"] = np.zeros((4, 4), np.float32)

    message = load_error(edited(saved[0], tmp_path, add))
    assert "1 unmapped tensors: model.layers.1.mlp.extra_proj.weight" in message


def test_missing_tensor(saved, tmp_path):
    message = load_error(edited(saved[0], tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")))
    assert "missing tensors: model.layers.1.self_attn.k_proj.weight (-> layers.1.wk)" in message


def test_unexpected_tensor(saved, tmp_path):
    # a bias the config (attention_bias=false) does not declare
    def add(t):
        t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)

    message = load_error(edited(saved[0], tmp_path, add))
    assert "model.layers.0.self_attn.o_proj.bias (-> layers.0.bo, which this config does not declare)" in message


def test_wrong_shape(saved, tmp_path):
    def transpose(t):
        t["model.layers.0.mlp.up_proj.weight"] = np.ascontiguousarray(t["model.layers.0.mlp.up_proj.weight"].T)

    message = load_error(edited(saved[0], tmp_path, transpose))
    assert "model.layers.0.mlp.up_proj.weight has shape (64, 128), expected (128, 64)" in message


def test_duplicate_across_shards(saved, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(saved[1], directory)
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.q_proj.weight"
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
    tensors = load_file(directory / other)
    tensors[name] = load_file(directory / weight_map[name])[name]
    save_file(tensors, directory / other)
    message = load_error(directory)
    assert f"{name} (in " in message and other in message and weight_map[name] in message


def test_missing_shard(saved, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(saved[1], directory)
    victim = sorted(directory.glob("*.safetensors"))[2]
    victim.unlink()
    assert victim.name in load_error(directory)


def test_truncated_safetensors(saved, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(saved[0], directory)
    with open(directory / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    assert "truncated" in load_error(directory)


def test_unsupported_architecture(saved, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(saved[0], directory)
    config = json.loads((directory / "config.json").read_text())
    config |= {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load(directory)

"""`weld convert` and weld checkpoints: what a conversion writes loads back as exactly the tree the
source loads as (kept GGUF blocks, int8 / int4 quantization, every family), serves the same text,
resumes after an interruption, and refuses bad directories and damaged files with one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.conftest import ENGINE_VARIANTS, FAMILY_VARIANTS
from tests.weights.test_gguf import check_error as one_line
from weld import LLM, SamplingParams
from weld.models.common import quant
from weld.models.common.spec import iter_specs, path_str
from weld.utils import records
from weld.utils.errors import InvalidInputError, UnsupportedModelError, WeldError
from weld.weights import CheckpointError, ModelSource, load_model, native, resolve_model
from weld.weights.safetensors_file import SafetensorsFile, ShardWriter, sha256_of


def leaves(weights) -> list:
    return jax.tree_util.tree_leaves(weights, is_leaf=quant.is_quantized)


def assert_same_tree(a, b):
    """Leaf for leaf: the same kind (array or QuantWeight of one format) and the same bits."""
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert type(x) is type(y)
        if quant.is_quantized(x):
            assert (x.fmt, x.n, x.k) == (y.fmt, y.n, y.k)
            for p, q in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y), strict=True):
                np.testing.assert_array_equal(np.asarray(p), np.asarray(q))
        else:
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """The bundled Q4_1 GGUF converted with its blocks kept, in shards of ~20 MB."""
    out = tmp_path_factory.mktemp("smollm2-weld")
    return native.convert(None, out, max_shard_bytes=20 * 10**6, progress=False)


def test_kept_gguf_loads_back_bit_for_bit(kept):
    source = resolve_model(kept.directory)
    assert source.kind == "weld"
    assert_same_tree(load_model(source).weights, load_model(None).weights)
    m = kept.manifest
    assert m["family"] == "llama" and m["quantization"] is None and m["formats"] == ["q4_1", "q8_0"]
    assert len(m["shards"]) >= 4  # ~97 MB in 20 MB shards
    cfg = records.from_json(load_model(None).cfg.__class__, m["config"])
    assert cfg == load_model(source).cfg
    declared = dict(iter_specs(source_family_specs(cfg)))
    assert set(m["tensors"]) == {path_str(p) for p in declared}
    for path, spec in declared.items():  # the logical axes travel, for sharding
        assert m["tensors"][path_str(path)]["axes"] == list(spec.axes)
    for name, shard in m["shards"].items():
        assert sha256_of(kept.directory / name) == shard["sha256"]
        assert (kept.directory / name).stat().st_size == shard["bytes"]
    assert not list(kept.directory.glob("*.partial")) and not (kept.directory / native.PROGRESS).exists()


def source_family_specs(cfg):
    from weld.models import llama

    return llama.weight_specs(cfg)


def test_converted_model_serves_the_same_text(kept):
    """The tokenizer and chat template come along (the GGUF's key/values): same greedy text."""
    settings = dict(max_model_len=128, kv_cache_memory_gb=0.02, max_num_seqs=1)
    params = SamplingParams(max_tokens=12, temperature=0)
    prompt = [{"role": "user", "content": "Name three colours."}]
    ours = LLM(str(kept.directory), **settings).chat(prompt, params, use_tqdm=False)[0].outputs[0]
    ref = LLM(**settings).chat(prompt, params, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == ref.token_ids and ours.text == ref.text


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_every_family_converts_quantized(variant, tiny_family_dir, tmp_path):
    """A HF checkpoint of every family (experts stored one per tensor, fused, split) converted with
    int4: the converted tree is the one a quantizing load gives, quantized exactly where the
    declaration says (the head at 8 bits); the tokenizer files come along."""
    directory, _ = tiny_family_dir(variant)
    result = native.convert(ModelSource("hf", directory, variant), tmp_path / "out", quantization="int4",
                            max_shard_bytes=1 << 20, progress=False)
    direct = load_model(ModelSource("hf", directory, variant), quantization="int4")
    converted = load_model(tmp_path / "out")
    assert_same_tree(converted.weights, direct.weights)
    assert converted.cfg == direct.cfg
    for path, spec in iter_specs(converted.family.weight_specs(converted.cfg)):
        entry = result.manifest["tensors"][path_str(path)]
        assert entry.get("format") == {"linear": "int4", "expert": "int4", "head": "int8", None: None}[spec.quantize], path
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    # and loading it unquantized gives the dequantized blocks
    plain = load_model(tmp_path / "out", quantization="none")
    assert not any(quant.is_quantized(x) for x in leaves(plain.weights))


def test_bfloat16_dtype_and_requested_forms(tiny_family_dir, tmp_path):
    directory, _ = tiny_family_dir("qwen3")
    native.convert(ModelSource("hf", directory, "q"), tmp_path / "bf", dtype="bfloat16", progress=False)
    loaded = load_model(tmp_path / "bf", dtype="float32")
    direct = load_model(ModelSource("hf", directory, "q"), dtype="bfloat16")
    for x, y in zip(leaves(loaded.weights), leaves(direct.weights)):  # stored bf16, cast up at load
        assert x.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y).astype(np.float32))
    shard = SafetensorsFile(next((tmp_path / "bf").glob("model-*.safetensors")))
    assert {kind for kind, _, _ in shard.entries.values()} == {"BF16"}
    # an int8 load of an int4 checkpoint quantizes the dequantized blocks again
    native.convert(ModelSource("hf", directory, "q"), tmp_path / "i4", quantization="int4", progress=False)
    again = load_model(tmp_path / "i4", quantization="int8")
    assert {x.fmt for x in leaves(again.weights) if quant.is_quantized(x)} == {"int8"}
    # int4 with a scale and min per 128 inputs round-trips as its [P, ng, 16] scales
    native.convert(ModelSource("hf", directory, "q"), tmp_path / "g128", quantization="int4_g128", progress=False)
    assert_same_tree(load_model(tmp_path / "g128").weights,
                     load_model(ModelSource("hf", directory, "q"), quantization="int4_g128").weights)
    # int8 per channel (rows of int8 codes, f32 scales) round-trips too
    native.convert(ModelSource("hf", directory, "q"), tmp_path / "ch", quantization="int8_channel", progress=False)
    assert_same_tree(load_model(tmp_path / "ch").weights,
                     load_model(ModelSource("hf", directory, "q"), quantization="int8_channel").weights)


def test_the_int4_experts_mix_round_trips(tiny_family_dir, tmp_path):
    """The seeds' MoE mix: expert stacks as int4 g128 rows (packed codes, f32 scales and mins per
    group), every other matrix as int8 rows; a converted checkpoint loads as the quantizing load."""
    directory, _ = tiny_family_dir("qwen3_moe")
    mix = "int8_channel_int4_experts"
    result = native.convert(ModelSource("hf", directory, "moe"), tmp_path / "mix", quantization=mix, progress=False)
    formats = {entry.get("format") for entry in result.manifest["tensors"].values()}
    assert formats == {"int4_g128_rows", "int8_channel", None}
    assert_same_tree(load_model(tmp_path / "mix").weights,
                     load_model(ModelSource("hf", directory, "moe"), quantization=mix).weights)


def test_interrupted_conversion_resumes(tiny_family_dir, tmp_path, monkeypatch):
    """A conversion stopped after some shards resumes: the finished shards are verified and kept
    (not rewritten), a damaged one is redone, and the result loads as an uninterrupted one's."""
    directory, _ = tiny_family_dir("qwen3_moe")
    src = ModelSource("hf", directory, "moe")
    whole = native.convert(src, tmp_path / "whole", quantization="int8", max_shard_bytes=70_000, progress=False)
    assert len(whole.manifest["shards"]) >= 3

    real_close, closed = ShardWriter.close, []

    def failing_close(self):
        if len(closed) == 2:
            raise KeyboardInterrupt  # the user's Ctrl-C in the third shard
        closed.append(self.path.name)
        return real_close(self)

    out = tmp_path / "out"
    monkeypatch.setattr(ShardWriter, "close", failing_close)
    with pytest.raises(KeyboardInterrupt):
        native.convert(src, out, quantization="int8", max_shard_bytes=70_000, progress=False)
    monkeypatch.setattr(ShardWriter, "close", real_close)
    assert (out / native.PROGRESS).is_file() and not (out / native.MANIFEST).exists()
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == closed
    stamps = {name: (out / name).stat().st_mtime_ns for name in closed}
    with open(out / closed[1], "r+b") as f:  # damage the second finished shard
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")

    resumed = native.convert(src, out, quantization="int8", max_shard_bytes=70_000, progress=False)
    assert resumed.shards_reused == 1
    assert (out / closed[0]).stat().st_mtime_ns == stamps[closed[0]]  # verified, not rewritten
    assert_same_tree(load_model(out).weights, load_model(tmp_path / "whole").weights)
    assert not (out / native.PROGRESS).exists()
    again = native.convert(src, out, quantization="int8", max_shard_bytes=70_000, progress=False)
    assert again.shards_reused == len(again.manifest["shards"])  # a finished conversion: nothing redone


def test_bad_output_directories(tiny_family_dir, tmp_path):
    directory, _ = tiny_family_dir("llama")
    src = ModelSource("hf", directory, "llama")
    native.convert(src, tmp_path / "a", quantization="int8", progress=False)
    with pytest.raises(InvalidInputError, match="another quantization"):
        native.convert(src, tmp_path / "a", quantization="int4", progress=False)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="not empty and holds no weld conversion"):
        native.convert(src, tmp_path / "b", progress=False)
    (tmp_path / "c").write_text("a file")
    with pytest.raises(InvalidInputError, match="not a directory"):
        native.convert(src, tmp_path / "c", progress=False)
    with pytest.raises(InvalidInputError, match="quantization must be one of"):
        native.convert(src, tmp_path / "d", quantization="fp8", progress=False)
    # a source that does not open leaves no output directory behind
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    (broken / "config.json").write_text('{"model_type": "no_such_family"}')
    with pytest.raises(WeldError):
        native.convert(ModelSource("hf", broken, "llama"), tmp_path / "e", progress=False)
    assert not (tmp_path / "e").exists()


@pytest.fixture()
def small_checkpoint(tiny_family_dir, tmp_path):
    directory, _ = tiny_family_dir("llama")
    native.convert(ModelSource("hf", directory, "llama"), tmp_path / "w", quantization="int4", progress=False)
    return tmp_path / "w"


def edit_manifest(directory, edit):
    path = directory / native.MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def test_truncated_shard_is_named(small_checkpoint):
    shard = next(small_checkpoint.glob("model-*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError) as e:
        load_model(small_checkpoint)
    one_line(e, shard.name, "truncated")


def test_manifest_damage_is_named(small_checkpoint):
    edit_manifest(small_checkpoint, lambda m: m["tensors"].pop("layers.1.wo"))
    with pytest.raises(CheckpointError) as e:
        load_model(small_checkpoint)
    one_line(e, "missing layers.1.wo")


def test_unknown_format_and_version(small_checkpoint):
    edit_manifest(small_checkpoint, lambda m: m["tensors"]["layers.0.wq"].update(format="q9_9"))
    with pytest.raises(UnsupportedModelError) as e:
        load_model(small_checkpoint)
    one_line(e, "layers.0.wq", "q9_9")
    edit_manifest(small_checkpoint, lambda m: m.update(version=99))
    with pytest.raises(UnsupportedModelError) as e:
        load_model(small_checkpoint)
    one_line(e, "version 99")


def test_quantized_layout_mismatch_is_named(small_checkpoint):
    """A manifest whose format does not match the stored codes (int8's 512 bytes per block
    against int4's 256) is refused before any tensor is read."""
    edit_manifest(small_checkpoint, lambda m: m["tensors"]["layers.0.wq"].update(format="int8"))
    with pytest.raises(CheckpointError) as e:
        load_model(small_checkpoint)
    one_line(e, "layers.0.wq", "int8")


def test_bad_config_is_named(small_checkpoint):
    edit_manifest(small_checkpoint, lambda m: m["config"].update(hidden_size="wide"))
    with pytest.raises(CheckpointError) as e:
        load_model(small_checkpoint)
    one_line(e, "bad config", "hidden_size")


def test_config_records_round_trip(tiny_family_dir):
    for variant in FAMILY_VARIANTS:
        cfg = load_model(ModelSource("hf", tiny_family_dir(variant)[0], variant)).cfg
        document = json.loads(json.dumps(records.to_json(cfg)))
        assert records.from_json(type(cfg), document) == cfg, variant
    with pytest.raises(ValueError, match="unknown fields"):
        records.from_json(type(cfg), {**records.to_json(cfg), "wings": 2})


def test_cli_convert_and_generate(tmp_path):
    env = {**os.environ, "WELD_PROGRESS": "0", "JAX_PLATFORMS": "cpu"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "weld.cli", *a], capture_output=True, text=True,  # noqa: E731
                                    env=env, timeout=600)
    out = tmp_path / "smol-int8"
    proc = run("convert", "--out", str(out), "-q", "int8", "--max-shard-size", "50MB")
    assert proc.returncode == 0, proc.stderr
    shards = len(list(out.glob("model-*.safetensors")))  # ~144 MB of int8 blocks in 50 MB shards
    assert shards == 3 and "wrote" in proc.stderr and "int8 blocks" in proc.stderr and "3 shards" in proc.stderr
    gen = run("generate", "The capital of France is", "--model", str(out), "--max-tokens", "6", "--temperature", "0")
    assert gen.returncode == 0 and "Paris" in gen.stdout, gen.stderr
    bad = run("convert", "--out", str(tmp_path / "x"), "--max-shard-size", "huge")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "weld: error: --max-shard-size takes a size like 500MB, 2GB or 1GiB, got 'huge'"]

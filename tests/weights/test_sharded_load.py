"""Sharded loading: every process reads only the tensor slices its devices hold
(`TensorSource.load(shardings=...)`, `load_model(mesh_for=...)`; docs/sharded-loading.md).

- in this process (one device): a GGUF block read (`GGUFFile.read`) is exactly the dequantized
  tensor's block, for every supported type, and reads only the bytes of its rows' blocks;
- in a process with 8 virtual CPU devices: HF safetensors, GGUF (float and quantized, Q/K rows
  unpermuted, expert stacks) and `weld convert` checkpoints loaded over tp 2 / 4 (and experts over
  ep) equal the one-device load leaf for leaf, laid out as `sharding.weight_shardings` says, and
  the engine's later `sharding.place` keeps them as they are;
- two processes joined by `jax.distributed`, one CPU device each, tp 2: each reads about half of
  the checkpoint (measured 0.50 for all three formats), and their blocks are the one-process load's.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest

from tests.conftest import make_tiny_hf_model
from tests.weights import ggml_reference
from tests.weights.tiny_gguf import llama_kv, write_gguf
from weld.models.common.spec import iter_specs, path_str
from weld.weights.gguf import GGUFFile

REPO = pathlib.Path(__file__).resolve().parents[2]
GGUF_DATA = REPO / "tests" / "data" / "gguf"
Q = gguf.GGMLQuantizationType


def child_env(**extra: str) -> dict:
    """A subprocess's environment, set explicitly: CPU only, no bars, no inherited XLA_FLAGS."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "WELD_PROGRESS")}
    return {**env, "JAX_PLATFORMS": "cpu", "WELD_PROGRESS": "0", "PYTHONPATH": str(REPO), **extra}


def run_children(commands: list[list[str]], env: dict, timeout: float = 240) -> list[str]:
    """Runs the commands side by side; their stdouts. Every child is killed if one fails or hangs."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for c in commands]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"child failed ({p.returncode}):\n{err[-4000:]}"
    return [out for out, _ in outs]


# ----- one process, one device: GGUF blocks -----

GGUF_TYPES = [Q.F32, Q.F16, Q.BF16] + [Q[k] for k in ggml_reference.BLOCKS]


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda q: q.name)
def test_gguf_block_is_the_dequantized_block_and_reads_only_its_blocks(tmp_path, qtype):
    rng = np.random.default_rng(0)
    rows, cols = 6, 512
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16):
        x = rng.standard_normal((2, rows // 2, cols)).astype(np.float32)
        value = x.astype(np.float16) if qtype == Q.F16 else x
    elif qtype == Q.BF16:
        value = gguf.quants.quantize(rng.standard_normal((2, rows // 2, cols)).astype(np.float32), qtype), qtype
    else:
        raw = ggml_reference.random_blocks(qtype.name, rows * cols // per_block, rng)
        value = (raw.reshape(2, rows // 2, -1), qtype)
    f = GGUFFile(write_gguf(tmp_path / "t.gguf", "llama", {}, {"t": value}))
    whole = f.dequantize("t")
    assert whole.shape == (2, rows // 2, cols)
    for index in [(slice(None), slice(1, 3), slice(None)),     # rows
                  (slice(1, 2), slice(None), slice(256, 512)),  # an expert, block-aligned columns
                  (slice(None), slice(None), slice(100, 300)),  # columns inside blocks: trimmed
                  (np.array([1, 0]), slice(None), slice(32, 64))]:  # rows picked (a rows-only conversion)
        block, nbytes = f.read("t", index)
        np.testing.assert_array_equal(block, whole[index], err_msg=str(index))
        first, stop, _ = index[-1].indices(cols)
        n_rows = int(np.prod(block.shape[:-1]))
        assert nbytes == n_rows * (-(-stop // per_block) - first // per_block) * block_bytes, index


# ----- one process, 8 virtual devices: every format, every leaf -----

EQUAL_SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from weld.models.common import sharding
from weld.models.common.spec import iter_specs, path_str
from weld.weights import load_model, resolve_model

def at(tree, path):
    for key in path:
        tree = tree[key]
    return tree

for case in json.loads(sys.argv[1]):
    source = resolve_model(case["path"])
    ref = load_model(source, quantization="none")
    layout = case["layout"]
    mesh = sharding.make_mesh(layout["tp"], enable_expert_parallel=layout.get("ep", False))
    got = load_model(source, quantization="none", mesh_for=lambda family, cfg: mesh)
    specs = got.family.weight_specs(got.cfg)
    want = sharding.weight_shardings(got.weights, specs, mesh)
    bad, split = [], 0
    for path, spec in iter_specs(specs):
        a, b, s = at(ref.weights, path), at(got.weights, path), at(want, path)
        if not b.sharding.is_equivalent_to(s, b.ndim) or not np.array_equal(np.asarray(a), np.asarray(b)):
            bad.append(path_str(path))
        split += any(axis is not None for axis in s.spec)
    placed = sharding.place(got.weights, want)
    kept = all(x is y for x, y in zip(jax.tree.leaves(got.weights), jax.tree.leaves(placed)))
    print(json.dumps({**case, "bad": bad, "split": split, "kept": kept, "bytes_read": got.bytes_read,
                      "ref_bytes_read": ref.bytes_read}), flush=True)
"""


def quantized_llama_gguf(path: pathlib.Path) -> pathlib.Path:
    """A one-layer llama GGUF whose matrices are of many block types (K-quants among them, as random
    valid blocks), wide enough (256) for 256-wide blocks: row and column splits, aligned and not."""
    rng = np.random.default_rng(3)
    hidden, ffn, vocab, heads, kv_heads = 256, 512, 64, 4, 2

    def floats(*shape, qtype=Q.F32):
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype in (Q.F32, Q.F16):
            return x.astype(np.float16) if qtype == Q.F16 else x
        return gguf.quants.quantize(x, qtype), qtype

    def blocks(rows, cols, qtype):
        per_block = gguf.GGML_QUANT_SIZES[qtype][0]
        return ggml_reference.random_blocks(qtype.name, rows * cols // per_block, rng).reshape(rows, -1), qtype

    tensors = {"token_embd.weight": blocks(vocab, hidden, Q.Q6_K), "output.weight": floats(vocab, hidden, qtype=Q.F16),
               "output_norm.weight": floats(hidden), "blk.0.attn_norm.weight": floats(hidden),
               "blk.0.ffn_norm.weight": floats(hidden),
               "blk.0.attn_q.weight": blocks(hidden, hidden, Q.Q4_K),
               "blk.0.attn_k.weight": floats(kv_heads * 64, hidden, qtype=Q.Q4_0),
               "blk.0.attn_v.weight": floats(kv_heads * 64, hidden, qtype=Q.BF16),
               "blk.0.attn_output.weight": blocks(hidden, hidden, Q.Q5_K),
               "blk.0.ffn_gate.weight": floats(ffn, hidden, qtype=Q.Q8_0),
               "blk.0.ffn_up.weight": floats(ffn, hidden, qtype=Q.Q5_1),
               "blk.0.ffn_down.weight": blocks(hidden, ffn, Q.Q4_K)}
    return write_gguf(path, "llama", llama_kv(1, hidden, ffn, heads, kv_heads, vocab), tensors)


def test_every_format_loads_sharded_as_on_one_device(tmp_path, tiny_model_dir):
    from weld.weights import native

    llama, _ = tiny_model_dir("llama")
    moe, _ = tiny_model_dir("qwen3_moe")  # experts stored one by one: read into their stacks' blocks
    oss, _ = tiny_model_dir("gpt_oss")  # x-major fused gate/up, transposed down: read whole, then sliced
    nxt, _ = tiny_model_dir("qwen3_next")  # grouped in_proj_qkvz: a rows-only split, rows picked out of order
    quantized = quantized_llama_gguf(tmp_path / "quantized.gguf")
    native.convert(llama, tmp_path / "weld-float", progress=False)
    native.convert(quantized, tmp_path / "weld-blocks", progress=False)  # Q4_K etc. panels: dequantized whole
    tp2, tp4, ep4 = {"tp": 2}, {"tp": 4}, {"tp": 4, "ep": True}
    cases = [(llama, tp2), (llama, tp4), (moe, tp2), (moe, ep4), (oss, tp2), (nxt, tp2),
             (GGUF_DATA / "mixtral.gguf", tp2), (GGUF_DATA / "mixtral.gguf", ep4),
             (GGUF_DATA / "deepseek_v2.gguf", tp2),  # MLA: attn_k_b transposed, read whole
             (quantized, tp2), (quantized, tp4),
             (tmp_path / "weld-float", tp2), (tmp_path / "weld-blocks", tp2), (tmp_path / "weld-blocks", tp4)]
    cases = [{"path": str(p), "layout": layout} for p, layout in cases]
    out, = run_children([[sys.executable, "-c", EQUAL_SCRIPT, json.dumps(cases)]], child_env())
    results = [json.loads(line) for line in out.strip().splitlines()]
    assert len(results) == len(cases)
    for r in results:
        name = f"{pathlib.Path(r['path']).name} {r['layout']}"
        assert not r["bad"], f"{name}: leaves differ from the one-device load or are laid out otherwise: {r['bad']}"
        assert r["split"] > 0, name  # the test can fail: some leaves really are split
        assert r["kept"], f"{name}: sharding.place moved leaves the load had laid out already"
        # one process holds every block: it reads each once (GGUF blocks cut mid-block are read
        # by both neighbours, and the weld panels are read whole once per tensor)
        assert r["bytes_read"] <= 1.5 * r["ref_bytes_read"], name
        if not r["path"].endswith(".gguf"):
            assert r["bytes_read"] == r["ref_bytes_read"], name


# ----- two processes, one device each: each reads its half -----

PROCESS_SCRIPT = r"""
import json, sys
port, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import jax
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=rank)
assert len(jax.devices()) == 2 and len(jax.local_devices()) == 1, jax.devices()
import numpy as np
from weld.models.common import sharding
from weld.models.common.spec import iter_specs, path_str
from weld.weights import load_model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

report = {}
for model in sys.argv[4:]:
    jax.block_until_ready(jax.device_put(np.ones(8, np.float32)) * 2)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM: the peak of this load alone
    before = status("VmRSS:")
    m = load_model(model, dtype="float32", quantization="none", mesh_for=lambda family, cfg: sharding.make_mesh(2))
    jax.block_until_ready(m.weights)
    extra = status("VmHWM:") - before
    blocks = {}
    for path, spec in iter_specs(m.family.weight_specs(m.cfg)):
        x = m.weights
        for key in path:
            x = x[key]
        for shard in x.addressable_shards:
            blocks[path_str(path) + "|" + json.dumps([[i.start, i.stop] for i in shard.index])] = np.asarray(shard.data)
    name = model.rsplit("/", 1)[-1]
    np.savez(f"{out}-{name}.npz", **blocks)
    report[name] = {"bytes_read": m.bytes_read, "extra_rss": extra,
                    "held": sum(b.nbytes for b in blocks.values())}
    del m, blocks
print(json.dumps(report))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def llama_gguf_of(hf_dir: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    """The HF llama as llama.cpp's converter writes it (Q/K rows permuted), matrices in Q8_0."""
    from weld.weights.safetensors_file import SafetensorsFile

    cfg = json.loads((hf_dir / "config.json").read_text())
    f = SafetensorsFile(hf_dir / "model.safetensors")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {}
    for name in f.entries:
        w = np.array(f.array(name), np.float32)
        if name.startswith("model.layers."):
            _, _, i, *part, _ = name.split(".")
            gguf_name = f"blk.{i}.{parts['.'.join(part)]}.weight"
        else:
            gguf_name = names[name]
        kind = gguf_name.split(".")[-2]
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(kind)
        if heads:  # llama.cpp's permutation, which the loader undoes row by row
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        tensors[gguf_name] = (gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0) if w.ndim == 2 else w
    kv = llama_kv(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                  cfg["num_key_value_heads"], cfg["vocab_size"])
    return write_gguf(path, "llama", kv, tensors)


def test_two_processes_each_read_their_half(tmp_path):
    """Matrices dominate (hidden 256, intermediate 1024, vocabulary 4096, untied head), so a
    process that reads only its tp=2 slices reads about half of the checkpoint; each process's
    blocks are the one-process load's, and together they cover every leaf."""
    from weld.weights import load_model, native, open_checkpoint, resolve_model

    hf = tmp_path / "hf"
    make_tiny_hf_model("llama", hf, seed=7, hidden_size=256, intermediate_size=1024, vocab_size=4096,
                       num_attention_heads=4, num_key_value_heads=2)
    native.convert(hf, tmp_path / "weld", progress=False)
    gguf_path = llama_gguf_of(hf, tmp_path / "q8.gguf")
    models = [hf, tmp_path / "weld", gguf_path]
    port, out = free_port(), tmp_path / "blocks"
    outs = run_children([[sys.executable, "-c", PROCESS_SCRIPT, str(port), str(rank), f"{out}{rank}", *map(str, models)]
                         for rank in range(2)], child_env())
    reports = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    for model in models:
        src = open_checkpoint(resolve_model(model), "none")
        total = sum(src.nbytes(p.name) for p in src.plan)
        ref = load_model(model, dtype="float32", quantization="none")
        f32 = sum(4 * x.size for x in jax.tree.leaves(ref.weights))
        covered: dict[str, int] = {}
        for rank, report in enumerate(reports):
            r = report[model.name]
            share = r["bytes_read"] / total
            print(f"\n{model.name} rank {rank}: read {r['bytes_read']} of {total} bytes ({share:.3f}); "
                  f"peak RSS grew {r['extra_rss'] / 2**20:.1f} MiB for {r['held'] / 2**20:.1f} MiB held "
                  f"of {f32 / 2**20:.1f} MiB f32 weights")
            assert 0.4 < share < 0.6, f"{model.name} rank {rank} read {share:.2f} of the checkpoint"
            assert r["held"] < 0.6 * f32
            with np.load(f"{out}{rank}-{model.name}.npz") as blocks:
                for key in blocks.files:
                    name, index = key.split("|")
                    leaf = ref.weights
                    for part in name.split("."):
                        leaf = leaf[int(part)] if part.isdigit() else leaf[part]
                    index = tuple(slice(a, b) for a, b in json.loads(index))
                    np.testing.assert_array_equal(blocks[key], np.asarray(leaf)[index], err_msg=f"{model.name} {key}")
                    covered[name] = covered.get(name, 0) + blocks[key].size
        for path, spec in iter_specs(ref.family.weight_specs(ref.cfg)):  # the two processes hold every leaf
            assert covered.get(path_str(path), 0) >= int(np.prod(spec.shape)), (model.name, path_str(path))

"""Builds tests/data/gguf/<variant>.gguf: tiny random HF models converted by llama.cpp's own converter.

A tool, not a test. The fixtures it writes are checked in (about 0.9 MB each, f32, 4.6 MB in
all; byte-for-byte reproducible); tests/weights/test_gguf_families.py rebuilds the same HF models
(same variant, seed and overrides, from `build_hf`) and checks that weld, loading the GGUF,
computes what transformers computes on the HF weights. Where llama.cpp cannot represent a switch
of a tiny variant, the fixture overrides it (`VARIANT_OVERRIDES`, which says why).

Converter: llama.cpp as vendored by llama-cpp-python 0.3.36 (vendor/llama.cpp, its
convert_hf_to_gguf.py + conversion/ + gguf-py/), run in a subprocess with its own gguf-py first
on sys.path, `--outtype f32`. The only patch: the tiny byte-level BPE tokenizer's pre-tokenizer
hash is unknown to llama.cpp, so `TextModel.get_vocab_base_pre` is replaced by one returning
"gpt-2" (the tokenizer is not what the fixtures test).

Run from the repository root (needs torch, transformers and the converter's deps in the venv):

    .venv/bin/python tests/data/make_gguf_fixtures.py --llama-cpp /path/to/llama_cpp_python-0.3.36/vendor/llama.cpp
    .venv/bin/python tests/data/make_gguf_fixtures.py --llama-cpp ... qwen3_moe mixtral   # only some

(`--llama-cpp` defaults to $LLAMA_CPP_DIR, else /tmp/llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp.)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

LLAMA_CPP_VERSION = "llama-cpp-python 0.3.36 (vendored llama.cpp)"
DEFAULT_LLAMA_CPP = "/tmp/llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp"
VARIANTS = ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2", "gpt_oss", "qwen3_next", "qwen3_5_text",
            "qwen3_5_moe_text", "kimi_linear")
SEED = 20
OUT_DIR = pathlib.Path(__file__).resolve().parent / "gguf"

# Run inside the converter's process: its gguf-py and conversion package first, the
# pre-tokenizer check patched out, then its main() with our argv.
_CONVERT = """
import sys
llama_cpp = sys.argv[1]
sys.path[:0] = [llama_cpp + "/gguf-py", llama_cpp]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


# Per-variant overrides where llama.cpp cannot represent a switch of the tiny variant. Its
# qwen3moe architecture has no dense layers (no ffn_gate/up/down in its tensor list, so the
# converter refuses `mlp_only_layers` / `decoder_sparse_step` > 1) and always renormalises the
# top-k weights (src/models/qwen3moe.cpp passes norm_w = true; the converter writes no
# norm_topk_prob), so the Qwen3-MoE fixture is all-sparse with norm_topk_prob=True.
# DeepSeek: the hub configs carry `scoring_func` ("sigmoid" for V3, "softmax" for V2), from which
# the converter writes expert_gating_func; transformers' tiny configs do not (its models hard-code
# the scoring), and without the key llama.cpp falls back to softmax, so the fixtures set it as
# the real config.json files do (transformers ignores it).
# Kimi Linear: llama.cpp's converter reads the layer kinds and KDA sizes from the checkpoint's
# `linear_attn_config` (1-indexed layer lists; transformers' tiny configs spell them as
# layer_types / linear_* fields instead), and maps no dense MLP under `block_sparse_moe.` (where
# transformers saves a dense layer's), so the fixture is all-sparse; its kimi-linear metadata has
# no expert group count (the model has one group), so the fixture routes over one group.
# gpt-oss: YaRN betas off their defaults (32, 1), far enough to move the tiny model's ramp, so a
# loader ignoring the converter's rope.scaling.yarn_beta_fast / _slow fails the config check and
# the logits.
VARIANT_OVERRIDES = {
    "qwen3_moe": {"mlp_only_layers": [], "norm_topk_prob": True},
    "deepseek_v3": {"scoring_func": "sigmoid"},
    "deepseek_v2": {"scoring_func": "softmax"},
    "kimi_linear": {"first_k_dense_replace": 0, "mlp_layer_types": ["sparse"] * 4, "n_group": 1,
                    "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 8,
                                           "num_heads": 4, "short_conv_kernel_size": 4}},
    "gpt_oss": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 32.0,
                                    "original_max_position_embeddings": 16, "beta_fast": 2.0, "beta_slow": 0.25,
                                    "truncate": False}},
}


# Converter flags per variant: the Qwen3-Next / Qwen3.5 converters expect multi-token-prediction
# layers (which tiny models have none of) unless told there are none.
CONVERTER_FLAGS = {"qwen3_next": ["--no-mtp"], "qwen3_5_text": ["--no-mtp"], "qwen3_5_moe_text": ["--no-mtp"]}


def fixture_overrides(variant: str, vocab_size: int) -> dict:
    """The make_tiny_hf_model overrides `variant`'s fixture is built with (beyond the variant's own)."""
    return {"vocab_size": vocab_size, "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0,
            "max_position_embeddings": 256, **VARIANT_OVERRIDES.get(variant, {})}


def build_hf(variant: str, directory: pathlib.Path):
    """The fixture's HF model (saved to `directory` with the tiny tokenizer); returns the torch model."""
    repo = pathlib.Path(__file__).resolve().parents[2]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from tests.conftest import make_tiny_hf_model, make_tiny_tokenizer

    vocab = make_tiny_tokenizer(directory)
    return make_tiny_hf_model(variant, directory, seed=SEED, **fixture_overrides(variant, vocab))


def convert(llama_cpp: pathlib.Path, hf_dir: pathlib.Path, out: pathlib.Path, flags: list[str] = ()) -> None:
    env = {**os.environ, "NO_LOCAL_GGUF": "1"}  # the script itself must not add gguf-py after ours
    subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp), str(hf_dir), "--outfile", str(out),
                    "--outtype", "f32", *flags], check=True, cwd=llama_cpp, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", metavar="VARIANT", help=f"some of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--llama-cpp", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("LLAMA_CPP_DIR", DEFAULT_LLAMA_CPP)))
    args = parser.parse_args()
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        parser.error(f"{args.llama_cpp} has no convert_hf_to_gguf.py")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for variant in args.variants or VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = pathlib.Path(tmp) / f"tiny-{variant}"  # a fixed name: general.name derives from it
            hf_dir.mkdir()
            build_hf(variant, hf_dir)
            out = OUT_DIR / f"{variant}.gguf"
            convert(args.llama_cpp.resolve(), hf_dir, out, CONVERTER_FLAGS.get(variant, []))
            print(f"{out}: {out.stat().st_size} bytes", flush=True)
    total = sum(p.stat().st_size for p in OUT_DIR.glob("*.gguf"))
    print(f"total {total} bytes in {OUT_DIR} (converter: {LLAMA_CPP_VERSION})")


if __name__ == "__main__":
    main()

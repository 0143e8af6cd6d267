"""HF checkpoints: a directory with config.json and `*.safetensors` (one file, or shards listed by
`model.safetensors.index.json`), read memory-mapped (`weld.weights.safetensors_file`).
"""

from __future__ import annotations

import json
import pathlib

from weld.models import family_for_hf
from weld.utils.errors import ModelNotFoundError, UnsupportedModelError
from weld.weights.safetensors_file import FLOAT_DTYPES, SafetensorsFile
from weld.weights.tree import CheckpointError, TensorSource, plan_tensors

INDEX_FILE = "model.safetensors.index.json"


def read_config(path: str | pathlib.Path) -> dict:
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise ModelNotFoundError(f"{path}: no config.json; a HF model directory needs one")
    try:
        return json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None


def _shards(directory: pathlib.Path) -> list[pathlib.Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        other = [p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (found {', '.join(other)}: weld reads safetensors only)" if other else ""
        raise ModelNotFoundError(f"{directory}: no *.safetensors weights{hint}")
    return files


def open_hf(path: str | pathlib.Path) -> TensorSource:
    """A HF model directory, opened and planned (`TensorSource`)."""
    directory = pathlib.Path(path)
    config = read_config(directory)
    quantized = (config.get("quantization_config") or {}).get("quant_method")
    if quantized:  # FP8 (DeepSeek-V3, Kimi K2), MXFP4 (gpt-oss), GPTQ, AWQ ...: weld reads float tensors
        raise UnsupportedModelError(f"{directory}: config.json sets quantization_config.quant_method = "
                                    f"{quantized!r}; weld loads unquantized safetensors (or a GGUF)")
    try:
        family = family_for_hf(config)
        cfg = family.Config.from_hf(config)
    except ValueError as e:
        raise UnsupportedModelError(f"{directory}: {e}") from None

    files = [SafetensorsFile(p) for p in _shards(directory)]
    owner: dict[str, SafetensorsFile] = {}
    duplicates = []
    for file in files:
        for name in file.entries:
            if name in owner:
                duplicates.append(f"{name} (in {owner[name].path.name} and {file.path.name})")
            owner[name] = file
    if duplicates:
        raise CheckpointError(f"{directory}: {len(duplicates)} tensors stored twice: {', '.join(duplicates[:6])}")

    specs = family.weight_specs(cfg)
    plan = plan_tensors(str(directory), {name: f.entries[name][1] for name, f in owner.items()},
                        family.hf_keymap(cfg), specs)
    bad = sorted(f"{p.name} ({owner[p.name].entries[p.name][0]})" for p in plan
                 if owner[p.name].entries[p.name][0] not in FLOAT_DTYPES)
    if bad:
        raise UnsupportedModelError(f"{directory}: unsupported tensor dtypes: {', '.join(bad[:6])} "
                                    f"(weld reads {', '.join(FLOAT_DTYPES)})")

    def nbytes(name: str) -> int:
        begin, end = owner[name].entries[name][2]
        return end - begin

    order = sorted(plan, key=lambda p: (str(owner[p.name].path), owner[p.name].entries[p.name][2]))

    def read_slice(name: str, index: tuple):
        block = owner[name].read(name, index)
        return block, block.nbytes

    return TensorSource(directory.name, family, cfg, order, lambda name: (owner[name].array(name), True), nbytes,
                        release=lambda name: owner[name].release(name), read_slice=read_slice)

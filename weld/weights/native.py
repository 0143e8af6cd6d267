"""weld checkpoints: safetensors shards plus a manifest, written by `weld convert` from a GGUF or
a HF checkpoint (quantized if asked) and loaded memory-mapped with `--model DIR`.

    DIR/weld.json                  the manifest (below)
    DIR/model-00001.safetensors    the tensors, leaf by leaf, about max_shard_bytes per shard
    DIR/gguf_metadata.json         a GGUF source's key/values (its tokenizer and chat template), or
    DIR/tokenizer.json, ...        a HF source's tokenizer, chat template and config files

The manifest: {"format": "weld", "version", "family" (its NAME), "config" (the family's Config,
`weld.utils.records`), "quantization" (the mode asked for: one of `quant.MODES`, "none", or null for
as stored), "formats" (the quantized formats present), "source", "tensors" {leaf path: {"shard",
"shape", "axes" (the logical axes, for sharding), and "dtype" or, quantized, "format"}},
"shards" {file: {"bytes", "sha256"}}}. Each leaf of `weight_specs(cfg)` is one tensor under its
path ("layers.0.wq"), or for a `quant.QuantWeight` its arrays as the type holds them (`<path>.codes`,
`<path>.scales`, `<path>.mins`: the CPU kernels' panels in uint8 and float16, or for
"int8_channel" int8 rows and float32 scales), so loading copies bytes and re-packs nothing.

A conversion streams: one leaf is read, quantized and appended to the open shard at a time, so
memory holds one leaf (one expert stack) beyond the mapped source. It is resumable: every shard
finished is recorded (with its checksum) in DIR/.weld-convert.json before the next begins; a new
run with the same source and options verifies those shards and converts only what is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import time

import numpy as np

from weld.models import FAMILIES
from weld.models.common import quant
from weld.models.common.checkpoint import Match
from weld.models.common.spec import iter_specs, path_str
from weld.utils import records
from weld.utils.errors import InvalidInputError, UnsupportedModelError
from weld.weights.safetensors_file import SafetensorsFile, ShardWriter, sha256_of
from weld.weights.tree import CheckpointError, Planned, TensorSource, finished, parse_dtype

MANIFEST = "weld.json"
PROGRESS = ".weld-convert.json"
GGUF_METADATA = "gguf_metadata.json"
FORMAT_VERSION = 1
DEFAULT_SHARD_BYTES = 2 * 10**9  # transformers' sizes are decimal: 2GB
MIN_SHARD_BYTES = 1 << 16  # fewer than a few thousand files for any model weld can hold
_PARTS = ("codes", "scales", "mins")
_SIDE_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "tokenizer*")  # a HF directory's non-weight files


def is_checkpoint(directory: pathlib.Path) -> bool:
    return (directory / MANIFEST).is_file()


# ----- writing -----

@dataclasses.dataclass
class ConvertResult:
    directory: pathlib.Path
    manifest: dict
    shards_reused: int
    seconds: float

    @property
    def nbytes(self) -> int:
        return sum(s["bytes"] for s in self.manifest["shards"].values())


def _fingerprint(path: pathlib.Path) -> dict:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf"))
    return {"path": str(path.resolve()), "files": {p.name: p.stat().st_size for p in files}}


def convert(source, out: str | pathlib.Path, quantization: str | None = None, dtype: str = "auto",
            max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool | None = None) -> ConvertResult:
    """Writes the weld checkpoint of `source` (a `weld.weights.ModelSource` or anything
    `resolve_model` takes) to directory `out`.

    quantization: None keeps what the source stores quantized (a GGUF's kept blocks) and the rest
    as stored; "none" dequantizes; a mode of `quant.MODES` ("int8", "int4", ...) quantizes the
    declared matrices and head.
    dtype of the float tensors: "auto" (as the source stores them; a GGUF's dequantized tensors
    float32), "float32", "bfloat16", "float16". An `out` holding a conversion of the same source
    with the same options resumes it; one with other options, or anything else, is an error."""
    from weld.weights import open_checkpoint, resolve_model  # noqa: PLC0415  (weld.weights imports this module)

    start = time.monotonic()
    src_model = source if hasattr(source, "kind") else resolve_model(source)
    if quantization is not None and quantization not in ("none", *quant.MODES):
        raise InvalidInputError(f"quantization must be one of none, {', '.join(quant.MODES)}, got {quantization!r}")
    cast = None if dtype == "auto" else parse_dtype(dtype)
    if max_shard_bytes < MIN_SHARD_BYTES:
        raise InvalidInputError(f"the shard size must be at least {MIN_SHARD_BYTES} bytes, got {max_shard_bytes}")
    out = pathlib.Path(out).expanduser()
    options = {"source": _fingerprint(src_model.path), "quantization": quantization, "dtype": dtype}
    done = _finished_shards(out, options)
    src = open_checkpoint(src_model, quantization)  # a source that does not open leaves no `out` behind
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("*.partial")) + list(out.glob("*.data")):
        stale.unlink()
    _write_json(out / PROGRESS, {**options, "shards": done})  # first: a run stopped from here on resumes

    declared = dict(iter_specs(src.family.weight_specs(src.cfg)))
    by_name = {path_str(p): p for p in declared}
    skip = frozenset(by_name[name] for shard in done.values() for name in shard["tensors"])
    _write_side_files(src, src_model, out)

    index = max((int(name.split("-")[1].split(".")[0]) for name in done), default=0)
    writer, entries = None, {}

    def close_shard():
        nonlocal writer, entries
        size, digest = writer.close()
        done[writer.path.name] = {"bytes": size, "sha256": digest, "tensors": entries}
        _write_json(out / PROGRESS, {**options, "shards": done})
        writer, entries = None, {}

    try:
        for leaf in src.leaves(progress, skip=skip, verb="converting"):
            value = finished(leaf, cast or _dtype_of(leaf.value), quantization)
            tensors = _tensors(path_str(leaf.path), value)
            if writer is None:
                index += 1
                writer = ShardWriter(out / f"model-{index:05d}.safetensors", {"format": "weld"})
            for name, array in tensors.items():
                writer.add(name, array)
            entries[path_str(leaf.path)] = _entry(writer.path.name, leaf.spec, value)
            if writer.nbytes >= max_shard_bytes:
                close_shard()
        if writer is not None:
            close_shard()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    tensors = {name: entry for shard in done.values() for name, entry in shard["tensors"].items()}
    missing = sorted(set(by_name) - set(tensors))
    if missing:  # a recorded shard set that does not cover the model (edited by hand)
        raise CheckpointError(f"{out}: the finished shards miss {len(missing)} tensors ({', '.join(missing[:4])}); "
                              "delete the directory and convert again")
    formats = sorted({e["format"] for e in tensors.values() if "format" in e})
    manifest = {"format": "weld", "version": FORMAT_VERSION, "family": src.family.NAME,
                "config": records.to_json(src.cfg), "quantization": quantization, "formats": formats,
                "dtype": dtype, "source": options["source"], "name": src_model.name,
                "tensors": {name: tensors[name] for name in by_name},
                "shards": {name: {"bytes": s["bytes"], "sha256": s["sha256"]} for name, s in sorted(done.items())},
                "options": options}
    _write_json(out / MANIFEST, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    reused = len(done) - sum(1 for s in done.values() if s.get("new", True))
    return ConvertResult(out, manifest, reused, time.monotonic() - start)


def _dtype_of(value) -> np.dtype:
    return np.dtype(np.float32) if isinstance(value, quant.QuantWeight) else value.dtype


def _tensors(name: str, value) -> dict[str, np.ndarray]:
    if isinstance(value, quant.QuantWeight):
        return {f"{name}.{part}": np.asarray(getattr(value, part)) for part in _PARTS
                if getattr(value, part) is not None}
    return {name: np.asarray(value)}


def _entry(shard: str, spec, value) -> dict:
    entry = {"shard": shard, "shape": list(spec.shape), "axes": list(spec.axes)}
    if isinstance(value, quant.QuantWeight):
        entry["format"] = value.fmt
    else:
        entry["dtype"] = str(value.dtype)
    return entry


def _write_json(path: pathlib.Path, document: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, path)


def _finished_shards(out: pathlib.Path, options: dict) -> dict:
    """The shards an earlier run of this conversion finished and that verify (size and sha256),
    {file: {"bytes", "sha256", "tensors"}}; {} for a new or empty directory."""
    if not out.exists():
        return {}
    if not out.is_dir():
        raise InvalidInputError(f"{out} exists and is not a directory")
    record = None
    for name in (PROGRESS, MANIFEST):
        if (out / name).is_file():
            try:
                record = json.loads((out / name).read_text())
            except ValueError:
                raise InvalidInputError(f"{out / name} is not valid JSON: delete {out} and convert again") from None
            if name == MANIFEST:  # a finished conversion: its shards, with the tensors each holds
                shards = {s: {**v, "tensors": {}} for s, v in record.get("shards", {}).items()}
                for tname, entry in record.get("tensors", {}).items():
                    if entry.get("shard") in shards:
                        shards[entry["shard"]]["tensors"][tname] = entry
                record = {**record.get("options", {}), "shards": shards}
            break
    if record is None:
        if any(out.iterdir()):
            raise InvalidInputError(f"{out} is not empty and holds no weld conversion: pass an empty or new --out")
        return {}
    theirs = {k: record.get(k) for k in options}
    if theirs != options:
        differ = ", ".join(k for k in options if theirs[k] != options[k])
        raise InvalidInputError(f"{out} holds a conversion with another {differ}: pass another --out, or delete it "
                                "to start over")
    good = {}
    for name, shard in record.get("shards", {}).items():
        path = out / name
        if path.is_file() and path.stat().st_size == shard.get("bytes") and sha256_of(path) == shard.get("sha256"):
            good[name] = {**shard, "new": False}
        else:
            path.unlink(missing_ok=True)
    return good


def _write_side_files(src: TensorSource, model, out: pathlib.Path) -> None:
    """What the tokenizer needs: a GGUF's key/values, or a HF directory's side files."""
    if src.metadata is not None:
        _write_json(out / GGUF_METADATA, _plain(src.metadata))
        return
    directory = model.path
    for pattern in _SIDE_FILES:
        for file in directory.glob(pattern):
            if file.is_file() and file.name not in (MANIFEST, PROGRESS) and not file.name.endswith(".index.json"):
                shutil.copy2(file, out / file.name)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


# ----- reading -----

def read_manifest(directory: pathlib.Path) -> dict:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable weld manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "weld":
        raise CheckpointError(f"{path} is not a weld manifest (no \"format\": \"weld\")")
    if manifest.get("version") != FORMAT_VERSION:
        raise UnsupportedModelError(f"{path}: weld checkpoint version {manifest.get('version')!r}; this weld reads "
                                    f"version {FORMAT_VERSION}: convert the model again")
    return manifest


def open_weld(directory: str | pathlib.Path) -> TensorSource:
    """A weld checkpoint, opened and checked against its family's declaration (every leaf, its
    shape and its stored form) before any tensor is read."""
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    families = {f.NAME: f for f in FAMILIES}
    family = families.get(manifest.get("family"))
    if family is None:
        raise UnsupportedModelError(f"{directory}: unknown model family {manifest.get('family')!r}; weld has "
                                    f"{', '.join(families)}")
    try:
        cfg = records.from_json(family.Config, manifest.get("config"))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{directory / MANIFEST}: bad config: {e}") from None
    declared = dict(iter_specs(family.weight_specs(cfg)))
    tensors = manifest.get("tensors") or {}
    names = {path_str(p): p for p in declared}
    problems = [f"missing {n}" for n in names if n not in tensors] + [f"unexpected {n}" for n in tensors if n not in names]
    if problems:
        raise CheckpointError(f"{directory}: the manifest does not match the {family.NAME} declaration: "
                              f"{', '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}")
    shards: dict[str, SafetensorsFile] = {}
    for name, info in (manifest.get("shards") or {}).items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{directory}: shard {name} is missing")
        if path.stat().st_size != info.get("bytes"):
            raise CheckpointError(f"{directory}: shard {name} has {path.stat().st_size} bytes, the manifest says "
                                  f"{info.get('bytes')} (truncated or replaced: convert again)")
        shards[name] = SafetensorsFile(path)

    def stored(name: str) -> list[tuple[str, SafetensorsFile]]:
        entry = tensors[name]
        file = shards.get(entry.get("shard"))
        if file is None:
            raise CheckpointError(f"{directory}: tensor {name} is in shard {entry.get('shard')!r}, which the "
                                  "manifest does not list")
        keys = [f"{name}.{p}" for p in _PARTS] if "format" in entry else [name]
        return [(k, file) for k in keys if k in file.entries]

    plan = []
    for name, path in names.items():
        _check_entry(directory, name, tensors[name], declared[path], {k: f.entries[k] for k, f in stored(name)})
        plan.append(Planned(name, Match((path,)), declared[path].shape))

    def read(name: str):
        entry, parts = tensors[name], dict(stored(name))
        if "format" not in entry:
            return parts[name].array(name), True
        arrays = {p: (parts[f"{name}.{p}"].array(f"{name}.{p}") if f"{name}.{p}" in parts else None) for p in _PARTS}
        n, k = declared[names[name]].shape[-2:]
        return quant.QuantWeight(arrays["codes"], arrays["scales"], arrays["mins"], n, k, entry["format"]), True

    def nbytes(name: str) -> int:
        return sum(f.entries[k][2][1] - f.entries[k][2][0] for k, f in stored(name))

    def offset(p: Planned):
        (key, file), *_ = stored(p.name)
        return str(file.path), file.entries[key][2][0]

    metadata = None
    if (directory / GGUF_METADATA).is_file():
        try:
            metadata = json.loads((directory / GGUF_METADATA).read_text())
        except ValueError as e:
            raise CheckpointError(f"{directory / GGUF_METADATA} is not valid JSON: {e}") from None
    dequantized: dict[str, np.ndarray] = {}  # a quantized leaf being sliced: its float matrix, made once

    def read_slice(name: str, index: tuple):
        """A float leaf's block, copied from its shard; a quantized leaf (panels) is read whole and
        dequantized once for all of its blocks (counted once)."""
        if "format" not in tensors[name]:
            block = dict(stored(name))[name].read(name, index)
            return block, block.nbytes
        nbytes_read = 0
        if name not in dequantized:
            dequantized.clear()
            dequantized[name] = np.asarray(read(name)[0].unpacked())
            nbytes_read = nbytes(name)
        return np.array(dequantized[name][index]), nbytes_read

    def release(name: str) -> None:
        dequantized.pop(name, None)
        for key, file in stored(name):
            file.release(key)

    return TensorSource(directory.name, family, cfg, sorted(plan, key=offset), read, nbytes, metadata, release,
                        read_slice)


def _check_entry(directory, name: str, entry: dict, spec, parts: dict) -> None:
    """One leaf's stored tensors against its declaration: shapes and dtypes, and for a quantized
    leaf the panel layout its format and shape imply."""
    where = f"{directory}: tensor {name}"
    if "format" not in entry:
        if name not in parts:
            raise CheckpointError(f"{where} is not in its shard")
        kind, shape, _ = parts[name]
        if kind not in ("F32", "F16", "BF16"):
            raise CheckpointError(f"{where} has dtype {kind}, expected a float type")
        if tuple(shape) != spec.shape:
            raise CheckpointError(f"{where} has shape {tuple(shape)}, expected {spec.shape}")
        return
    fmt = entry["format"]
    if fmt not in quant.FORMATS:
        raise UnsupportedModelError(f"{where} has quantized format {fmt!r}; weld knows {', '.join(quant.FORMATS)}")
    if len(spec.shape) not in (2, 3):
        raise CheckpointError(f"{where} is quantized, but it is declared {spec.shape}, not a matrix")
    bits, _, has_mins = quant.FORMATS[fmt]
    *lead, n, k = spec.shape
    p, nb = -(-n // quant.PANEL), -(-k // quant.BLOCK)
    scales = (*lead, *quant.scales_shape(fmt, n, k))
    want = {"codes": ("U8", (*lead, p, nb, quant.block_bytes(bits))), "scales": ("F16", scales)}
    if has_mins:
        want["mins"] = want["scales"]
    if fmt in quant.ROWS:  # codes as rows, f32 scales per output (and group)
        want = {key: (kind, (*lead, *shape)) for key, (kind, shape) in quant.rows_parts(fmt, n, k).items()}
    have = {key.rsplit(".", 1)[1]: (kind, tuple(shape)) for key, (kind, shape, _) in parts.items()}
    if have != want:
        raise CheckpointError(f"{where} ({fmt}, {spec.shape}) is stored as {have}, expected {want}")


__all__ = ["convert", "open_weld", "is_checkpoint", "read_manifest", "MANIFEST"]

"""GGUF checkpoints (llama.cpp's format): metadata, dequantization and the weight tree.

The file is memory-mapped by `gguf.GGUFReader`; tensors are dequantized to float32 one at a
time, cast to the requested dtype and put on the device, so host memory holds one tensor at
a time beyond the mapped file. A sharded load dequantizes only the blocks of each device's
slice (`GGUFFile.read`).

Each family's `gguf_keymap` states how llama.cpp's names and layouts map onto its tree (e.g.
the llama family undoes the converter's Q/K row permutation; llama3-style GGUFs carry
`rope_freqs.weight`, which the family's `Config.from_gguf` reads instead of a weight).
"""

from __future__ import annotations

import pathlib
from typing import Any

import gguf
import numpy as np

from weld.models import family_for_gguf
from weld.models.common import quant
from weld.models.common.spec import iter_specs
from weld.utils.errors import ModelNotFoundError, UnsupportedModelError
from weld.utils.memory import release_mapped
from weld.weights.tree import CheckpointError, TensorSource, plan_tensors

Q = gguf.GGMLQuantizationType
# Types weld loads; each is checked against an independent reference in tests/weights.
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS})


class _PastEndOfFile(Exception):
    def __init__(self, needed: int):
        self.needed = needed


class _Reader(gguf.GGUFReader):
    """GGUFReader that parses from a plain ndarray view of its memmap and refuses reads past EOF.

    Why: every `np.memmap` slice runs memmap's Python `__array_finalize__`, which made parsing
    SmolLM2's 98k-entry vocabulary take ~6 s; a plain view takes ~1.5 s. And a truncated file
    would otherwise surface as an odd reshape error instead of "truncated".
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count, dtype = int(count), np.dtype(dtype)
        end = offset + dtype.itemsize * count
        if end > plain.shape[0]:
            raise _PastEndOfFile(end)
        arr = plain[offset:end].view(dtype)
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


class GGUFFile:
    """An open GGUF file: `metadata` (plain Python values) and its tensors by name."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self._reader = _open_reader(self.path)
        self.metadata: dict[str, Any] = {
            name: _field_value(field) for name, field in self._reader.fields.items()
            if not name.startswith("GGUF.")}  # GGUF.version etc. describe the container, not the model
        self.tensors = {t.name: t for t in self._reader.tensors}
        self._reader.fields = {}  # its numpy views per array item: ~50 MB for a 49k-token vocabulary, read now

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical numpy shape: GGUF lists dims innermost first, so [in, out] becomes (out, in)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 numpy, shape `self.shape(name)`; may be a view of the mapped file."""
        t = self.tensors[name]
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(f"{self.path}: tensor {name} has type {t.tensor_type.name}, which weld "
                                        f"does not load (supported: {_supported_names()})")
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))

    def read(self, name: str, index: tuple) -> tuple[np.ndarray, int]:
        """The block `index` of the tensor (a slice per axis of `self.shape(name)`, the first may be
        an int array of rows) as new float32 numpy, and the bytes read: only the blocks of the
        rows asked for that hold the columns asked for (a row of a quantized type is whole
        blocks; columns are split at block boundaries, or the blocks at either end are read
        whole and trimmed)."""
        t = self.tensors[name]
        shape = self.shape(name)
        per_block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        lead, k = shape[:-1], shape[-1]
        start = int(t.data_offset)
        raw = self._reader.data[start:start + int(t.n_bytes)].view(np.ndarray).reshape(-1, k // per_block * block_bytes)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        rows = np.arange(raw.shape[0]).reshape(lead)[index[:-1]]  # the rows of the block, shaped as its lead axes
        flat = rows.reshape(-1)
        if flat.size and np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):  # a run: one slice
            flat_index = slice(int(flat[0]), int(flat[0]) + flat.size)
        else:
            flat_index = flat
        first, stop, _ = index[-1].indices(k)
        b0, b1 = first // per_block, -(-stop // per_block)  # the blocks holding columns [first, stop)
        data = np.array(raw[flat_index, b0 * block_bytes:b1 * block_bytes])
        values = gguf.quants.dequantize(data, t.tensor_type).reshape(flat.size, -1)
        values = values[:, first - b0 * per_block:stop - b0 * per_block]
        return np.ascontiguousarray(values).reshape(rows.shape + (stop - first,)), data.nbytes

    def release(self, name: str) -> None:
        """Drops the tensor's pages from memory once it has been copied out (`release_mapped`)."""
        t = self.tensors[name]
        release_mapped(self._reader.data, int(t.data_offset), int(t.data_offset) + int(t.n_bytes))


def read_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """The GGUF's key/value metadata: strings decoded, arrays as lists (e.g. tokenizer.ggml.tokens)."""
    return GGUFFile(path).metadata


def _open_reader(path: pathlib.Path) -> _Reader:
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = _Reader(path, "r")
    except _PastEndOfFile as e:
        raise CheckpointError(f"{path} is truncated or damaged: it has {size} bytes but its header "
                              f"describes at least {e.needed}; download it again") from None
    except Exception as e:  # gguf raises ValueError/KeyError/IndexError for damaged headers
        raise CheckpointError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from None
    # Belt and braces, should gguf's reader stop calling `_get` for tensor data.
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise CheckpointError(f"{path} is truncated: it has {size} bytes but its tensors need {end}; "
                              "download it again")
    return reader


def _text(part: np.ndarray) -> str:
    # surrogateescape keeps invalid UTF-8 (rare in vocabularies) recoverable byte for byte.
    return part.tobytes().decode("utf-8", errors="surrogateescape")


def _field_value(field: Any) -> Any:
    """A GGUFReader field as a plain Python value."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if len(field.types) == 1 or not field.data:  # an empty array records no element type
            return []
        item = field.types[1]
        if item == gguf.GGUFValueType.STRING:
            return [_text(field.parts[i]) for i in field.data]
        if item == gguf.GGUFValueType.ARRAY:  # nested arrays: rare, let gguf flatten them
            return field.contents()
        # one 1-element part per item: one concatenate is much faster than per-item tolist()
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    if kind == gguf.GGUFValueType.STRING:
        return _text(field.parts[-1])
    return field.parts[-1].tolist()[0]


def _supported_names() -> str:
    return ", ".join(sorted(t.name for t in SUPPORTED_TYPES))


def open_gguf(path: str | pathlib.Path, quantization: str | None = None) -> TensorSource:
    """A GGUF model, opened and planned (`TensorSource`; its metadata the GGUF's key/values).
    quantization None: matrices and expert stacks stored in a type of `quant.GGUF_KEPT` become
    `quant.QuantWeight`s of the same blocks (`quant.gguf_blocks`; linear layers, the expert loop
    and embedding lookups take them); other types, matrices a key map converts beyond reordering
    rows, and converted stacks are dequantized. "none", "int8", "int4": everything dequantized
    (and quantized again as asked, `weld.weights.load_model`)."""
    f = GGUFFile(path)
    try:
        family = family_for_gguf(f.architecture)
        cfg = family.Config.from_gguf(f.metadata, {name: f.shape(name) for name in f.tensors}, f.dequantize)
    except ValueError as e:
        raise UnsupportedModelError(f"{f.path}: {e}") from None
    specs = family.weight_specs(cfg)
    plan = plan_tensors(str(f.path), {name: f.shape(name) for name in f.tensors}, family.gguf_keymap(cfg), specs)
    unsupported = sorted(f"{p.name} ({f.type_name(p.name)})" for p in plan
                         if f.tensors[p.name].tensor_type not in SUPPORTED_TYPES)
    if unsupported:  # fail before loading anything
        raise UnsupportedModelError(f"{f.path}: unsupported tensor types: {', '.join(unsupported[:6])}"
                                    f"{' ...' if len(unsupported) > 6 else ''} (weld loads {_supported_names()})")

    declared = dict(iter_specs(specs))
    def keeps(p) -> bool:
        """Matrices whose conversion only reorders or splits rows, and whole expert stacks."""
        if quantization is not None or f.type_name(p.name) not in quant.GGUF_KEPT or p.match.expert is not None:
            return False
        ranks = {len(declared[path].shape) for path in p.match.paths}
        return (ranks == {2} and (p.match.convert is None or p.match.rows_only)) or \
            (ranks == {3} and p.match.convert is None and len(f.shape(p.name)) == 3)

    kept = {p.name for p in plan if keeps(p)}

    def read(name: str):
        if name in kept:
            try:
                return quant.gguf_blocks(f.tensors[name].data, f.type_name(name), f.shape(name)), False
            except ValueError as err:
                raise CheckpointError(f"{f.path}: tensor {name}: {err}") from None
        return f.dequantize(name), f.tensors[name].tensor_type == Q.F32  # only F32 is a view of the file

    order = sorted(plan, key=lambda p: f.tensors[p.name].data_offset)
    return TensorSource(f.path.name, family, cfg, order, read, lambda name: f.tensors[name].n_bytes, f.metadata,
                        f.release, f.read)

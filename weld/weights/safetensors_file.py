"""Safetensors files, read memory-mapped and written tensor by tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}} (and an optional "__metadata__" of strings) and the raw data, tensors back to back.
We read the header ourselves and memory-map the data, because safetensors' numpy reader has no
bfloat16 and most HF checkpoints are bfloat16; we write it ourselves so that a shard never has
to be held in memory (`ShardWriter`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import struct

import ml_dtypes
import numpy as np

from weld.utils.errors import UnsupportedModelError
from weld.utils.memory import release_mapped
from weld.weights.tree import CheckpointError

FLOAT_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
                "F64": np.dtype(np.float64)}
DTYPES = {**FLOAT_DTYPES, "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I32": np.dtype(np.int32)}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_CHUNK = 16 << 20


class SafetensorsFile:
    """One safetensors file: `entries` {name: (dtype str, shape, (begin, end))}, `metadata` (the
    header's "__metadata__") and memory-mapped arrays."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if 8 + n > size:
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(f.read(n))
            self.metadata = header.pop("__metadata__", None) or {}
            self.entries = {name: (e["dtype"], tuple(e["shape"]), tuple(e["data_offsets"]))
                            for name, e in header.items()}
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
        self._start = 8 + n
        end = self._start + max((e[2][1] for e in self.entries.values()), default=0)
        if end > size:
            raise CheckpointError(f"{path} is truncated: it has {size} bytes, its tensors need {end}")
        for name, (kind, shape, (begin, stop)) in self.entries.items():
            expected = DTYPES[kind].itemsize * math.prod(int(d) for d in shape) if kind in DTYPES else None  # no overflow
            if expected is not None and stop - begin != expected:
                raise CheckpointError(f"{path}: tensor {name} of shape {shape} ({kind}) has {stop - begin} bytes "
                                      f"of data, expected {expected}")
        self._data: np.memmap | None = None

    def array(self, name: str) -> np.ndarray:
        """The tensor as a view of the mapped file, in its stored dtype."""
        kind, shape, (begin, end) = self.entries[name]
        if kind not in DTYPES:
            raise UnsupportedModelError(f"{self.path}: tensor {name} has dtype {kind}; weld reads "
                                        f"{', '.join(DTYPES)} safetensors")
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._data[self._start + begin:self._start + end].view(np.ndarray)
        return raw.view(DTYPES[kind]).reshape(shape)

    def read(self, name: str, index: tuple) -> np.ndarray:
        """A new array of the tensor's block `index` (a slice per axis, the first may be an int
        array of rows), in its stored dtype, copied from the mapped file: a block of rows is one
        run of bytes; a block of columns copies its run of each row and touches nothing else
        (but the pages those runs share with the other columns)."""
        part = self.array(name)[index]
        # rows picked by an int array are a copy already; a slice of the mapping is copied out
        return part if index and isinstance(index[0], np.ndarray) else np.array(part)

    def release(self, name: str) -> None:
        """Drops the tensor's pages from memory once it has been copied out (`release_mapped`)."""
        _, _, (begin, end) = self.entries[name]
        release_mapped(self._data, self._start + begin, self._start + end)


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ShardWriter:
    """Writes one safetensors file tensor by tensor, holding none of them: the data goes to a side
    file as it comes, and `close` writes the header (known only then) and the data behind it
    into `path` (through a `.partial` name, so a file under `path` is always complete)."""

    def __init__(self, path: pathlib.Path, metadata: dict[str, str] | None = None):
        self.path = pathlib.Path(path)
        self.metadata = dict(metadata or {})
        self.entries: dict[str, dict] = {}
        self._data_path = self.path.with_name(self.path.name + ".data")
        self._data = open(self._data_path, "wb")
        self.nbytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self.entries:
            raise ValueError(f"tensor {name} written twice")
        array = np.ascontiguousarray(array)
        if array.dtype not in _NAMES:
            raise ValueError(f"tensor {name}: dtype {array.dtype} has no safetensors name")
        self._data.write(array.reshape(-1).view(np.uint8).data)
        self.entries[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                              "data_offsets": [self.nbytes, self.nbytes + array.nbytes]}
        self.nbytes += array.nbytes

    def close(self) -> tuple[int, str]:
        """Writes the file. Returns (its size in bytes, its sha256)."""
        self._data.close()
        header = {"__metadata__": self.metadata, **self.entries} if self.metadata else dict(self.entries)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        digest = hashlib.sha256()
        partial = self.path.with_name(self.path.name + ".partial")
        with open(partial, "wb") as out, open(self._data_path, "rb") as data:
            head = struct.pack("<Q", len(text)) + text
            out.write(head)
            digest.update(head)
            while chunk := data.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.path)
        self._data_path.unlink()
        return self.path.stat().st_size, digest.hexdigest()

    def abort(self) -> None:
        self._data.close()
        self._data_path.unlink(missing_ok=True)


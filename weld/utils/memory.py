"""Handing freed heap memory and read file pages back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap

import numpy as np


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


def release_free_memory() -> bool:
    """Returns the C heap's free pages to the OS (glibc's malloc_trim). Loading a checkpoint and
    compiling programs free large temporaries that glibc otherwise keeps mapped: ~85 MB of a served
    bundled model's resident memory (benchmarks/serve_memory.py). False where there is no glibc."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0) >= 0)


def release_mapped(data: np.memmap | None, begin: int, end: int) -> None:
    """Drops the resident pages of bytes [begin, end) of a read-only mapped file (MADV_DONTNEED;
    a later read maps them in again from the file). A loader calls it once a tensor is copied out,
    so that loading holds the weights once, not the weights plus the file's pages. No-op where
    the mapping or madvise is unavailable."""
    raw = getattr(data, "_mmap", None)
    advise = getattr(mmap, "MADV_DONTNEED", None)
    if raw is None or advise is None or end <= begin:
        return
    start = begin - begin % mmap.PAGESIZE
    try:
        raw.madvise(advise, start, min(end, len(raw)) - start)
    except (OSError, ValueError):
        pass


def memory_maps() -> tuple[int, int] | None:
    """(memory mappings this process holds, the most the kernel allows it: vm.max_map_count), or
    None where /proc does not tell. Every program XLA:CPU compiles holds hundreds of mappings
    (~480 for a decode step of the bundled model), and a process past the limit cannot map
    memory any more: LLVM fails to compile and the process dies."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            count = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return count, limit

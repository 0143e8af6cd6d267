"""Handing freed heap memory back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


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

"""Native CPU kernels, called from jitted code through the XLA FFI.

XLA:CPU leaves some work far from what the machine can do: paged decode attention
(paged_attention.cc) and the projections, on weights packed in panels (matmul.cc) or quantized
(quant_matmul.cc). norm.cc is RMSNorm in one fixed order for every row (batch invariance). stream.cc is
the mailbox a decode loop hands its outputs to while it runs (`stream_put`, `stream_taker`). These kernels
are C++ sources shipped with weld and compiled on first use on the machine that runs them
(-O3 -march=native), into ~/.cache/weld/kernels (or $WELD_KERNEL_CACHE_DIR). The build key
covers the sources, the flags, the compiler, jax/jaxlib and the CPU, so a shared home directory
never hands one machine another's binary.

No compiler, or a failed build, is not an error: weld logs one warning and keeps the jnp path,
which computes the same thing. WELD_CPU_KERNELS=0 turns the kernels off (read when a program is
traced; 1, the default, turns them on).

Most kernels pick their vector path when compiled, from the CPU -march=native describes (the
quantized matmul picks at run time, `quant_isa`). WELD_CPU_MARCH (default native) builds for
another target instead: `x86-64` compiles the portable scalar paths, which is how the test suite
checks them on a machine with AVX2, and `x86-64-v3` the AVX2 ones on a machine with AVX-512
(tests/kernels/test_cpu_baseline_build.py); `built_with_avx2()` and `built_with_avx512()` say which
kind the loaded library is.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from weld.utils.errors import InvalidInputError

log = logging.getLogger("weld")

# (the slowest to compile first: the build runs them side by side)
_SOURCES = ("quant_matmul.cc", "paged_attention.cc", "matmul.cc", "norm.cc", "argmax.cc", "stream.cc")
_HEADERS = ("parallel.h", "half.h")
_FLAGS = ["-O3", "-std=c++17", "-fPIC",
          # lets the compiler vectorize the dot products' sums; no NaN/inf assumptions are made
          "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"]
_TARGETS = {"weld_paged_attention": "WeldPagedAttention", "weld_packed_matmul": "WeldPackedMatmul",
            "weld_quant_matmul": "WeldQuantMatmul", "weld_rms_norm": "WeldRmsNorm", "weld_argmax": "WeldArgmax",
            "weld_stream_put": "WeldStreamPut"}
# The quantized matmul's instruction-set paths (its `isa` attribute), fastest last.
ISAS = ("scalar", "avx2", "avx512vnni")
# The quantized matmul's few-row calls: each thread's run of panels is claimed in this many pieces,
# so a helper that wakes late has its run's back taken by the others (`benchmarks/quant_matmul.py
# --chunks 1,8` compares it with whole runs in one process).
STREAM_CHUNKS = 8
# KV pool element types the paged attention kernel reads (widened to f32 as it reads them).
KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once tried; "error": why not
_stream_lib: ctypes.CDLL | None = None  # the library the streaming mailbox lives in, once registered


def enabled() -> bool:
    """Whether programs traced now use the kernels (WELD_CPU_KERNELS, default 1)."""
    value = os.environ.get("WELD_CPU_KERNELS", "1")
    if value not in ("0", "1"):
        raise InvalidInputError(f"WELD_CPU_KERNELS must be '0' or '1', got {value!r}")
    return value == "1"


def available() -> bool:
    """True when the kernels are enabled, the default backend is the CPU, and the library is built
    and registered (built on the first call; a failure is logged once and remembered)."""
    if not enabled() or jax.default_backend() != "cpu":
        return False
    _march()  # a malformed WELD_CPU_MARCH is the user's error, not a failed build to fall back from
    with _lock:
        if "ok" not in _state:
            try:
                _register(_build())
                _state["ok"] = True
            except Exception as e:  # no compiler, a compile error, a missing header: keep the jnp path
                _state.update(ok=False, error=str(e))
                log.warning("weld: native CPU kernels unavailable (%s); using the XLA path", str(e).splitlines()[0])
        return bool(_state["ok"])


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    return cxx


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _jaxlib_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxlib")
    except PackageNotFoundError:
        return ""


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "weld" / "kernels"
    return Path(os.environ.get("WELD_KERNEL_CACHE_DIR") or default)


def _march() -> str:
    """The compiler's -march target: WELD_CPU_MARCH, default native."""
    value = os.environ.get("WELD_CPU_MARCH", "native")
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,39}", value):
        raise InvalidInputError(f"WELD_CPU_MARCH must be a -march target such as native or x86-64, got {value!r}")
    return value


def _build() -> Path:
    here = Path(__file__).parent
    flags = [*_FLAGS, f"-march={_march()}"]
    sources = [here / name for name in _SOURCES]
    cxx = _compiler()
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256()
    for part in [*(p.read_bytes() for p in sources), *((here / h).read_bytes() for h in _HEADERS),
                 " ".join(flags).encode(), version.encode(),
                 jax.__version__.encode(), _jaxlib_version().encode(),
                 include.encode(), _cpu_id().encode(), platform.machine().encode()]:
        key.update(part)
        key.update(b"\0")
    out = cache_dir() / f"weld_cpu_{key.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name

        def run(what: str, cmd: list[str]) -> None:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {what} failed: {proc.stderr.strip()[-2000:]}")

        # one object per source, as many at once as there are cores (the first build's wait is
        # the slowest source's, quant_matmul.cc, instead of their sum), then one link
        objects = [Path(tmp) / f"{source.stem}.o" for source in sources]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
            for job in [pool.submit(run, source.name, [cxx, *flags, f"-I{include}", f"-I{here}", "-c", str(source),
                                                       "-o", str(obj)]) for source, obj in zip(sources, objects)]:
                job.result()
        run(", ".join(_SOURCES), [cxx, *flags, "-shared", *map(str, objects), "-o", str(tmp_out)])
        os.replace(tmp_out, out)  # atomic: a concurrent build of the same key writes the same bytes
    return out


def _register(path: Path) -> None:
    lib = ctypes.CDLL(str(path))
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    lib.weld_stream_take.restype = ctypes.c_int64
    lib.weld_stream_take.argtypes = [ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.POINTER(ctypes.c_int64)]
    lib.weld_stream_seq.restype = ctypes.c_int64
    _state["lib"] = lib  # keep it loaded
    global _stream_lib
    _stream_lib = lib


def stream_put(call_id: jax.Array, *buffers: jax.Array) -> jax.Array:
    """Inside a program: queues a copy of `buffers` in the process's streaming mailbox, tagged
    with call_id (s32[]); returns call_id, for the next put to take (which orders the puts). The
    program does not wait for a reader (unless 64 hand-overs are queued)."""
    return _stream_put_primitive().bind(call_id.astype(jnp.int32), *buffers)


@functools.cache
def _stream_put_primitive():
    """`weld_stream_put` as a primitive of its own: a custom call marked as having a side effect
    for XLA, and no effect to JAX. An `ffi_call(has_side_effect=True)` carries a JAX effect, and
    a program with one is dispatched by Python on every call, not by jit's C++ path: ~10 ms a
    call for a model's ~500 weight arrays on a 2-core CPU, measured. Being pure to JAX, a put
    whose result nothing reads is pruned (a loop's dead carry): a program keeps the last put's
    id among its outputs (`programs.decode`; tests/kernels/test_cpu_stream.py)."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    put = Primitive("weld_stream_put")
    put.def_abstract_eval(lambda call_id, *buffers: call_id)  # s32[] in, s32[] out (no jax.core type named)
    put.def_impl(lambda *args: jax.jit(put.bind)(*args))  # outside a program: a program of its own
    mlir.register_lowering(put, jax.ffi.ffi_lowering("weld_stream_put", has_side_effect=True), platform="cpu")
    return put


def stream_seq() -> int:
    """How many hand-overs have been put into the mailbox (the newest one's sequence number)."""
    return int(_stream_lib.weld_stream_seq())


def stream_taker() -> Callable[..., tuple[int, int, bytes] | None]:
    """take(timeout_s) for the streaming mailbox's reader, bound to the loaded library: on the host
    (releases the GIL while it waits), the oldest hand-over, moved out, as (sequence number, call
    id, bytes), or None after timeout_s."""
    lib = _stream_lib
    call, size = ctypes.c_int32(), ctypes.c_int64()

    def take(timeout_s: float, capacity: int = 1 << 16) -> tuple[int, int, bytes] | None:
        while True:
            buf = ctypes.create_string_buffer(capacity)
            seq = lib.weld_stream_take(int(timeout_s * 1000), ctypes.byref(call), buf, capacity, ctypes.byref(size))
            if seq == 0:
                return None
            if seq > 0:
                return seq, call.value, buf.raw[:size.value]
            capacity = 2 * size.value  # too big for the buffer: it is still queued; take it with room
    return take


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    query_positions: jax.Array, *, scale: float,
                    sliding_window: int | None) -> tuple[jax.Array, jax.Array]:
    """Attention of q [b, t, h, e] over each row's pages of the pools [P, page, kv x e] (f32, f16 or
    bf16, both alike), which already hold the new K/V. Returns (out [b, t, h, e] f32, lse [b, t, h] f32); padding
    queries (position < 0) give 0 and an lse of -1e30, as the jnp path does."""
    b, t, h, e = q.shape
    call = jax.ffi.ffi_call(
        "weld_paged_attention",
        (jax.ShapeDtypeStruct((b, t, h, e), jnp.float32), jax.ShapeDtypeStruct((b, t, h), jnp.float32)),
        vmap_method="sequential")
    return call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
                query_positions.astype(jnp.int32), window=np.int64(sliding_window or 0), scale=np.float32(scale))


def argmax(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the index of the maximum, as jnp.argmax gives it: int32 [...]; whether every value is finite:
    bool [...]) over the last axis of x [..., v] f32 (argmax.cc). Both come from one call, and XLA
    merges the calls of a program that asks for both of the same x."""
    lead, v = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    call = jax.ffi.ffi_call("weld_argmax", (jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct((m,), jnp.int8)),
                            vmap_method="sequential")
    index, finite = call(x.reshape(m, v))
    return index.reshape(lead), finite.reshape(lead).astype(bool)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """RMSNorm of x [m, d] f32 over d, scaled by weight [d] (or 1 + weight): norm.cc, whose rows
    each take the same instructions in the same order whatever the row count (batch invariant).
    Differentiable (the backward pass is XLA's)."""
    call = jax.ffi.ffi_call("weld_rms_norm", jax.ShapeDtypeStruct(x.shape, jnp.float32), vmap_method="sequential")
    return call(x, weight.astype(jnp.float32), eps=np.float32(eps), plus_one=np.int64(plus_one))


def _rms_norm_fwd(x, weight, eps, plus_one):
    return rms_norm(x, weight, eps, plus_one), (x, weight)


def _rms_norm_bwd(eps, plus_one, res, g):
    x, weight = res

    def reference(x, weight):
        w = weight.astype(jnp.float32)
        return (1.0 + w if plus_one else w) * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))

    _, vjp = jax.vjp(reference, x, weight)
    return vjp(g)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def packed_matmul(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [m, k] @ w.T, f32, for w [n, k] packed as panels [ceil(n / 16), k, 16] (matmul.cc;
    weld.models.common.layers.PackedWeight). Differentiable: the backward pass is XLA's (the DSpark
    trainer takes gradients through the target's packed LM head)."""
    call = jax.ffi.ffi_call("weld_packed_matmul", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x, panels)


def _packed_matmul_fwd(x, panels, n):
    return packed_matmul(x, panels, n), (x, panels)


def _packed_matmul_bwd(n, res, g):
    x, panels = res
    num = panels.shape[0]
    g = jnp.pad(g, ((0, 0), (0, num * panels.shape[2] - n))).reshape(g.shape[0], num, panels.shape[2])
    return jnp.einsum("mpj,pkj->mk", g, panels), jnp.einsum("mk,mpj->pkj", x, g)


packed_matmul.defvjp(_packed_matmul_fwd, _packed_matmul_bwd)


def built_with_avx2() -> bool:
    """Whether the loaded library's compile-time paths (attention, packed matmul, norm, argmax) are
    the AVX2 ones, or the portable scalar ones (a CPU without AVX2 + FMA + F16C, or WELD_CPU_MARCH)."""
    if not available():
        raise InvalidInputError("the native CPU kernels are off or unavailable")
    return bool(_state["lib"].weld_cpu_built_with_avx2())


def built_with_avx512() -> bool:
    """Whether the loaded library's attention takes its AVX-512 path (16 lanes; -march with
    AVX-512F) rather than the AVX2 or scalar one."""
    if not available():
        raise InvalidInputError("the native CPU kernels are off or unavailable")
    return bool(_state["lib"].weld_cpu_built_with_avx512())


def supported_isas() -> tuple[str, ...]:
    """The quantized matmul's paths this CPU can run (none when the kernels are off or unbuilt)."""
    if not available():
        return ()
    lib = _state["lib"]
    found = ["scalar"]
    if lib.weld_cpu_has_avx2():
        found.append("avx2")
    if lib.weld_cpu_has_vnni():
        found.append("avx512vnni")
    return tuple(found)


def quant_isa() -> str:
    """The path the quantized matmul takes: the fastest this CPU runs (AVX-512 VNNI, else AVX2,
    else scalar), or WELD_CPU_ISA when set to one of `ISAS` it runs (read when a program is traced)."""
    supported = supported_isas()
    choice = os.environ.get("WELD_CPU_ISA", "auto")
    if not supported:
        raise InvalidInputError("the native CPU kernels are off or unavailable: no quantized matmul path")
    if choice == "auto":
        return supported[-1]
    if choice not in ISAS:
        raise InvalidInputError(f"WELD_CPU_ISA must be auto or one of {', '.join(ISAS)}, got {choice!r}")
    if choice not in supported:
        raise InvalidInputError(f"WELD_CPU_ISA={choice}, but this CPU runs only {', '.join(supported)}")
    return choice


def quant_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, mins: jax.Array | None, n: int, bits: int,
                 offset: float, isa: str | None = None, digits: int = 1, sub: int = 1,
                 lut: np.ndarray | None = None, group: int = 1, chunks: int = STREAM_CHUNKS) -> jax.Array:
    """x [m, k] f32 @ W.T for W [n, k] quantized in blocks of 32 (quant_matmul.cc;
    weld.models.common.layers.QuantWeight): codes u8 [P, nb, 512 | 256], scales and mins f16
    [P, ng, 16 sub] (sub 2: a scale per 16 inputs; group: blocks per scale, a power of two, and
    ng = ceil(nb / group); mins None: w = d (c - offset)); lut: 16 int8
    values that 4-bit codes index (c = 128 + lut[code], offset 128), or None. isa: one of ISAS
    (None: `quant_isa()`). digits: int8 digits per activation (2: the rounding residual quantized
    again and multiplied too). chunks: the pieces each thread's run of panels is claimed in when
    few rows stream the weights (a thread done with its own run takes the back of another's; 1:
    whole runs). Returns y [m, n] f32."""
    isa = quant_isa() if isa is None else isa
    if isa not in supported_isas():
        raise InvalidInputError(f"the quantized matmul's {isa} path does not run on this CPU "
                                f"({', '.join(supported_isas())} do)")
    call = jax.ffi.ffi_call("weld_quant_matmul", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    no_mins = jnp.zeros((0,), jnp.float16)
    table = jnp.zeros((0,), jnp.int8) if lut is None else jnp.asarray(np.asarray(lut, np.int8))
    return call(x.astype(jnp.float32), codes, scales, no_mins if mins is None else mins, table, bits=np.int64(bits),
                offset=np.float32(offset), isa=np.int64(ISAS.index(isa)), digits=np.int64(digits),
                sub=np.int64(sub), group=np.int64(group), chunks=np.int64(chunks))

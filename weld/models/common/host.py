"""Array plumbing for loading weights without compiling programs.

Outside a trace, `jnp.asarray(numpy_array)`, `jnp.concatenate` and `jnp.stack` each compile a
small XLA program per shape. Loading the bundled GGUF compiled 13 of them, for programs never
called again: ~0.3 s of a 2 s load, and ~20 MB that an `LLM` held until JAX's caches were
cleared (`weld serve` clears them after its first compiles: `runner.drop_tracing_caches`). Parts held
in host memory (numpy arrays, or JAX arrays on one CPU device) are joined here with numpy and
placed once; anything else (traced values, accelerator or sharded arrays) goes through jnp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_TRACER = getattr(jax.core, "Tracer", ())  # public in JAX 0.10; () matches nothing if it moves


def _device(xs) -> "jax.Device | None | bool":
    """Where the numpy join goes: the one CPU device committed JAX arrays among xs live on, None
    (the default device, uncommitted, as jnp's result would be) when none is committed, or False
    when the parts must be joined by jnp (traced, on an accelerator, sharded or scattered). A
    committed result where jnp's is not changes the key a later jit call looks its program up by:
    the engine's programs were traced and compiled again after `weld serve` dropped the tracing
    caches (tests/engine/test_llm_tiny.py)."""
    device, committed = None, False
    for x in xs:
        if isinstance(x, np.ndarray):
            continue
        if isinstance(x, _TRACER) or not isinstance(x, jax.Array):
            return False
        devices = x.devices()
        if len(devices) != 1:
            return False
        (d,) = devices
        if d.platform != "cpu" or (device is not None and d != device):
            return False
        device, committed = d, committed or bool(getattr(x, "committed", True))
    return device if committed else None


def asarray(x: np.ndarray | jax.Array) -> jax.Array:
    """x as a JAX array on the default device (uncommitted, as jnp.asarray's); a numpy array by a
    transfer, not a program."""
    return jax.device_put(x) if isinstance(x, np.ndarray) else jnp.asarray(x)


def concatenate(xs: list, axis: int = 0) -> jax.Array:
    """jnp.concatenate(xs, axis), by numpy where every part is in host memory."""
    device = _device(xs)
    if device is False:
        return jnp.concatenate(xs, axis=axis)
    return jax.device_put(np.concatenate([np.asarray(x) for x in xs], axis=axis), device)


def stack(xs: list) -> jax.Array:
    """jnp.stack(xs), by numpy where every part is in host memory."""
    device = _device(xs)
    if device is False:
        return jnp.stack(xs)
    return jax.device_put(np.stack([np.asarray(x) for x in xs]), device)

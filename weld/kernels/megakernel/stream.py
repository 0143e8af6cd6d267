"""The weight stream: a chain of gemvs whose weights flow HBM -> VMEM ring -> MXU, tile by tile.

Covers: y_0 = x, y_{i+1} = y_i @ W_i^T for a list of matrices W_i [N_i, K_i] (K_{i+1} = N_i),
a batch of B rows, any float weight dtype (accumulation in f32). This is the skeleton of the
megakernel's weight traffic: one `pallas_call` with no grid; the weights stay in HBM
(`memory_space=pl.ANY`); a static schedule of row tiles (`plan.row_tiles`) is copied by
`pltpu.make_async_copy` into a ring of `ring_depth` VMEM slots, one DMA semaphore per slot.
While tile n computes, tiles n+1 .. n+depth-1 are in flight, across matrix boundaries: the
first tiles of W_{i+1} are already moving while the last tile of W_i computes.

The schedule is unrolled in Python (every tile's shape is static). `stream_chain_reference`
is the pure-jnp twin.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from weld.kernels.megakernel.plan import row_tiles

_BUGS = (None, "skip_wait", "wrong_slot")  # planted bugs, for the tests that prove the harness


def stream_chain_reference(x: jax.Array, weights: list[jax.Array]) -> jax.Array:
    """x [B, K_0]; weights[i] [N_i, K_i]. Returns y [B, N_last] in f32."""
    y = x.astype(jnp.float32)
    for w in weights:
        y = jnp.dot(y, w.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    return y


def _validate(x, weights, tile_rows, ring_depth):
    if x.ndim != 2:
        raise ValueError(f"x must be [B, K], got shape {x.shape}")
    if not weights:
        raise ValueError("stream_chain needs at least one weight matrix")
    if ring_depth < 2:
        raise ValueError(f"ring_depth must be >= 2 (one slot computing, one in flight), got {ring_depth}")
    if tile_rows <= 0:
        raise ValueError(f"tile_rows must be positive, got {tile_rows}")
    width = x.shape[1]
    for i, w in enumerate(weights):
        if w.ndim != 2 or w.shape[1] != width:
            raise ValueError(f"weights[{i}] must be [N, {width}] (its input is the previous output), got {w.shape}")
        if w.dtype != weights[0].dtype:
            raise ValueError(f"weights[{i}] dtype {w.dtype} differs from weights[0] dtype {weights[0].dtype}")
        width = w.shape[0]


def stream_chain(x: jax.Array, weights: list[jax.Array], *, tile_rows: int = 256, ring_depth: int = 3,
                 interpret=False, _bug: str | None = None) -> jax.Array:
    """The chain x @ W_0^T @ W_1^T ... as one Pallas TPU call streaming weight tiles.

    x [B, K_0] (f32); weights[i] [N_i, K_i] in HBM. Returns [B, N_last] f32.
    `interpret`: False on a TPU; a `pltpu.InterpretParams` to run on CPU.
    `_bug` plants a DMA bug (tests only): "skip_wait" computes tile n without waiting for its
    copy; "wrong_slot" computes from the slot after tile n's.
    """
    _validate(x, weights, tile_rows, ring_depth)
    if _bug not in _BUGS:
        raise ValueError(f"_bug must be one of {_BUGS}, got {_bug!r}")
    batch = x.shape[0]
    # Static schedule: (matrix index, first row, rows) per tile, in stream order.
    schedule = [(m, start, n) for m, w in enumerate(weights) for start, n in row_tiles(w.shape[0], tile_rows)]
    max_rows = max(n for _, _, n in schedule)
    max_cols = max(w.shape[1] for w in weights)
    max_width = max([x.shape[1]] + [w.shape[0] for w in weights])
    n_out = weights[-1].shape[0]

    def kernel(*refs):
        x_ref = refs[0]  # [B, K_0] VMEM
        w_refs = refs[1:1 + len(weights)]  # [N_i, K_i] each, HBM
        out_ref = refs[1 + len(weights)]  # [B, N_last] VMEM
        ring, sems, acts = refs[2 + len(weights):]  # see scratch_shapes

        def copy(t):
            m, start, n = schedule[t]
            slot = t % ring_depth
            return pltpu.make_async_copy(w_refs[m].at[pl.ds(start, n)],
                                         ring.at[slot, pl.ds(0, n), pl.ds(0, weights[m].shape[1])],
                                         sems.at[slot])

        acts[0, :, : x.shape[1]] = x_ref[...].astype(jnp.float32)
        for t in range(min(ring_depth - 1, len(schedule))):  # prologue: fill all but one slot
            copy(t).start()
        for t, (m, start, n) in enumerate(schedule):
            ahead = t + ring_depth - 1
            if ahead < len(schedule):  # its slot held tile t-1, which has finished computing
                copy(ahead).start()
            if _bug != "skip_wait":
                copy(t).wait()
            slot = (t + 1) % ring_depth if _bug == "wrong_slot" else t % ring_depth
            k = weights[m].shape[1]
            w_tile = ring[slot, :n, :k]  # [n, k]
            y_in = acts[m % 2, :, :k]  # [B, k]: the previous matrix's output
            y = jax.lax.dot_general(y_in.astype(w_tile.dtype), w_tile, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)  # [B, n]
            acts[(m + 1) % 2, :, pl.ds(start, n)] = y
        if _bug == "skip_wait":  # drain the semaphores so the kernel still ends cleanly
            for t in range(len(schedule)):
                copy(t).wait()
        out_ref[...] = acts[len(weights) % 2, :, :n_out]

    scratch = [
        pltpu.VMEM((ring_depth, max_rows, max_cols), weights[0].dtype),  # the weight ring
        pltpu.SemaphoreType.DMA((ring_depth,)),  # one DMA semaphore per ring slot
        pltpu.VMEM((2, batch, max_width), jnp.float32),  # activations: input / output of the current gemv
    ]
    vmem = pltpu.MemorySpace.VMEM
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, n_out), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=vmem)] + [pl.BlockSpec(memory_space=pl.ANY)] * len(weights),
        out_specs=pl.BlockSpec(memory_space=vmem),
        scratch_shapes=scratch,
        interpret=interpret,
    )(x.astype(jnp.float32), *weights)

"""In-kernel collectives for the megakernel by remote DMA: the all-reduce of a tensor-parallel
layer's partial outputs (the attention's o-projection, the MLP's down projection) and of an
expert-parallel layer's expert outputs (the combine), without leaving the Pallas call.

A decode step's activations are small ([N, d] with N the call's tokens), so the reduction is
latency-bound: every device sends its partial to every other device in one round (n - 1 remote
DMAs in flight at once, each into the sender's own slot of the receiver's buffer, so no slot is
written twice) and sums the n partials locally, in device order: every device computes the same
sum in the same order, so the replicas stay bit-identical (a ring would take n - 1 dependent
rounds and sum in a different order on each device).

Before the first DMA the devices meet at a barrier (each signals every peer's barrier semaphore
and waits for n - 1 signals): a remote DMA may only write a peer's VMEM once the peer is inside
the kernel. The call must name a `collective_id` (`pltpu.CompilerParams`) on a TPU.

`all_reduce_rows` is the loop the megakernel calls inside its own kernel; `all_reduce` runs it
as a Pallas call of its own (under `jax.shard_map` over `axis`), for the tests: in TPU interpret
mode on virtual CPU devices, against `jax.lax.psum`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# planted bugs, for the tests (a missing barrier is not among them: in interpret mode every device
# enters the kernel at once, so it cannot show; only a TPU can)
BUGS = (None, "skip_recv_wait", "same_slot")


def all_reduce_scratch(rows: int, cols: int, devices: int, dtype=jnp.float32) -> list:
    """The scratch `all_reduce_rows` needs, in its argument order: one receive slot per device,
    and a send and a receive DMA semaphore per peer."""
    return [pltpu.VMEM((devices, rows, cols), dtype), pltpu.SemaphoreType.DMA((devices,)),
            pltpu.SemaphoreType.DMA((devices,))]


def all_reduce_rows(x_ref, out_ref, slots, send_sems, recv_sems, *, axis: str, devices: int,
                    bug: str | None = None) -> None:
    """out_ref = the sum over the `axis` devices of their x_ref ([rows, cols] VMEM), inside a
    Pallas TPU kernel; slots, send_sems, recv_sems: `all_reduce_scratch(...)`."""
    me = jax.lax.axis_index(axis)
    peers = [(me + step) % devices for step in range(1, devices)]
    barrier = pltpu.get_barrier_semaphore()
    for peer in peers:
        pl.semaphore_signal(barrier, 1, device_id={axis: peer}, device_id_type=pltpu.DeviceIdType.MESH)
    pl.semaphore_wait(barrier, devices - 1)
    # my partial goes into slot `me` on every peer; the receive semaphore of that slot counts it
    sends = [pltpu.make_async_remote_copy(x_ref, slots.at[peer if bug == "same_slot" else me], send_sems.at[peer],
                                          recv_sems.at[me], device_id={axis: peer},
                                          device_id_type=pltpu.DeviceIdType.MESH) for peer in peers]
    for copy in sends:
        copy.start()
    slots[me] = x_ref[...]  # my own slot, locally
    for copy in sends:
        copy.wait_send()
    if bug != "skip_recv_wait":
        for peer in peers:  # what peer sent me landed in slot `peer` (same shape as mine)
            pltpu.make_async_remote_copy(x_ref, slots.at[peer], send_sems.at[peer], recv_sems.at[peer],
                                         device_id={axis: peer}, device_id_type=pltpu.DeviceIdType.MESH).wait_recv()
    total = slots[0]
    for j in range(1, devices):  # in device order, the same on every device
        total = total + slots[j]
    out_ref[...] = total.astype(out_ref.dtype)


def all_reduce(x: jax.Array, *, axis: str, devices: int, interpret=False, collective_id: int = 0,
               _bug: str | None = None) -> jax.Array:
    """The sum of x [rows, cols] over the `axis` devices, as one Pallas call (call it inside
    `jax.shard_map`); `interpret`: a `pltpu.InterpretParams` off a TPU."""
    if _bug not in BUGS:
        raise ValueError(f"_bug must be one of {BUGS}, got {_bug!r}")
    if x.ndim != 2:
        raise ValueError(f"x must be [rows, cols], got shape {x.shape}")
    rows, cols = x.shape

    def kernel(x_ref, out_ref, *scratch):
        all_reduce_rows(x_ref, out_ref, *scratch, axis=axis, devices=devices, bug=_bug)

    vmem = pltpu.MemorySpace.VMEM
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=vmem)], out_specs=pl.BlockSpec(memory_space=vmem),
        scratch_shapes=all_reduce_scratch(rows, cols, devices, x.dtype),
        compiler_params=pltpu.CompilerParams(collective_id=collective_id),
        interpret=interpret,
    )(x)

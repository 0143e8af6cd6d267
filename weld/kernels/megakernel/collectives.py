"""In-kernel collectives for the megakernel by remote DMA: the all-reduce of a tensor-parallel
layer's partial outputs (the attention's o-projection, the MLP's down projection) and of an
expert-parallel layer's expert outputs (the combine), without leaving the Pallas call.

Two algorithms, by device count (`chunked`):
- **one round** (2 devices): every device sends its whole partial to every other device (n - 1
  remote DMAs in flight at once, each into the sender's own slot of the receiver's buffer, so no
  slot is written twice) and sums the n partials locally, in device order;
- **reduce-scatter, then all-gather** (more than 2 devices): the columns split into n chunks
  (padded to whole 128-lane tiles: `padded_cols`); device p receives chunk p of every peer's
  partial, sums them in device order, and sends that sum to every peer. Each device sends
  2 (n - 1) / n of a partial instead of n - 1 partials: at Kimi K2's 32 devices ~2 instead of 31.
Either way every element is summed in device order by exactly one rule, so every device holds
the same bits, and both algorithms give the same bits.

Before the first DMA the devices meet at a barrier (each signals every peer's barrier semaphore
and waits for n - 1 signals): a remote DMA may only write a peer's VMEM once the peer is inside
the kernel, and past the barrier every peer has finished reading the buffers of the previous
all-reduce. The call must name a `collective_id` (`pltpu.CompilerParams`) on a TPU.

`all_reduce_rows` is the loop the megakernel calls inside its own kernel; `all_reduce` runs it
as a Pallas call of its own (under `jax.shard_map` over `axis`), for the tests: in TPU interpret
mode on virtual CPU devices, against `jax.lax.psum`. `sent_bytes` is what one device sends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# planted bugs, for the tests (a missing barrier is not among them: in interpret mode every device
# enters the kernel at once, so it cannot show; only a TPU can)
BUGS = (None, "skip_recv_wait", "same_slot", "skip_gather_wait")
LANES = 128  # a chunk of the reduce-scatter is whole lane tiles


def chunked(devices: int) -> bool:
    """Whether the all-reduce over `devices` runs as reduce-scatter + all-gather (else one round)."""
    return devices > 2


def padded_cols(cols: int, devices: int) -> int:
    """The columns of the reduce-scatter's staging buffer: devices chunks of whole lane tiles."""
    chunk = -(-cols // (devices * LANES)) * LANES
    return chunk * devices


def sent_bytes(rows: int, cols: int, devices: int, itemsize: int = 4) -> int:
    """Bytes one device sends over ICI in one all-reduce of [rows, cols] over `devices`."""
    if devices == 1:
        return 0
    if chunked(devices):
        return 2 * (devices - 1) * rows * (padded_cols(cols, devices) // devices) * itemsize
    return (devices - 1) * rows * cols * itemsize


def all_reduce_scratch(rows: int, cols: int, devices: int, dtype=jnp.float32) -> list:
    """The scratch `all_reduce_rows` needs, in its argument order: one receive slot per device
    (of a whole partial, or of one chunk), a send and a receive DMA semaphore per peer, and for
    the reduce-scatter the padded staging buffers (the partial, the gathered sum) and the
    all-gather's semaphores."""
    if not chunked(devices):
        return [pltpu.VMEM((devices, rows, cols), dtype), pltpu.SemaphoreType.DMA((devices,)),
                pltpu.SemaphoreType.DMA((devices,))]
    cp = padded_cols(cols, devices)
    return [pltpu.VMEM((devices, rows, cp // devices), dtype), pltpu.SemaphoreType.DMA((devices,)),
            pltpu.SemaphoreType.DMA((devices,)), pltpu.VMEM((rows, cp), dtype), pltpu.VMEM((rows, cp), dtype),
            pltpu.SemaphoreType.DMA((devices,)), pltpu.SemaphoreType.DMA((devices,))]


def barrier(axis, devices, semaphore=None) -> None:
    """Every device of `axis` signals every peer and waits for them all (`semaphore`: a REGULAR
    semaphore of the kernel's scratch, once every device is inside the kernel; None: the
    kernel's barrier semaphore)."""
    me = jax.lax.axis_index(axis)
    _barrier(axis, devices, [(me + step) % devices for step in range(1, devices)], semaphore)


def _barrier(axis, devices, peers, semaphore=None):
    barrier = pltpu.get_barrier_semaphore() if semaphore is None else semaphore
    for peer in peers:
        pl.semaphore_signal(barrier, 1, device_id={axis: peer}, device_id_type=pltpu.DeviceIdType.MESH)
    pl.semaphore_wait(barrier, devices - 1)


def _remote(src, dst, send_sem, recv_sem, axis, peer):
    return pltpu.make_async_remote_copy(src, dst, send_sem, recv_sem, device_id={axis: peer},
                                        device_id_type=pltpu.DeviceIdType.MESH)


def all_reduce_rows(x_ref, out_ref, *scratch, axis: str, devices: int, barrier_semaphore=None,
                    bug: str | None = None) -> None:
    """out_ref = the sum over the `axis` devices of their x_ref ([rows, cols] VMEM), inside a
    Pallas TPU kernel; scratch: `all_reduce_scratch(...)`. A kernel whose collectives run over
    different groups of devices gives each group its own `barrier_semaphore` (a REGULAR one,
    after a `barrier` of every device on the kernel's own): the groups' signals would otherwise
    count towards each other's barriers."""
    me = jax.lax.axis_index(axis)
    peers = [(me + step) % devices for step in range(1, devices)]
    _barrier(axis, devices, peers, barrier_semaphore)
    if chunked(devices):
        _reduce_scatter_gather(x_ref, out_ref, *scratch, axis=axis, devices=devices, me=me, peers=peers, bug=bug)
        return
    out_ref[...] = _sum_from_peers(lambda peer: x_ref, *scratch, axis=axis, devices=devices, me=me, peers=peers,
                                   bug=bug).astype(out_ref.dtype)


def _sum_from_peers(part, slots, send_sems, recv_sems, *, axis, devices, me, peers, bug):
    """The sum, in device order (the same on every device), of every device's part(me): each
    device sends part(peer) into slot `me` of each peer (so no slot is written twice; the receive
    semaphore of that slot counts it) and keeps part(me) in its own."""
    sends = [_remote(part(peer), slots.at[peer if bug == "same_slot" else me], send_sems.at[peer], recv_sems.at[me],
                     axis, peer) for peer in peers]
    for copy in sends:
        copy.start()
    slots[me] = part(me)[...]
    for copy in sends:
        copy.wait_send()
    if bug != "skip_recv_wait":
        for peer in peers:  # what peer sent me landed in slot `peer` (the shape of mine)
            _remote(part(peer), slots.at[peer], send_sems.at[peer], recv_sems.at[peer], axis, peer).wait_recv()
    total = slots[0]
    for j in range(1, devices):
        total = total + slots[j]
    return total


def _reduce_scatter_gather(x_ref, out_ref, slots, send_sems, recv_sems, stage, gathered, gather_send, gather_recv, *,
                           axis, devices, me, peers, bug):
    rows, cols = x_ref.shape
    width = stage.shape[1] // devices  # one chunk's columns

    def chunk(ref, owner):  # the columns of device `owner`'s chunk
        return ref.at[:, pl.ds(pl.multiple_of(owner * width, LANES), width)]

    stage[:, :cols] = x_ref[...].astype(stage.dtype)
    if stage.shape[1] > cols:
        stage[:, cols:] = jnp.zeros((rows, stage.shape[1] - cols), stage.dtype)
    # reduce-scatter: my partial's chunk p goes to peer p, who sums chunk p in device order (the
    # same sum the one-round algorithm makes)
    chunk(gathered, me)[...] = _sum_from_peers(lambda peer: chunk(stage, peer), slots, send_sems, recv_sems, axis=axis,
                                               devices=devices, me=me, peers=peers, bug=bug)
    # all-gather: my chunk's sum into the same columns of every peer's gathered buffer
    sends = [_remote(chunk(gathered, me), chunk(gathered, me), gather_send.at[peer], gather_recv.at[me], axis, peer)
             for peer in peers]
    for copy in sends:
        copy.start()
    for copy in sends:
        copy.wait_send()
    if bug != "skip_gather_wait":
        for peer in peers:
            _remote(chunk(gathered, peer), chunk(gathered, peer), gather_send.at[peer], gather_recv.at[peer], axis,
                    peer).wait_recv()
    out_ref[...] = gathered[:, :cols].astype(out_ref.dtype)


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

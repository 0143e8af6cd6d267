"""Linear attention for the megakernel: the gated delta rule (Gated DeltaNet, Kimi Delta Attention)
over each sequence's recurrent state, inside the whole-model kernel.

Each sequence owns a state slot in two HBM pools per linear layer, aliased input -> output so
the kernel updates them in place: the short causal conv's window (its last K - 1 inputs, oldest
first) and the delta rule's state [slots, Hv, dk, dv], both f32 (the engine's
`cache.RecurrentState`). The engine's windows are [slots, C, K - 1]; the kernel takes them as
[K - 1, slots, C] (`decode.decode_step` transposes), which is how XLA lays them out on a TPU
(the window's positions major, the channels in the lanes): a bitcast there, where a [slots, C,
K - 1] operand made XLA relayout every window pool in and out of each call. Per linear layer
the kernel

  1. starts row 0's state read (HBM -> VMEM) as the layer begins, so it lands while the input
     projections stream through the weight ring;
  2. computes the log-decays and betas of all N tokens (`log_decay`);
  3. runs `recur_rows`: for each row b (a `fori_loop`), row b + 1's state is read into the
     other of two VMEM buffers while row b computes, after that buffer's previous write-back
     (row b - 1's) has landed; row b's T tokens go through the conv and the delta rule one after
     another (T = 1 for decode, k + 1 for a verify block), and its new state is written back
     to its slot by DMA;
  4. applies the gated RMSNorm (`gated_output`) before the output projection.

A row whose first position is 0 starts from a zero state (a fresh sequence) without reading;
a padding row (first position -1) reads and writes nothing and outputs zeros; a padding token
inside a live row has beta = g = 0 and leaves the state as it was; a row without a slot (-1)
computes from zeros and writes nothing. Slots come from the `state_slots` scalar-prefetch
operand (SMEM).

The pure-jnp twin is `weld.models.common.linear_attention` (`delta_net_layer`,
`delta_rule_recurrent`); the tests compare the whole kernel with the families' XLA forward.
Per token t and value head h, with q and k L2-normalised (q scaled by dk^-1/2):

    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

L2_EPS = 1e-6  # of the q / k L2 norms (FLA's and transformers')
BUGS = (None, "stale_state", "skip_state_wait")  # planted bugs, for the tests

# the scratch `linear_scratch` returns, in order (what `recur_rows` and the kernel index by name)
SCRATCH = ("qkv", "gate", "decay", "beta", "out", "fa", "ga", "conv", "conv_sem", "state", "window", "read_sems",
           "write_sems")


def linear_scratch(spec, conv_dtype) -> list:
    """VMEM and semaphores for the linear layers, in `SCRATCH` order. Per token (N rows), f32:
    the conv's input [q | k | v], the output gate, the log-decays, beta, the output (and KDA's
    two low-rank inputs, else 1-wide stand-ins); the layer's conv weights; two rows' states."""
    n, f32 = spec.tokens, jnp.float32
    vd, dk = spec.linear_value_dim, spec.linear_k_dim
    low = dk if spec.linear_kind == "kda" else 1
    c, k = spec.conv_channels, spec.conv_width
    return [
        pltpu.VMEM((n, c), f32),  # the conv's input, then (per row, in place) nothing else
        pltpu.VMEM((n, vd), f32),  # the output gate's pre-activation
        pltpu.VMEM((n, spec.decay_width), f32),  # a / f as projected, then the log-decays g
        pltpu.VMEM((n, spec.linear_v_heads), f32),  # b as projected, then beta = sigmoid(b)
        pltpu.VMEM((n, vd), f32),  # the delta rule's output o
        pltpu.VMEM((n, low), f32),  # KDA: the decay's low-rank input
        pltpu.VMEM((n, low), f32),  # KDA: the output gate's low-rank input
        pltpu.VMEM((c, k), conv_dtype),  # the layer's conv weights, read whole
        pltpu.SemaphoreType.DMA((1,)),
        pltpu.VMEM((2, spec.linear_v_heads, dk, spec.linear_v_dim), f32),  # two rows' delta-rule states
        pltpu.VMEM((2, k - 1, c), f32),  # and their conv windows
        pltpu.SemaphoreType.DMA((2, 2)),  # [state or window, buffer]: reads
        pltpu.SemaphoreType.DMA((2, 2)),  # writes
    ]


def log_decay(spec, projected, a_log, dt_bias):
    """The log-decays g <= 0 of all tokens. GDN: projected a [N, Hv], g = -exp(A_log) softplus(a +
    dt_bias), one per value head. KDA: projected f [N, Hv dk] (the low-rank pair's output), g =
    -exp(A_log[h]) softplus(f + dt_bias), or lb sigmoid(exp(A_log[h]) (f + dt_bias)) with the
    gate lower bound lb, one per head and key channel. a_log [1, Hv], dt_bias [1, width]."""
    rate = jnp.exp(a_log)  # [1, Hv]
    x = projected + dt_bias
    if spec.linear_kind == "gdn":
        return -rate * jax.nn.softplus(x)
    n, hv, dk = x.shape[0], spec.linear_v_heads, spec.linear_k_dim
    x, rate = x.reshape(n, hv, dk), rate.reshape(1, hv, 1)
    g = spec.gate_lower_bound * jax.nn.sigmoid(rate * x) if spec.gate_lower_bound else -rate * jax.nn.softplus(x)
    return g.reshape(n, hv * dk)


def gated_output(spec, o, gate, weight):
    """weight * RMSNorm(o) * activation(gate) per value head (GDN: silu, KDA: sigmoid); o and
    gate [N, Hv dv], weight [1, dv]. Returns [N, Hv dv]."""
    n, hv, dv = o.shape[0], spec.linear_v_heads, spec.linear_v_dim
    o = o.reshape(n, hv, dv)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + spec.linear_norm_eps)
    act = jax.nn.silu if spec.linear_kind == "gdn" else jax.nn.sigmoid
    return (weight.reshape(1, 1, dv) * o * act(gate.reshape(n, hv, dv))).reshape(n, hv * dv)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _state_copies(slot_ref, bufs, window_pool, state_pool, row, buf, sems):
    """The two DMAs between row's slot in the pools and VMEM buffer `buf` (reads: pool -> buffer;
    the same descriptors' `src`/`dst` swapped for writes by `_write_copies`)."""
    slot = slot_ref[row]
    return [pltpu.make_async_copy(state_pool.at[slot], bufs["state"].at[buf], sems.at[0, buf]),
            pltpu.make_async_copy(window_pool.at[:, slot], bufs["window"].at[buf], sems.at[1, buf])]


def _write_copies(slot_ref, bufs, window_pool, state_pool, row, buf):
    slot = slot_ref[row]
    sems = bufs["write_sems"]
    return [pltpu.make_async_copy(bufs["state"].at[buf], state_pool.at[slot], sems.at[0, buf]),
            pltpu.make_async_copy(bufs["window"].at[buf], window_pool.at[:, slot], sems.at[1, buf])]


def _continues(pos_ref, slot_ref, row, tokens):
    """Row reads its slot: it continues a sequence (first position > 0) and has a slot."""
    return jnp.logical_and(pos_ref[row * tokens] > 0, slot_ref[row] >= 0)


def _writes(pos_ref, slot_ref, row, tokens):
    """Row writes its slot back: it is live (first position >= 0) and has a slot."""
    return jnp.logical_and(pos_ref[row * tokens] >= 0, slot_ref[row] >= 0)


def start_first_read(spec, pos_ref, slot_ref, bufs, window_pool, state_pool):
    """Starts row 0's state read into buffer 0 (the layer's first step, before its projections)."""
    @pl.when(_continues(pos_ref, slot_ref, 0, spec.tokens_per_row))
    def _():
        for c in _state_copies(slot_ref, bufs, window_pool, state_pool, 0, 0, bufs["read_sems"]):
            c.start()


def recur_rows(spec, pos_ref, slot_ref, bufs, window_pool, state_pool, *, bug: str | None = None):
    """The conv and the delta rule for every row (see the module docstring), called inside the
    kernel after `start_first_read` and once bufs["decay"] / bufs["beta"] hold g and beta:
    writes o into bufs["out"] (zeros for padding rows) and each live row's new state to its slot."""
    rows, t = spec.batch, spec.tokens_per_row
    hk, hv, dk, dv = spec.linear_k_heads, spec.linear_v_heads, spec.linear_k_dim, spec.linear_v_dim
    kd, width = spec.linear_key_dim, spec.conv_width
    r = hv // hk
    per_channel = spec.linear_kind == "kda"
    bufs["out"][...] = jnp.zeros(bufs["out"].shape, jnp.float32)

    def share(x):  # [T, Hk, dk] -> [T, Hv, dk]: each key head serves r value heads
        if r == 1:
            return x
        return jnp.tile(x, (1, r, 1)) if spec.tiled_v_heads else jnp.repeat(x, r, axis=1)

    def row_body(row, _):
        buf = row % 2
        first = row * t

        @pl.when(row + 1 < rows)
        def _prefetch():  # the next row's state into the other buffer, once its last write landed
            @pl.when(jnp.logical_and(row >= 1, _writes(pos_ref, slot_ref, jnp.maximum(row - 1, 0), t)))
            def _():
                for c in _write_copies(slot_ref, bufs, window_pool, state_pool, jnp.maximum(row - 1, 0), 1 - buf):
                    c.wait()

            @pl.when(_continues(pos_ref, slot_ref, row + 1, t))
            def _():
                for c in _state_copies(slot_ref, bufs, window_pool, state_pool, row + 1, 1 - buf, bufs["read_sems"]):
                    c.start()

        continues = _continues(pos_ref, slot_ref, row, t)
        if bug != "skip_state_wait":
            @pl.when(continues)
            def _():
                for c in _state_copies(slot_ref, bufs, window_pool, state_pool, row, buf, bufs["read_sems"]):
                    c.wait()

        @pl.when(pos_ref[first] >= 0)
        def _live():
            valid = [pos_ref[first + j] >= 0 for j in range(t)]
            n_valid = sum(v.astype(jnp.int32) for v in valid)
            state = jnp.where(continues, bufs["state"][buf], 0.0)  # [Hv, dk, dv]
            window = jnp.where(continues, bufs["window"][buf], 0.0)  # [K - 1, C]
            x = bufs["qkv"][pl.ds(first, t)]  # [T, C]
            w = bufs["conv"][...].astype(jnp.float32)  # [C, K]
            ext = jnp.concatenate([window, x], axis=0)  # [K - 1 + T, C]: the causal conv's inputs
            mixed = jax.nn.silu(sum(ext[j:j + t] * w[:, j][None] for j in range(width)))  # [T, C]
            q = share(_l2norm(mixed[:, :kd].reshape(t, hk, dk)) * dk ** -0.5)
            k = share(_l2norm(mixed[:, kd:2 * kd].reshape(t, hk, dk)))
            v = mixed[:, 2 * kd:].reshape(t, hv, dv)
            decay = bufs["decay"][pl.ds(first, t)]  # [T, Hv] or [T, Hv dk]
            if per_channel:  # split by head on the whole block, as k is (Mosaic casts no lone row to 3-D)
                decay = decay.reshape(t, hv, dk)
            beta = bufs["beta"][pl.ds(first, t)]  # [T, Hv]
            outs = []
            for j in range(t):
                g = jnp.where(valid[j], decay[j], 0.0)
                b = jnp.where(valid[j], beta[j], 0.0)  # [Hv]
                state = state * (jnp.exp(g)[:, :, None] if per_channel else jnp.exp(g).reshape(hv, 1, 1))
                recalled = jnp.einsum("hkv,hk->hv", state, k[j], precision=jax.lax.Precision.HIGHEST)
                delta = (v[j] - recalled) * b[:, None]
                state = state + k[j][:, :, None] * delta[:, None, :]
                outs.append(jnp.einsum("hkv,hk->hv", state, q[j], precision=jax.lax.Precision.HIGHEST))
            bufs["out"][pl.ds(first, t)] = jnp.stack(outs).reshape(t, hv * dv)
            new_window = ext[0:width - 1]  # the last K - 1 inputs up to the row's last valid token
            for n in range(1, t + 1):
                new_window = jnp.where(n_valid == n, ext[n:n + width - 1], new_window)
            bufs["state"][buf] = state
            bufs["window"][buf] = new_window

        if bug != "stale_state":
            @pl.when(_writes(pos_ref, slot_ref, row, t))
            def _():
                for c in _write_copies(slot_ref, bufs, window_pool, state_pool, row, buf):
                    c.start()
        return None

    jax.lax.fori_loop(0, rows, row_body, None)
    if bug != "stale_state":  # the last two rows' writes were not waited for inside the loop
        for row in range(max(rows - 2, 0), rows):
            @pl.when(_writes(pos_ref, slot_ref, row, t))
            def _():
                for c in _write_copies(slot_ref, bufs, window_pool, state_pool, row, row % 2):
                    c.wait()
    if bug == "skip_state_wait":  # drain the reads that were never waited for
        for row in range(rows):
            @pl.when(_continues(pos_ref, slot_ref, row, t))
            def _():
                for c in _state_copies(slot_ref, bufs, window_pool, state_pool, row, row % 2, bufs["read_sems"]):
                    c.wait()

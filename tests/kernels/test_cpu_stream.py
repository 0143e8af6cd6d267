"""The streaming mailbox's put (`weld.kernels.cpu.stream_put`) inside a device loop: it adds no
JAX effect, so a program holding it still runs through jit's C++ dispatch (a program with an
effect goes through Python on every call: ~10 ms for a model's ~500 weight arrays on a 2-core
CPU), and every hand-over of a loop that returns its last id reaches the host in order (one
that drops the id loses them: JAX prunes a pure loop's dead carry)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from weld.engine import streaming
from weld.kernels import cpu


def _loop(x, call_id):
    def body(i, carry):
        x, stream = carry
        x = x + 1
        return x, cpu.stream_put(stream, x)  # each put takes the id the last one returned
    return jax.lax.fori_loop(0, 3, body, (x, call_id))  # the last id among the outputs, as the programs keep it


def test_every_put_of_a_loop_reaches_the_host_in_order():
    assert cpu.available(), cpu._state.get("error")
    got = []
    call_id = streaming.HANDOVERS.open([((4,), np.dtype(np.int32))], lambda arrays: got.append(arrays[0].tolist()),
                                       native=True)
    try:
        out, _ = jax.jit(_loop)(jnp.zeros(4, jnp.int32), jnp.int32(call_id))
        out.block_until_ready()
    finally:
        streaming.HANDOVERS.close(call_id)
    assert out.tolist() == [3] * 4
    assert got == [[1] * 4, [2] * 4, [3] * 4]  # in order, none merged away or pruned


def test_the_put_adds_no_effect():
    assert cpu.available(), cpu._state.get("error")
    jaxpr = jax.make_jaxpr(_loop)(jnp.zeros(4, jnp.int32), jnp.int32(1))
    assert "weld_stream_put" in str(jaxpr)
    assert not jaxpr.effects

"""`rounded`: a value as stored, so that XLA cannot fuse the product that made it into a
following addition.

XLA:CPU contracts a * b + c into one fused multiply-add when both sit in one fusion, and rounds
a * b first when they do not; which happens depends on the program around them (its row count,
its layouts, what else it fuses), so a row's value could depend on its batch by an ulp. Under int8
activation quantization (the GGUF kernels) such an ulp flips roundings downstream, and a greedy
request's tokens depended on what else the server ran. Where the model adds products elementwise
(the rotary rotation x cos + x' sin, a dequantized embedding d c + m) each product goes through
`rounded` first: one rounding, in every program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A NaN's bit pattern: the only input `rounded` changes (to another NaN, its lowest bit flipped).
_WITNESS = 0x7FC0_0001


@jax.custom_jvp
def rounded(x: jax.Array) -> jax.Array:
    """x (f32), unchanged except one NaN pattern for another, through an integer xor whose operand
    depends on x at run time: no compiler can see through it, so x is materialized as a rounded
    f32 and never contracted into the operation that consumes it. Differentiable as the identity
    (the bit casts alone would give a zero gradient: the DSpark trainer differentiates the rotary
    rotation)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    bits = bits ^ (bits == _WITNESS).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@rounded.defjvp
def _rounded_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return rounded(x), t.astype(jnp.float32)

"""The megakernel lowers to Mosaic, the TPU kernel dialect, on this machine (no TPU): Pallas
interpret mode runs any jnp inside a kernel, so only lowering shows an op Mosaic has no rule for
(it found `lax.top_k` in the router and strided slices in DeepSeek's interleaved RoPE).
Every covered family's kernel, with its switches, at a batch with several rows and in a verify
block; abstract weights (`megakernel.lower_for_tpu`): nothing is allocated. Mosaic's own passes
run only on a TPU (benchmarks/megakernel_lowering.py says what this does not cover)."""

from __future__ import annotations

import pytest
from test_megakernel_decode import GEMMA, LLAMA, MISTRAL, QWEN
from test_megakernel_linear import KIMI, NEXT
from test_megakernel_mla import V3
from test_megakernel_moe import GPT_OSS, GROUPED, QWEN_MOE

from weld.models import megakernel


@pytest.mark.parametrize("cfg", [LLAMA, QWEN, QWEN_MOE, GROUPED, V3, NEXT, KIMI, GEMMA, MISTRAL, GPT_OSS],
                         ids=["llama", "qwen-biases-tied", "qwen3_moe", "grouped-routing", "deepseek_v3", "qwen3_next",
                              "kimi_linear", "gemma3", "mistral-sliding", "gpt_oss"])
@pytest.mark.parametrize("generation", ["v6e", "v7"])
def test_every_family_lowers_to_mosaic(cfg, generation):
    text = megakernel.lower_for_tpu(cfg, batch=4, generation=generation)
    assert "tpu_custom_call" in text  # the kernel became a Mosaic module, not an interpreted loop


def test_an_op_without_a_mosaic_rule_is_reported():
    """The check can fail: a kernel that calls `lax.top_k` (as the router did) does not lower."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.top_k(x_ref[...], 2)[0]

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 2), jnp.float32))
    with pytest.raises(NotImplementedError, match="top_k"):
        jax.jit(call).trace(jax.ShapeDtypeStruct((8, 128), jnp.float32)).lower(lowering_platforms=("tpu",))
    megakernel.lower_for_tpu(LLAMA, batch=1)  # the control: the real kernel lowers

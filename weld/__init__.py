"""weld: an LLM inference engine for JAX.

Public API (vLLM's shapes): `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`.
Imported lazily, so `import weld.engine.scheduler` (pure Python) does not pull in jax.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    if name == "LLM":
        from weld.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from weld.engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from weld.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'weld' has no attribute {name!r}")

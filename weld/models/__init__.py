"""Model families. Each is one module with `Config`, `weight_specs`, `forward`."""

from __future__ import annotations

from types import ModuleType

from weld.models import llama

FAMILIES: dict[str, ModuleType] = {"llama": llama}


def family_for_hf(config: dict) -> ModuleType:
    """The family module that implements a HF config.json (raises ValueError if none does)."""
    archs = config.get("architectures") or []
    if any(a in llama.HF_ARCHITECTURES for a in archs) or config.get("model_type") in llama.GGUF_ARCHITECTURES:
        return llama
    raise ValueError(f"unsupported architecture {archs or config.get('model_type')!r}; weld supports "
                     f"{sorted(llama.HF_ARCHITECTURES)}")


def family_for_gguf(architecture: str) -> ModuleType:
    if architecture in llama.GGUF_ARCHITECTURES:
        return llama
    raise ValueError(f"unsupported GGUF architecture {architecture!r}; weld supports "
                     f"{sorted(llama.GGUF_ARCHITECTURES)}")

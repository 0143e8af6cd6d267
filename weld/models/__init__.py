"""Model families and the registry. Each family is one module implementing
`weld.models.family.ModelFamily`; this table is the only list of them."""

from __future__ import annotations

from types import ModuleType

from weld.models import deepseek, gemma3, gpt_oss, kimi_linear, llama, qwen3_next

FAMILIES: tuple[ModuleType, ...] = (llama, deepseek, gemma3, gpt_oss, qwen3_next, kimi_linear)


def _index(attribute: str) -> dict[str, ModuleType]:
    table: dict[str, ModuleType] = {}
    for family in FAMILIES:
        for name in getattr(family, attribute):
            if name in table:
                raise RuntimeError(f"{name!r} is claimed by {table[name].NAME} and {family.NAME}")
            table[name] = family
    return table


HF_TABLE = _index("HF_ARCHITECTURES")
GGUF_TABLE = _index("GGUF_ARCHITECTURES")


def family_for_hf(config: dict) -> ModuleType:
    """The family that implements a HF config.json: by `architectures`, then `model_type`
    (raises ValueError naming what weld supports if none does)."""
    archs = config.get("architectures") or []
    for name in [*archs, config.get("model_type")]:
        if name in HF_TABLE:
            return HF_TABLE[name]
    supported = sorted(n for n in HF_TABLE if n[:1].isupper())
    raise ValueError(f"unsupported architecture {archs or config.get('model_type')!r}; weld supports {supported}")


def family_for_gguf(architecture: str) -> ModuleType:
    if architecture in GGUF_TABLE:
        return GGUF_TABLE[architecture]
    raise ValueError(f"unsupported GGUF architecture {architecture!r}; weld supports {sorted(GGUF_TABLE)}")

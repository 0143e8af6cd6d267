"""Reading a checkpoint's settings the way every family's `Config.from_hf` / `from_gguf` does.

HF `config.json` spells some fields differently across checkpoints and transformers versions
(num_experts / num_local_experts), nests a text model's fields under `text_config`, and gives
EOS as one id or a list. GGUF metadata keys are prefixed by the architecture
(`{arch}.block_count`) and give EOS and end-of-turn separately.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping


def hf_field(text: Mapping[str, Any], *names: str) -> Any:
    """The first of `names` that config.json sets; ValueError naming them all if none is."""
    for name in names:
        if text.get(name) is not None:
            return text[name]
    raise ValueError(f"config.json has no {' or '.join(repr(n) for n in names)}")


def hf_eos_ids(config: Mapping[str, Any], text: Mapping[str, Any]) -> tuple[int, ...]:
    """The end-of-sequence ids of a config.json (one id or a list; the text model's, else the top level's)."""
    eos = text.get("eos_token_id", config.get("eos_token_id"))
    eos = eos if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return tuple(int(e) for e in eos)


def hf_bos_id(config: Mapping[str, Any], text: Mapping[str, Any]) -> int | None:
    return text.get("bos_token_id", config.get("bos_token_id"))


GgufKey = Callable[..., Any]


def gguf_reader(metadata: Mapping[str, Any], arch: str) -> GgufKey:
    """key(name[, default]) -> metadata[f"{arch}.{name}"]; ValueError when missing and no default."""

    def key(name: str, default: Any = KeyError) -> Any:
        full = f"{arch}.{name}"
        if full in metadata:
            return metadata[full]
        if default is KeyError:
            raise ValueError(f"GGUF metadata has no {full!r}")
        return default

    return key


def gguf_eos_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """The GGUF's end-of-sequence and end-of-turn token ids."""
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    return tuple(dict.fromkeys(int(e) for e in (eos, eot) if e is not None))


def gguf_vocab_size(metadata: Mapping[str, Any], key: GgufKey) -> int:
    vocab = key("vocab_size", None)
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("GGUF metadata has neither a vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens)
    return int(vocab)


def single(value: Any, what: str) -> int:
    """One int from a GGUF value that may be a per-layer list (which weld needs uniform)."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"per-layer {what} is not supported")
        value = value[0]
    return int(value)


def config_check(cfg: Any, positive: tuple[str, ...] = ()) -> Callable[[bool, str], None]:
    """The validation helper of a family Config's __post_init__: check(cond, msg) raises
    ValueError("invalid <architecture> config: msg") when cond is false. The fields named in
    `positive` are checked first to be positive integers."""
    def check(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"invalid {cfg.architecture} config: {msg}")

    for name in positive:
        value = getattr(cfg, name)
        check(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
    return check

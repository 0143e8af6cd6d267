"""How a byte-level BPE vocabulary in a GGUF splits text before merging: `tokenizer.ggml.pre`.

A GGUF names its pre-tokenizer ("smollm", "llama-bpe", "qwen2", ...) instead of storing it. llama.cpp
(`llama-vocab.cpp`) maps each name to a list of regexes applied one after another: every regex
splits the pieces the previous one left, and text a regex does not match stays as its own piece.
That is exactly a `tokenizers` `Sequence` of `Split(regex, "isolated")`, followed by a byte-level
pre-tokenizer that only maps bytes to the printable alphabet (`use_regex=False`).

Where llama.cpp rewrote a regex for `std::regex` (e.g. `(?i:'s|...)` spelled `'[sS]|...`), we use
the original from the model's `tokenizer.json`: `tokenizers` runs Oniguruma, which supports it.

Pre types whose splitting llama.cpp does in custom C++ (kimi-k2, afmoe) or that need huge
hand-written character classes (deepseek-llm) are not listed; `split_regexes` raises for them,
as llama.cpp does for a name it does not know, rather than tokenizing silently wrong.
"""

import logging

from weld.utils.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
BAILINGMOE = (
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

# Each pre type: the regexes in the order llama.cpp applies them.
_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [GPT2],
    "llama3": [LLAMA3],
    "qwen2": [QWEN2],
    "qwen35": [QWEN35],
    "digits-gpt2": [r"\p{N}", GPT2],  # each digit alone, then gpt-2: starcoder, smollm, ...
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "bloom": [BLOOM],
    "viking": [BLOOM, r"\p{N}"],
    "tekken": [TEKKEN],
    "gpt4o": [GPT4O],
    "seed-coder": [SEED_CODER],
    "bailingmoe": [BAILINGMOE],
}

# `tokenizer.ggml.pre` name -> key of `_REGEXES`, following llama.cpp's `llama_vocab::impl::load`.
_PRE_TYPES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"],
        "llama3",
    ),
    **dict.fromkeys(
        ["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
         "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo",
         "jais", "trillion", "granite-docling"],
        "gpt2",
    ),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"], "digits-gpt2"
    ),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
         "grok-2"],
        "qwen2",
    ),
    "qwen35": "qwen35",
    "falcon": "falcon",
    "deepseek-coder": "deepseek-coder",
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], "bloom"),
    "viking": "viking",
    "tekken": "tekken",
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt4o"),
    "seed-coder": "seed-coder",
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], "bailingmoe"),
}

# Pre types for which llama.cpp adds BOS unless the file says otherwise (`add_bos = true` there).
ADDS_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                      "lfm2", "jina-v5-nano", "tekken"})
# Pre types for which llama.cpp takes a whole pre-token that is in the vocabulary as one token
# before merging (`ignore_merges`); `tokenizers` BPE has the same switch.
IGNORES_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                            "lfm2", "jina-v5-nano", "tekken"})


def split_regexes(pre: str | None) -> list[str]:
    """The regexes llama.cpp applies, in order, for the GGUF pre-tokenizer name `pre`.

    A missing name falls back to llama.cpp's "default" with a warning, as llama.cpp does; an
    unknown name raises `UnsupportedModelError`.
    """
    if not pre:
        logger.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
                       "(generation quality may suffer, as llama.cpp warns too)")
        pre = "default"
    key = _PRE_TYPES.get(pre)
    if key is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer type tokenizer.ggml.pre={pre!r} is not supported by weld; "
            f"known: {', '.join(sorted(_PRE_TYPES))}"
        )
    return _REGEXES[key]

"""Rebuild the tokenizer a GGUF describes as a `tokenizers.Tokenizer`, with llama.cpp's semantics.

A GGUF stores no `tokenizer.json`, only llama.cpp's vocabulary keys. Two kinds matter here:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE. Tokens are already spelled in GPT-2's
  printable byte alphabet ("Ġthe"), merges are given, and the text is split first by the regexes
  llama.cpp picks from `tokenizer.ggml.pre` (see `pretokenizers.py`).
- `tokenizer.ggml.model == "llama"`: a sentencepiece BPE vocabulary: pieces with scores, spaces
  written "▁", and `<0xNN>` tokens for bytes no piece covers. llama.cpp merges the adjacent pair
  whose concatenation is the highest-scoring piece; a `tokenizers` BPE whose merges are every
  split of every piece, ranked by the piece's score, does the same. llama.cpp puts a space before
  the text and after every special token (`add_space_prefix`); a `Prepend("▁")` normalizer does
  that too, because `tokenizers` normalizes each stretch of text between added tokens apart.

Control (3) and unknown (2) tokens become special added tokens and user-defined ones (4) plain
added tokens, so each is matched whole in the text, as llama.cpp does when parsing specials.
"""

import logging

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from weld.tokenizer.pretokenizers import IGNORES_MERGES, split_regexes
from weld.utils.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

# llama.cpp's `llama_token_type` values in tokenizer.ggml.token_type.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def build_tokenizer(meta: dict) -> Tokenizer:
    """The `tokenizers.Tokenizer` for the GGUF metadata `meta` (keys as in the file)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model tokenizer.ggml.model={kind!r} is not supported; weld reads 'gpt2' and 'llama'"
        )
    _add_special_tokens(tokenizer, meta)
    return tokenizer


def token_types(meta: dict) -> list[int]:
    """`tokenizer.ggml.token_type`, or all NORMAL when the file has none."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    return list(types) if types is not None else [NORMAL] * len(tokens)


def special_token_ids(meta: dict) -> set[int]:
    """Ids that count as special (skipped when decoding with `skip_special_tokens`)."""
    ids = {i for i, t in enumerate(token_types(meta)) if t in (CONTROL, UNKNOWN)}
    for key in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(meta["tokenizer.ggml.tokens"]):
            ids.add(int(token_id))
    return ids


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character: printable Latin-1 bytes stand for
    themselves, the other 68 are moved to U+0100 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, shifted = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _byte_level_bpe(meta: dict) -> Tokenizer:
    tokens, types = meta["tokenizer.ggml.tokens"], token_types(meta)
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        # Normal tokens should already be in the byte alphabet; respell any that are not. Added
        # tokens (control, user-defined) are stored as plain text and matched as such, so keep them.
        if kind in (NORMAL, UNUSED, BYTE) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merges = _parse_merges(meta.get("tokenizer.ggml.merges") or [], vocab)
    pre = meta.get("tokenizer.ggml.pre")
    model = models.BPE(vocab, merges, ignore_merges=pre in IGNORES_MERGES)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split_regexes(pre)]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _parse_merges(lines: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """GGUF merges are "left right"; like llama.cpp, split at the first space after the first
    character, so a left part may itself be a space. Merges naming unknown tokens are dropped."""
    merges = []
    for line in lines:
        cut = line.find(" ", 1)
        if cut < 0:
            continue
        left, right = line[:cut], line[cut + 1:]
        if left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
    return merges


def _sentencepiece_bpe(meta: dict) -> Tokenizer:
    tokens, types = meta["tokenizer.ggml.tokens"], token_types(meta)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise UnsupportedModelError("GGUF llama (sentencepiece) tokenizer has no tokenizer.ggml.scores")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab,
        _merges_from_scores(tokens, scores, types, vocab),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    # llama.cpp defaults add_space_prefix to true for sentencepiece vocabularies.
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()] + strip
    )
    return tokenizer


def _merges_from_scores(tokens, scores, types, vocab) -> list[tuple[str, str]]:
    """Every way to write a normal piece as two vocabulary pieces, best piece score first.

    llama.cpp merges the pair whose concatenation scores highest, whatever its two halves; listing
    all splits of each piece, ranked by that piece's score, gives `tokenizers` the same order.
    Splits of one piece are ordered by the halves' ids, so the result does not depend on Python's
    sort stability. Only normal pieces are merge targets: control, byte and user-defined tokens are
    never built from text by merging.
    """
    ranked = sorted(
        (i for i, kind in enumerate(types) if kind == NORMAL and len(tokens[i]) > 1 and vocab.get(tokens[i]) == i),
        key=lambda i: (-scores[i], i),
    )
    merges = []
    for i in ranked:
        piece = tokens[i]
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        splits = [(a, b) for a, b in splits if a in vocab and b in vocab]
        merges.extend(sorted(splits, key=lambda ab: (vocab[ab[0]], vocab[ab[1]])))
    return merges


def _add_special_tokens(tokenizer: Tokenizer, meta: dict) -> None:
    tokens, types = meta["tokenizer.ggml.tokens"], token_types(meta)
    special = special_token_ids(meta)
    # Each content is in the model's vocabulary already, so the added token keeps the file's id.
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False)
         for i, kind in enumerate(types) if kind == USER_DEFINED and i not in special]
    )
    # A duplicated token text would make an added token land on a different id; say so loudly.
    for i in special:
        if tokenizer.token_to_id(tokens[i]) != i:
            logger.warning("GGUF token %d %r is duplicated; it encodes as id %s", i, tokens[i],
                           tokenizer.token_to_id(tokens[i]))

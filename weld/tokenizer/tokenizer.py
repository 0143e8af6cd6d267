"""`Tokenizer`: text <-> token ids and chat prompts, from a GGUF's metadata or a HF model folder.

Both sources end up as one `tokenizers.Tokenizer` (the Rust library) plus the few facts the engine
needs around it: which ids begin and end a sequence, which are special, and the chat template.
BOS/EOS are added here rather than by a `tokenizers` post-processor, so both sources follow one
rule: `encode(text)` = prefix + tokens of text + suffix, with prefix/suffix from the model.
"""

import json
import logging
import os

import tokenizers

from weld.tokenizer import chat_template as _chat
from weld.tokenizer import ggml_vocab
from weld.tokenizer.pretokenizers import ADDS_BOS
from weld.utils.errors import InvalidInputError, ModelNotFoundError, UnsupportedModelError


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of the 256 bytes (GPT-2's): the printable Latin-1 bytes stand for
    themselves, every other byte for the next unused code point from 256 on. Char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_level_alphabet()

logger = logging.getLogger(__name__)

# Token texts llama.cpp treats as end of generation even when the file names no eot/eom id
# (`llama_vocab::impl::load`), e.g. SmolLM2 declares eos <|im_end|> but also stops at <|endoftext|>.
_END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
    "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>",
})


class Tokenizer:
    """Encode, decode and render chat prompts for one model.

    Attributes: `vocab_size`, `bos_token_id` / `bos_token`, `eos_token_ids` (all ids that end
    generation; the first is the model's EOS) / `eos_token`, `pad_token_id`, `all_special_ids`,
    `chat_template` (str or None), and `backend` (the `tokenizers.Tokenizer`).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        pad_token_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        special_ids: tuple[int, ...] | None = None,
        vocab_size: int | None = None,
    ):
        self.backend = backend
        self.vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        if add_bos and bos_token_id is None:
            raise UnsupportedModelError("the tokenizer asks for a BOS token but names none")
        if add_eos and not self.eos_token_ids:
            raise UnsupportedModelError("the tokenizer asks for an EOS token but names none")
        self._prefix = [bos_token_id] if add_bos else []
        self._suffix = [self.eos_token_ids[0]] if add_eos else []
        if special_ids is None:
            special_ids = tuple(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.all_special_ids = tuple(sorted(set(special_ids)))

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from GGUF metadata as a plain dict {key: python value}, following llama.cpp."""
        if "tokenizer.ggml.tokens" not in meta:
            raise UnsupportedModelError("GGUF has no tokenizer (tokenizer.ggml.tokens is missing)")
        tokens = meta["tokenizer.ggml.tokens"]
        kind = meta.get("tokenizer.ggml.model")

        def token_id(key):
            value = meta.get(f"tokenizer.ggml.{key}_token_id")
            return int(value) if value is not None and 0 <= value < len(tokens) else None

        eos_ids = [token_id(k) for k in ("eos", "eot", "eom")]
        types = ggml_vocab.token_types(meta)
        eos_ids += [i for i, t in enumerate(tokens) if t in _END_OF_GENERATION_TEXTS and types[i] == ggml_vocab.CONTROL]
        # llama.cpp: sentencepiece vocabularies add BOS by default, BPE ones only for some pre types;
        # the file's own flags win.
        add_bos_default = kind == "llama" or meta.get("tokenizer.ggml.pre") in ADDS_BOS
        template = meta.get("tokenizer.chat_template")
        if template is None:  # a known turn format in the vocabulary: its usual template
            template = _chat.builtin_template({t for t, k in zip(tokens, types) if k == ggml_vocab.CONTROL})
            if template is not None:
                logger.info("the GGUF has no chat template; using the built-in one for its turn tokens")
        return cls(
            ggml_vocab.build_tokenizer(meta),
            bos_token_id=token_id("bos"),
            eos_token_ids=tuple(i for i in eos_ids if i is not None),
            pad_token_id=token_id("padding"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=template,
            special_ids=tuple(ggml_vocab.special_token_ids(meta)),
            vocab_size=len(tokens),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a HF model folder: tokenizer.json, tokenizer_config.json, chat_template.jinja,
        and EOS ids from generation_config.json / config.json when present."""
        path = os.fspath(path)
        tokenizer_json = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            if os.path.isfile(os.path.join(path, "tokenizer.model")):
                raise UnsupportedModelError(
                    f"{path} has only a sentencepiece tokenizer.model; weld needs a tokenizer.json"
                )
            raise ModelNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(tokenizer_json)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        model_config = _read_json(os.path.join(path, "config.json"))
        generation_config = _read_json(os.path.join(path, "generation_config.json"))

        def id_of(name):
            text = _token_text(config.get(name))
            return backend.token_to_id(text) if text is not None else None

        bos_id = id_of("bos_token")
        if bos_id is None and isinstance(model_config.get("bos_token_id"), int):
            bos_id = model_config["bos_token_id"]
        eos_ids = [id_of("eos_token")]
        for source in (generation_config, model_config):
            value = source.get("eos_token_id")
            eos_ids += value if isinstance(value, list) else [value]
        # What tokenizer.json's post-processor puts around the text, unless tokenizer_config overrides.
        prefix, suffix = _added_around(backend)
        add_bos = bool(config.get("add_bos_token", bos_id is not None and prefix == [bos_id]))
        add_eos = bool(config.get("add_eos_token", len(suffix) == 1 and suffix[0] in eos_ids))
        if add_bos and bos_id is None and len(prefix) == 1:
            bos_id = prefix[0]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=tuple(i for i in eos_ids if isinstance(i, int)),
            pad_token_id=id_of("pad_token"),
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=_hf_chat_template(path, config),
        )

    # ---- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) are matched
        as one token. With `add_special_tokens`, the model's BOS/EOS are added as it asks."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text to encode must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._prefix + ids + self._suffix if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (any int sequence); special tokens are left out with `skip_special_tokens`."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry for `token_id` as the tokenizer spells it (e.g. "Ġthe", "▁the")."""
        return self.backend.id_to_token(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for, a partial UTF-8 character included (OpenAI's logprob
        `bytes`; decoding one such token alone gives U+FFFD): byte-level BPE's vocabulary spells
        each byte as one character (GPT-2's map), SentencePiece's byte fallback as "<0xHH>" and a
        space as "▁"."""
        piece = self.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self.backend.decoder, tokenizers.decoders.ByteLevel):
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            except KeyError:  # an added token spelled in plain text
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @property
    def pad_token(self) -> str | None:
        return None if self.pad_token_id is None else self.id_to_token(self.pad_token_id)

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        **extra,
    ) -> str:
        """The prompt string for `messages`, rendered like HF's `apply_chat_template(tokenize=False)`.

        `extra` become template variables (e.g. `enable_thinking=False`). With
        `continue_final_message` the prompt stops right after the last message's content (and no
        generation prompt is added). Template errors raise `InvalidInputError`.
        """
        if self.chat_template is None:
            raise InvalidInputError("this model has no chat template")
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        if self.pad_token is not None:
            variables["pad_token"] = self.pad_token
        variables.update(extra)
        return _chat.render(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            variables=variables,
        )


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value) -> str | None:
    """tokenizer_config writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _added_around(backend: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor adds before and after a text, found by encoding a probe."""
    bare = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    return [], []


def _hf_chat_template(path: str, config: dict) -> str | None:
    """chat_template.jinja (transformers >= 4.50 saves it so) wins over tokenizer_config's entry,
    which may be a string or a list of named templates."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None

"""Streaming detokenization that never emits half a character.

One token can carry part of a UTF-8 character (byte-level BPE splits "😀" over several tokens;
sentencepiece spells unknown characters as `<0xNN>` byte tokens), and decoding a lone token can
differ from decoding it in context (sentencepiece drops a leading space only at the start). So,
as in vLLM, each step decodes a short window twice -- from `prefix_offset` to `read_offset` (text
already emitted) and from `prefix_offset` to the end -- and emits the difference, but only once
it does not end in U+FFFD, the mark of an unfinished character. The window then slides forward,
so each step costs O(window), not O(sequence).
"""

from weld.tokenizer.tokenizer import Tokenizer

# How many prompt tokens to decode with the first generated ones, for context (as vLLM does).
_PROMPT_CONTEXT = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turn a growing list of generated ids into text deltas.

    `add(ids)` returns the text that became complete; `text` is all text emitted so far;
    `flush()` returns what is still held back (an unfinished character, as U+FFFD) at the end.
    Without `prompt_ids`, the deltas concatenate to `tokenizer.decode(all_new_ids)`; with them,
    to the text the new ids add after the prompt (a leading space is kept, for instance).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids=None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = [int(i) for i in (prompt_ids or ())]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(len(self._ids) - _PROMPT_CONTEXT, 0)
        self.text = ""

    def add(self, new_token_ids) -> str:
        """Append `new_token_ids` (an int or a sequence of ints); return the newly complete text."""
        if isinstance(new_token_ids, int):
            new_token_ids = [new_token_ids]
        self._ids.extend(int(i) for i in new_token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text of ids not yet emitted (an unfinished character shows as U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        delta = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

"""Tool calls in a model's text: Hermes / Qwen `<tool_call>` blocks, or a bare JSON object.

Hermes-style models (Qwen 2.5/3, Hermes, many fine-tunes) write each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and other models often answer with just the JSON (`{"name": ..., "arguments"|"parameters": ...}`
or a list of such objects). `parse_tool_calls` reads a finished text; `ToolCallStreamParser` reads
the same text as it streams in deltas of any size (one engine step may add several tokens, so a
tag can arrive split or several calls can arrive at once) and says when a call is complete.
Text that only looks like a call but is not valid JSON stays content, never a half-parsed call.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON text, as the OpenAI API carries it


def _call_from_json(value: Any) -> ParsedToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = set(value) - {"name"}
    if not keys <= {"arguments", "parameters"} or len(keys) > 1:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _calls_from_json_text(text: str) -> list[ParsedToolCall] | None:
    """The calls a JSON text holds (an object or a list of objects), or None if it holds none."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_from_json(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Splits a finished model text into (content, tool calls).

    content is the text outside the calls, stripped, or None when nothing is left. A block that
    is not a valid call stays content. This is the streaming parser fed the whole text at once,
    so streamed and non-streamed replies agree by construction.
    """
    parser = ToolCallStreamParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(value for kind, value in events if kind == "content").strip()
    return (content or None), [value for kind, value in events if kind == "tool_call"]


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallStreamParser:
    """Incremental `parse_tool_calls`: `feed(delta)` and, at the end, `finish()` return events,
    each ("content", text) or ("tool_call", ParsedToolCall), in the order of the text.

    Content is held back only while it might still turn out to be part of a call (the start of
    a `<tool_call>` tag, text inside an open call, a reply that starts as JSON, or whitespace that
    may separate calls). The streamed content, stripped, equals `parse_tool_calls`'s content.
    """

    def __init__(self):
        self._buffer = ""
        self._mode = "start"  # start | text | call | json
        self._events: list[tuple[str, Any]] = []

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        self._buffer += delta
        self._advance()
        return self._take()

    def finish(self) -> list[tuple[str, Any]]:
        if self._mode == "call":
            parsed = _calls_from_json_text(self._buffer.strip())
            if parsed is None:
                self._content(TOOL_CALL_OPEN + self._buffer)
            else:
                self._events += [("tool_call", c) for c in parsed]
        elif self._mode == "json":
            parsed = _calls_from_json_text(self._buffer.strip())
            if parsed is None:
                self._content(self._buffer)
            else:
                self._events += [("tool_call", c) for c in parsed]
        elif self._buffer.strip():
            self._content(self._buffer)
        self._buffer = ""
        return self._take()

    def _take(self) -> list[tuple[str, Any]]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if text:
            self._events.append(("content", text))

    def _advance(self) -> None:
        while True:
            if self._mode == "start":
                body = self._buffer.lstrip()
                if not body:
                    return
                self._mode = "json" if body[0] in "{[" else "text"
            if self._mode == "json":
                return  # a bare-JSON reply is only judged whole, at the end
            if self._mode == "text":
                head, tag, tail = self._buffer.partition(TOOL_CALL_OPEN)
                if tag:
                    if head.strip():
                        self._content(head)
                    self._buffer, self._mode = tail, "call"
                    continue
                keep = _partial_tag_suffix(self._buffer, TOOL_CALL_OPEN)
                ready = self._buffer[:len(self._buffer) - keep]
                if ready.strip():  # whitespace alone may just separate two calls: hold it
                    self._content(ready)
                    self._buffer = self._buffer[len(ready):]
                return
            if self._mode == "call":
                inner, tag, tail = self._buffer.partition(TOOL_CALL_CLOSE)
                if not tag:
                    return
                parsed = _calls_from_json_text(inner.strip())
                if parsed is None:
                    self._content(TOOL_CALL_OPEN + inner + TOOL_CALL_CLOSE)
                else:
                    self._events += [("tool_call", c) for c in parsed]
                self._buffer, self._mode = tail, "text"

"""Tool-call parsing on text: Hermes `<tool_call>` blocks, bare JSON, and streaming in any chunking."""

from __future__ import annotations

import json
import random

import pytest

from weld.tokenizer.tool_parsers import ParsedToolCall, ToolCallStreamParser, parse_tool_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

CASES = [
    # text, expected content, expected [(name, arguments dict)]
    ("Just an answer.", "Just an answer.", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]),
    (f"<tool_call>\n{WEATHER}", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),  # no closing tag (EOS)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    ("<tool_call>not json</tool_call> and text", "<tool_call>not json</tool_call> and text", []),
    (WEATHER, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (f"  [{WEATHER}, {TIME}]  ", None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]),
    ('{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),  # Llama-3 style key
    ('{"name": "f", "arguments": "{\\"x\\": 1}"}', None, [("f", {"x": 1})]),  # arguments as a JSON string
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ('{"name": "f", "arguments": {"x": 1}, "extra": 2}', '{"name": "f", "arguments": {"x": 1}, "extra": 2}', []),
    ("Use <tool_call for this", "Use <tool_call for this", []),  # a partial tag at the end is content
    ("a < b and <tool", "a < b and <tool", []),
    ("", None, []),
]


def _decoded(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse_finished_text(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert _decoded(got_calls) == calls
    assert all(isinstance(c, ParsedToolCall) for c in got_calls)


def _stream(text, cuts):
    parser = ToolCallStreamParser()
    events = []
    prev = 0
    for cut in list(cuts) + [len(text)]:
        events += parser.feed(text[prev:cut])
        prev = cut
    return events + parser.finish()


@pytest.mark.parametrize("text,content,calls", CASES)
def test_streaming_agrees_with_whole_text_for_every_chunking(text, content, calls):
    """One engine step can add one token or many: split the text everywhere, at random, in one go."""
    splits = [[i] for i in range(1, len(text))]
    rng = random.Random(len(text))
    splits += [sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6)))) for _ in range(20)
               if len(text) > 1]
    splits.append([])
    for cuts in splits:
        events = _stream(text, cuts)
        streamed = "".join(v for k, v in events if k == "content").strip() or None
        assert streamed == content, cuts
        assert _decoded([v for k, v in events if k == "tool_call"]) == calls, cuts


def test_content_before_a_call_streams_before_the_call_is_complete():
    parser = ToolCallStreamParser()
    assert parser.feed("Checking the weather") == [("content", "Checking the weather")]
    assert parser.feed(" now <tool") == [("content", " now ")]  # "<tool" may open a tag: held
    assert parser.feed("_call>\n{\"name\": \"get_weather\",") == []
    events = parser.feed(' "arguments": {}}\n</tool_call>')
    assert events == [("tool_call", ParsedToolCall("get_weather", "{}"))]
    assert parser.finish() == []

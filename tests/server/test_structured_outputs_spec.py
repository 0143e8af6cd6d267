"""Parsing `response_format` / `structured_outputs` into one StructuredOutputs (not enforced yet)."""

from __future__ import annotations

import pytest

from weld.server.errors import APIError
from weld.server.structured_outputs import StructuredOutputs, parse_structured_outputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]}


@pytest.mark.parametrize("response_format,structured,expected", [
    (None, None, None),
    ({"type": "text"}, None, None),
    ({"type": "json_object"}, None, StructuredOutputs("json_object", source="response_format")),
    ({"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}, None,
     StructuredOutputs("json", json_schema=SCHEMA, schema_name="thing", strict=True, source="response_format")),
    (None, {"json": SCHEMA}, StructuredOutputs("json", json_schema=SCHEMA)),
    (None, {"json": '{"type": "string"}'}, StructuredOutputs("json", json_schema={"type": "string"})),
    (None, {"regex": "[a-z]+"}, StructuredOutputs("regex", regex="[a-z]+")),
    (None, {"choice": ["yes", "no"]}, StructuredOutputs("choice", choice=("yes", "no"))),
    (None, {"grammar": "root ::= 'a'"}, StructuredOutputs("grammar", grammar="root ::= 'a'")),
    (None, {"json_object": True}, StructuredOutputs("json_object")),
])
def test_parses(response_format, structured, expected):
    assert parse_structured_outputs(response_format, structured) == expected


@pytest.mark.parametrize("response_format,structured,param", [
    ({"type": "xml"}, None, "response_format.type"),
    ({"type": "json_schema"}, None, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": 5}}, None, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "nope": 1}}, None, "response_format.json_schema"),
    ({"type": "json_object", "extra": 1}, None, "response_format"),
    (None, {}, "structured_outputs"),
    (None, {"regex": "a", "choice": ["b"]}, "structured_outputs"),
    (None, {"choice": []}, "structured_outputs.choice"),
    (None, {"json": "{not json"}, "structured_outputs.json"),
    (None, {"regex": ""}, "structured_outputs.regex"),
    (None, {"whatever": 1}, "structured_outputs"),
    ({"type": "json_object"}, {"regex": "a"}, "structured_outputs"),
])
def test_rejects(response_format, structured, param):
    with pytest.raises(APIError) as info:
        parse_structured_outputs(response_format, structured)
    assert info.value.status == 400 and info.value.param == param

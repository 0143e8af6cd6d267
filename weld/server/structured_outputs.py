"""What a request asks its output to follow: `response_format` (json_object / json_schema) or
vLLM's `structured_outputs` (json / regex / choice / grammar / json_object), parsed and checked.

`engine_structured_outputs` turns the parsed spec into the engine's `StructuredOutputsParams`,
which the engine enforces by grammar-constrained decoding (llguidance; a token bitmask applied
on device before sampling). A schema, regex or grammar that does not compile is a 400.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from weld.engine.sampling_params import StructuredOutputsParams
from weld.server.errors import APIError
from weld.utils.errors import InvalidInputError


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """One output constraint. Exactly one of the payload fields is set, as `kind` says."""

    kind: str  # "json" | "json_object" | "regex" | "choice" | "grammar"
    json_schema: dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    schema_name: str | None = None  # response_format.json_schema.name
    strict: bool | None = None
    source: str = "structured_outputs"  # the request field it came from, for error messages
    disable_any_whitespace: bool = False  # structured_outputs.disable_any_whitespace


def _from_response_format(value: dict[str, Any]) -> StructuredOutputs | None:
    kind = value.get("type")
    if kind == "text":
        if set(value) != {"type"}:
            raise APIError(400, "response_format of type 'text' takes no other fields", param="response_format")
        return None
    if kind == "json_object":
        if set(value) != {"type"}:
            raise APIError(400, "response_format of type 'json_object' takes no other fields",
                           param="response_format")
        return StructuredOutputs("json_object", source="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if set(value) != {"type", "json_schema"} or not isinstance(spec, dict):
            raise APIError(400, "response_format of type 'json_schema' needs a 'json_schema' object",
                           param="response_format.json_schema")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise APIError(400, f"unsupported field in response_format.json_schema: {sorted(unknown)[0]}",
                           param="response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise APIError(400, "response_format.json_schema.schema must be a JSON Schema object",
                           param="response_format.json_schema.schema")
        name, strict = spec.get("name"), spec.get("strict")
        if name is not None and not isinstance(name, str) or strict is not None and not isinstance(strict, bool):
            raise APIError(400, "response_format.json_schema: name must be a string and strict a boolean",
                           param="response_format.json_schema")
        return StructuredOutputs("json", json_schema=schema, schema_name=name, strict=strict,
                                 source="response_format")
    raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format.type")


def _from_structured_outputs(value: dict[str, Any]) -> StructuredOutputs:
    kinds = {"json", "json_object", "regex", "choice", "grammar"}
    unknown = set(value) - kinds - {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
    if unknown:
        raise APIError(400, f"unsupported field in structured_outputs: {sorted(unknown)[0]}",
                       param="structured_outputs")
    given = [k for k in sorted(kinds) if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise APIError(400, "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                            f"got {given or 'none'}", param="structured_outputs")
    kind = given[0]
    payload = value[kind]
    no_whitespace = value.get("disable_any_whitespace") or False
    if not isinstance(no_whitespace, bool):
        raise APIError(400, "structured_outputs.disable_any_whitespace must be a boolean",
                       param="structured_outputs.disable_any_whitespace")
    if no_whitespace:
        return dataclasses.replace(_from_structured_outputs({k: v for k, v in value.items()
                                                             if k != "disable_any_whitespace"}),
                                   disable_any_whitespace=True)
    if kind == "json":
        if isinstance(payload, str):
            try:
                payload = json.loads(payload)
            except json.JSONDecodeError as err:
                raise APIError(400, f"structured_outputs.json is not valid JSON: {err}",
                               param="structured_outputs.json") from None
        if not isinstance(payload, (dict, bool)):
            raise APIError(400, "structured_outputs.json must be a JSON Schema", param="structured_outputs.json")
        return StructuredOutputs("json", json_schema=payload)
    if kind == "json_object":
        if payload is not True:
            raise APIError(400, "structured_outputs.json_object must be true", param="structured_outputs.json_object")
        return StructuredOutputs("json_object")
    if kind == "choice":
        if not isinstance(payload, list) or not payload or not all(isinstance(c, str) for c in payload):
            raise APIError(400, "structured_outputs.choice must be a non-empty list of strings",
                           param="structured_outputs.choice")
        return StructuredOutputs("choice", choice=tuple(payload))
    if not isinstance(payload, str) or not payload:
        raise APIError(400, f"structured_outputs.{kind} must be a non-empty string", param=f"structured_outputs.{kind}")
    return StructuredOutputs(kind, **{kind: payload})


def parse_structured_outputs(response_format: dict[str, Any] | None,
                             structured_outputs: dict[str, Any] | None) -> StructuredOutputs | None:
    """The request's output constraint, or None. Malformed specs are a 400 naming the field."""
    from_format = _from_response_format(response_format) if response_format is not None else None
    from_structured = _from_structured_outputs(structured_outputs) if structured_outputs is not None else None
    if from_format is not None and from_structured is not None:
        raise APIError(400, "give either response_format or structured_outputs, not both", param="structured_outputs")
    return from_format or from_structured


def engine_structured_outputs(spec: StructuredOutputs | None) -> StructuredOutputsParams | None:
    """The engine's form of `spec` (compiled here, so a bad schema, regex or grammar is a 400
    naming the field it came from)."""
    if spec is None:
        return None
    payload = {"json": spec.json_schema, "json_object": True, "regex": spec.regex,
               "choice": list(spec.choice or ()), "grammar": spec.grammar}[spec.kind]
    if spec.source == "response_format":
        param = "response_format.json_schema.schema" if spec.kind == "json" else "response_format"
    else:
        param = f"structured_outputs.{spec.kind}"
    try:
        return StructuredOutputsParams(**{spec.kind: payload}, disable_any_whitespace=spec.disable_any_whitespace)
    except InvalidInputError as err:
        message = str(err).replace(f"structured_outputs.{spec.kind}", param, 1)
        raise APIError(400, message, param=param) from None

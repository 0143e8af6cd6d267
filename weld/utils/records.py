"""Frozen dataclasses (a family's Config and the settings nested in it) to JSON values and back.

    document = to_json(cfg)                      # {"vocab_size": 49152, "rope_scaling": {...}, ...}
    cfg == from_json(type(cfg), document)        # True: tuples, nested dataclasses and None restored

The field types drive the way back: a nested dataclass field is rebuilt from its dict, a
`tuple[...]` field from its list, `X | None` from null or an X. Unknown keys are an error
(a document written by a newer weld), missing keys take the field's default.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any


def to_json(value: Any) -> Any:
    """A dataclass as a dict of its fields, tuples as lists, recursively; other values as they are."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_json(cls: type, document: Any) -> Any:
    """The dataclass cls of `to_json`'s dict (raises ValueError for unknown fields or bad values)."""
    if not isinstance(document, dict):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(document).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(document) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {', '.join(unknown)}")
    hints = _hints(cls)
    return cls(**{name: _value(hints[name], value, f"{cls.__name__}.{name}") for name, value in document.items()})


def _value(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is not type(None):
                try:
                    return _value(option, value, where)
                except (TypeError, ValueError):
                    continue
        raise ValueError(f"{where}: {value!r} is none of {hint}")
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(hint)
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(items) != len(value):
            raise ValueError(f"{where}: expected {len(items)} items, got {len(value)}")
        return tuple(_value(h, v, where) for h, v in zip(items, value))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_json(hint, value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and hint is not Any and not isinstance(value, hint):
        raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value

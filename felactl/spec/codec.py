"""Dict <-> frozen dataclass conversion driven by the dataclasses' own type hints.

Every spec class declares its fields once, with types; this module turns a parsed YAML mapping
into an instance (rejecting unknown keys, missing keys and wrong types with the key path) and
back. Value checks live in each class's ``__post_init__`` and raise :class:`FieldProblem`; the
decoder adds the path, so a message reads ``nodes[1].devices[0].memory_gb: must be > 0, got -4``.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Union

from felactl.errors import SpecError
from felactl.limits import Bound, show


class FieldProblem(ValueError):
    """Raised by a spec's ``__post_init__``; ``key`` is relative to the object being checked."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


def positive(key: str, value: float, bound: Bound | None = None, *, allow_zero: bool = False) -> None:
    """The one check for "must be > 0" (or ">= 0"), and inside ``bound`` (what a file may claim,
    :mod:`felactl.limits`), so every message reads the same."""
    if value != value or value in (float("inf"), float("-inf")):  # NaN passes both comparisons below
        raise FieldProblem(key, f"must be a finite number, got {value}")
    if allow_zero and value < 0:
        raise FieldProblem(key, f"must be >= 0, got {show(value)}")
    if not allow_zero and value <= 0:
        raise FieldProblem(key, f"must be > 0, got {show(value)}")
    problem = bound.problem(value) if bound is not None else None
    if problem is not None:
        raise FieldProblem(key, problem)


SCHEMA_VERSION = 1
"""The one schema version every felactl file is written in and read at."""


def check_header(kind: str, expected_kind: str, schema_version: int) -> None:
    """The ``kind:`` and ``schema_version:`` every spec file starts with."""
    if kind != expected_kind:
        raise FieldProblem("kind", f"must be {expected_kind}, got {kind!r}")
    if schema_version != SCHEMA_VERSION:
        raise FieldProblem("schema_version", f"must be {SCHEMA_VERSION}, got {schema_version}")


def _join(path: str, key: str) -> str:
    if not path:
        return key
    return f"{path}{key}" if key.startswith("[") else f"{path}.{key}"


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return "one of " + "|".join(str(m.value) for m in tp)
        return {
            "str": "a string",
            "int": "an integer",
            "float": "a number",
            "bool": "true/false",
            "list": "a list",
            "dict": "a mapping",
        }.get(tp.__name__, tp.__name__)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    return str(tp)


def _decode(tp: Any, value: Any, where: str, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _decode_union(typing.get_args(tp), value, where, path)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise SpecError(where, path, f"must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise SpecError(where, path, f"must be a list, got {type(value).__name__}")
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        items = [_decode(item_tp, v, where, _join(path, f"[{i}]")) for i, v in enumerate(value)]
        return tuple(items)
    if origin is dict:
        return _decode_mapping(typing.get_args(tp)[1], value, where, path)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return decode(tp, value, where, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise SpecError(where, path, f"must be {_type_name(tp)}, got {value!r}") from None
    return _decode_scalar(tp, value, where, path)


def _decode_union(options: tuple[Any, ...], value: Any, where: str, path: str) -> Any:
    """The first of ``options`` that ``value`` decodes as; null only where one of them is ``None``."""
    if value is None:
        if type(None) in options:
            return None
        raise SpecError(where, path, "must not be empty")
    non_null = [o for o in options if o is not type(None)]
    errors = []
    for option in non_null:
        try:
            return _decode(option, value, where, path)
        except SpecError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    raise SpecError(
        where, path, f"must be {' or '.join(_type_name(o) for o in non_null)}, got {type(value).__name__} {value!r}"
    )


def _decode_mapping(val_tp: Any, value: Any, where: str, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(where, path, f"must be a mapping, got {type(value).__name__}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise SpecError(where, _join(path, str(k)), "keys must be strings")
        out[k] = _decode(val_tp, v, where, _join(path, k))
    return out


def _decode_scalar(tp: Any, value: Any, where: str, path: str) -> Any:
    """A YAML scalar as ``bool``, ``int``, ``float`` (finite; an integer is taken) or ``str``."""
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(where, path, f"must be true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(where, path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(where, path, f"must be a number, got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise SpecError(where, path, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(where, path, f"must be a string, got {value!r}")
        return value
    raise TypeError(f"spec codec cannot decode type {tp!r}")  # a bug in a spec class, not input


def decode(cls: type, data: Any, where: str, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; every problem is a :class:`SpecError` with its path."""
    if not isinstance(data, dict):
        raise SpecError(where, path, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        raise SpecError(where, _join(path, unknown[0]), f"unknown key (expected one of: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, field in fields.items():
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise SpecError(where, _join(path, name), "missing required key")
            continue
        kwargs[name] = _decode(hints[name], data[name], where, _join(path, name))
    try:
        return cls(**kwargs)
    except FieldProblem as exc:
        raise SpecError(where, _join(path, exc.key), exc.problem) from None


def encode(obj: Any) -> Any:
    """Turn a spec object into plain YAML/JSON data, dropping optional fields left at None."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            if value is None:
                continue
            out[f.name] = encode(value)
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): encode(v) for k, v in obj.items()}
    return obj

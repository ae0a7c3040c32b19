"""YAML at the edge: load a spec file (every problem named by file and key path), save atomically."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml

from felactl.errors import InputError, SpecError
from felactl.fsutil import atomic_write_text
from felactl.spec.cluster import ClusterSpec
from felactl.spec.codec import decode, encode
from felactl.spec.model import ModelSpec
from felactl.spec.plan import Plan

T = TypeVar("T", ClusterSpec, ModelSpec, Plan)
KINDS: dict[str, type] = {"Cluster": ClusterSpec, "Model": ModelSpec, "Plan": Plan}


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of silently keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    mapping = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# PyYAML follows YAML 1.1, where ``1e9`` and ``1.5e3`` are strings; people write FLOPs and rates so.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)[eE][-+]?[0-9]+$")
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789"))


def parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(where, "", f"not valid YAML: {line}{problem}") from None


def read_text(path: str | os.PathLike) -> str:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if p.is_dir():
        raise InputError(f"{p}: is a directory, expected a YAML file")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read: {exc}") from None


def from_dict(cls: type[T], data: Any, where: str = "<dict>") -> T:
    """Decode a parsed mapping into ``cls``, checking ``kind`` first for a clear message."""
    expected = cls.__name__.removesuffix("Spec")
    if isinstance(data, dict) and "kind" in data and data["kind"] != expected:
        raise SpecError(where, "kind", f"must be {expected}, got {data['kind']!r} (is this the right file?)")
    if data is None:
        raise SpecError(where, "", "the file is empty")
    return decode(cls, data, where)


def to_dict(obj: ClusterSpec | ModelSpec | Plan) -> dict:
    data = encode(obj)
    # kind and schema_version first: people read these files.
    return {"kind": data.pop("kind"), "schema_version": data.pop("schema_version"), **data}


def load(cls: type[T], path: str | os.PathLike) -> T:
    where = str(path)
    return from_dict(cls, parse_yaml(read_text(path), where), where)


def load_cluster(path: str | os.PathLike) -> ClusterSpec:
    return load(ClusterSpec, path)


def load_model(path: str | os.PathLike) -> ModelSpec:
    return load(ModelSpec, path)


def load_plan(path: str | os.PathLike) -> Plan:
    return load(Plan, path)


def dump_yaml(obj: ClusterSpec | ModelSpec | Plan) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=None, width=120)


def save(obj: ClusterSpec | ModelSpec | Plan, path: str | os.PathLike) -> Path:
    """Write ``obj`` as YAML (or JSON for a ``.json`` path) atomically."""
    p = Path(path)
    text = json.dumps(to_dict(obj), indent=2) + "\n" if p.suffix == ".json" else dump_yaml(obj)
    return atomic_write_text(p, text)

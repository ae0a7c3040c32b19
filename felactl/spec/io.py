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


MAX_FILE_BYTES = 256 * 2**20
"""A felactl file's size: a 1,024-device cluster with every one of its million links listed is
about 100 MB; a file larger than this is not a felactl file (or is /dev/zero)."""
MAX_DEPTH = 64
"""Nesting of mappings and lists: the formats need 6; the composer recurses once per level."""
MAX_VALUES = 16 * 2**20
"""Values in a file once its aliases are expanded (each use of an anchor counts its whole value):
bounds what a "billion laughs" alias bomb can make the decoder walk or an error message print."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of silently keeping the last one, and
    documents nested deeper than :data:`MAX_DEPTH` or expanding to more than :data:`MAX_VALUES`
    values through aliases (PyYAML bounds neither)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0
        self._num_values = 0
        self._expanded: dict[int, int] = {}  # id(node) -> values it expands to

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            self._count(self._expanded.get(id(node), 1), mark)
            return node
        mark = self.peek_event().start_mark
        if self._depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
        before = self._count(1, mark)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._expanded[id(node)] = self._num_values - before + 1
        return node

    def _count(self, num_values: int, mark) -> int:
        self._num_values += num_values
        if self._num_values > MAX_VALUES:
            raise yaml.composer.ComposerError(
                None, None, f"more than {MAX_VALUES} values once its aliases are expanded", mark
            )
        return self._num_values


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    mapping = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
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
    if not p.is_file():
        raise InputError(f"{p}: not a regular file, expected a YAML file")
    try:
        with p.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise InputError(f"{p}: larger than {MAX_FILE_BYTES // 2**20} MiB, not a felactl file")
        return data.decode("utf-8")
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

"""``--job SOURCE`` and ``--job-config``: what bench_runtime.py and bench_scale.py take to measure a
user's own :class:`felactl.TrainJob` (``package.module:function``, e.g. ``examples.lm:job``)
instead of their built-in models."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from felactl.cli.model_profile import parse_config
from felactl.errors import InputError


def add_job_arguments(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    parser.add_argument(
        "--job",
        default=default,
        metavar="SOURCE",
        help="a user's TrainJob, package.module:function (e.g. examples.lm:job)",
    )
    parser.add_argument(
        "--job-config",
        action="append",
        default=[],
        metavar="CONFIG",
        help="keyword arguments of --job's function: key=value, or a JSON/YAML mapping (repeat)",
    )


def job_config(items: list[str]) -> dict[str, Any]:
    """``["seq_len=64", '{"width": 128}']`` -> ``{"seq_len": 64, "width": 128}``: each item a
    ``key=value`` (the value read as YAML, as ``felactl launch --config`` reads it) or a mapping."""
    config: dict[str, Any] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                mapping = yaml.safe_load(item)  # JSON is YAML
            except yaml.YAMLError:
                mapping = None
            if not isinstance(mapping, dict):
                raise SystemExit(f"--job-config {item!r}: expected a mapping")
            config.update(mapping)
        else:
            try:
                config.update(parse_config([item]))
            except InputError as exc:
                raise SystemExit(f"--job-config {item!r}: {exc}") from None
    return config

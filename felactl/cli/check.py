"""``felactl check FILE...``: load any felactl file (kind from its ``kind:``) and summarise it.

A file that loads is well formed: every check lives in the spec classes, so this command is also
how a person (or a test) sees the one-line error a bad file gives, without running anything else.
A plan must also be one the runtime can execute, and given with its cluster and model
(``felactl check plan.yaml cluster.yaml model.yaml``) it must fit them
(:func:`felactl.spec.check_together`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from felactl.cli import output
from felactl.errors import InputError, SpecError
from felactl.spec import ClusterSpec, ModelSpec, Plan, check_together, from_dict
from felactl.spec.io import KINDS, parse_yaml, read_text


def load_any(path: str | os.PathLike) -> ClusterSpec | ModelSpec | Plan:
    """Load a Cluster, Model or Plan file, whichever its ``kind:`` says."""
    where = str(path)
    data = parse_yaml(read_text(path), where)
    if data is None:
        raise SpecError(where, "", "the file is empty")
    if not isinstance(data, dict):
        raise SpecError(where, "", f"must be a mapping with a kind: key, got {type(data).__name__}")
    kind = data.get("kind")
    if kind == "Testbed":  # felactl testbed's format lives with it (felactl.testbed.spec)
        from felactl.testbed.spec import TestbedSpec

        return from_dict(TestbedSpec, data, where)
    if kind not in KINDS:
        if "kind" not in data:
            raise SpecError(where, "kind", f"missing required key (one of {'|'.join([*KINDS, 'Testbed'])})")
        raise SpecError(where, "kind", f"must be one of {'|'.join([*KINDS, 'Testbed'])}, got {kind!r}")
    return from_dict(KINDS[kind], data, where)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def summarize(path: str, spec: ClusterSpec | ModelSpec | Plan) -> dict[str, Any]:
    """The facts of one file for ``--json``, plus ``line``: the same as one sentence."""
    if getattr(spec, "kind", None) == "Testbed":
        facts = {"name": spec.name, "num_nodes": len(spec.nodes), "num_links": len(spec.all_links())}
        line = (
            f"Testbed {spec.name!r}, {_plural(len(spec.nodes), 'node')}, "
            f"{_plural(len(spec.all_links()), 'directed link')}"
        )
    elif isinstance(spec, ClusterSpec):
        defaults = [d for d in (spec.intra_node_default, spec.inter_node_default) if d is not None]
        facts = {
            "name": spec.name,
            "num_nodes": len(spec.nodes),
            "num_devices": len(spec.devices),
            "num_links": len(spec.links),
            "has_default_links": bool(defaults),
        }
        line = (
            f"Cluster {spec.name!r}, {_plural(len(spec.nodes), 'node')}, "
            f"{_plural(len(spec.devices), 'device')}, {_plural(len(spec.links), 'link')}"
            + (" (+ default links)" if defaults else "")
        )
    elif isinstance(spec, ModelSpec):
        device_models = sorted({t.device_model for layer in spec.layers for t in layer.timings})
        facts = {
            "name": spec.name,
            "source": spec.source,
            "num_layers": spec.num_layers,
            "total_params": spec.total_params,
            "device_models": device_models,
        }
        line = (
            f"Model {spec.name!r}, {_plural(spec.num_layers, 'layer')}, {spec.total_params:,} params, "
            f"timed on {_plural(len(device_models), 'device model')}"
        )
    else:
        facts = {
            "cluster": spec.cluster,
            "model": spec.model.name,
            "num_stages": len(spec.stages),
            "num_devices": len(spec.devices),
            "schedule": spec.schedule.value,
            "sync": spec.sync.mode.value,
            "global_batch": spec.global_batch,
        }
        line = (
            f"Plan of {spec.model.name!r} on {spec.cluster!r}, {_plural(len(spec.stages), 'stage')}, "
            f"{_plural(len(spec.devices), 'device')}, schedule {spec.schedule.value}, "
            f"sync {spec.sync.mode.value}, global batch {spec.global_batch}"
        )
    return {"path": path, "kind": spec.kind, **facts, "line": f"{path}: {line}"}


def _check_model_source(where: str, plan: Plan) -> None:
    """The plan's model as ``felactl launch`` checks it before a worker starts: a built-in, or a
    function it can import, that takes the plan's config (a user's typo in a config key passed
    check, then failed the launch). The model is not built."""
    from felactl.models import check_source  # torch: only for a plan

    try:
        check_source(plan.model.source, plan.model.config)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def register(app: typer.Typer) -> None:
    @app.command("check")
    def check(
        files: Annotated[list[Path], typer.Argument(help="Cluster, Model, Plan or Testbed files (YAML or JSON).")],
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    ) -> None:
        """Validate felactl files, given as arguments in any order: a plan against the cluster and
        model files given beside it (felactl check plan.yaml cluster.yaml model.yaml); print one
        line per file, or the first problem (exit 2)."""
        loaded = [(str(path), load_any(path)) for path in files]
        check_together(loaded)
        for where, spec in loaded:
            if isinstance(spec, Plan):
                _check_model_source(where, spec)
        summaries = [summarize(where, spec) for where, spec in loaded]
        output.emit(
            {"files": summaries},
            as_json,
            lambda console: [console.print(s["line"], markup=False, soft_wrap=True) for s in summaries],
        )

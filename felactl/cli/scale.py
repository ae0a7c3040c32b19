"""``felactl scale RUN``: add, remove or set the workers of a running job (signed with its secret)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from felactl import limits
from felactl.cli import output
from felactl.errors import InputError
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT
from felactl.limits import check_flag, split_items


def scale(
    run: Annotated[str, typer.Argument(help="Run id or directory of the running job.")],
    add: Annotated[int | None, typer.Option("--add", help="Start N more workers.")] = None,
    node: Annotated[str | None, typer.Option(help="Node for --add (default: the first node).")] = None,
    remove: Annotated[str | None, typer.Option(help="RANK[,RANK...]: worker ids (metrics' rank) to remove.")] = None,
    to: Annotated[int | None, typer.Option("--to", help="Grow or shrink to N workers.")] = None,
    scaling_policy: Annotated[
        str | None, typer.Option(help="fixed-batch or linear-lr (default: the launch's).")
    ] = None,
    max_batch: Annotated[int | None, typer.Option(help="linear-lr: cap on the global batch.")] = None,
    secret_file: Annotated[Path | None, typer.Option(help="The job secret (default: runs/<id>/secret).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the job to switch.")] = 120.0,
    runs_root: Annotated[Path, typer.Option(help="Where run directories are.")] = DEFAULT_RUNS_ROOT,
    as_json: Annotated[bool, typer.Option("--json", help="Print what changed as one JSON object.")] = False,
) -> None:
    """Rescale a running job. Data parallel: live, the workers that stay keep their processes and
    memory. A pipeline or a sharded stage: it checkpoints a step its workers agree on and restarts
    on the plan for the new workers."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # c10d's connect retries are not the user's news
    from felactl.launcher.scale import request_scale

    chosen = [name for name, value in (("--add", add), ("--remove", remove), ("--to", to)) if value is not None]
    if len(chosen) != 1:
        raise InputError("give exactly one of --add N, --remove RANK[,RANK...], --to N")
    if add is not None:
        command = {"op": "add", "count": add, "node": node}
    elif to is not None:
        command = {"op": "to", "count": to, "node": node}
    else:
        try:
            ranks = [int(r) for r in split_items("--remove", remove, "RANK[,RANK...] (integers)")]
        except ValueError:
            raise InputError(f"--remove {remove!r}: expected RANK[,RANK...] (integers)") from None
        command = {"op": "remove", "ranks": ranks}
    if scaling_policy is not None:
        command.update(scaling_policy=scaling_policy, max_batch=max_batch)
    for flag, count in (("--add", add), ("--to", to)):
        check_flag(flag, count, limits.COUNT)
    check_flag("--max-batch", max_batch, limits.BATCH)
    check_flag("--timeout", timeout, limits.SECONDS, above=0)
    result = request_scale(run, command, runs_root=runs_root, secret_file=secret_file, timeout_s=timeout)
    output.emit(result, as_json, lambda console: console.print(describe(result)))


def describe(result: dict) -> str:
    """One line for a person: what changed, the pause the staying workers saw, what was copied."""
    if result["kind"] == "unchanged":
        return f"unchanged: the job already runs workers {result.get('members')}"
    line = f"{result['kind']}: workers {result.get('members_before')} -> {result.get('members_after')}"
    if result.get("pause_s") is not None:
        line += f", pause {result['pause_s']:.3f} s"
    if result.get("replicated_bytes"):
        senders = ", ".join(sorted(result.get("replicated_from") or {}))
        line += f", {result['replicated_bytes'] / 1e6:.1f} MB replicated" + (f" from {senders}" if senders else "")
    return line


def register(app: typer.Typer) -> None:
    app.command("scale")(scale)

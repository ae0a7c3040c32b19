"""``felactl scale RUN``: add, remove or set the workers of a running job (signed with its secret)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from felactl import limits
from felactl.cli import output
from felactl.cli.options import takes_options
from felactl.errors import InputError
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT
from felactl.limits import check_flag, split_items


@dataclass(frozen=True, kw_only=True)
class ScaleCommandOptions:
    """The parameters of ``felactl scale`` (see ``felactl scale --help``)."""

    run: Annotated[str, typer.Argument(help="Run id or directory of the running job.")]
    add: Annotated[int | None, typer.Option("--add", help="Start N more workers.")] = None
    node: Annotated[str | None, typer.Option(help="Node for --add (default: the first node).")] = None
    slurm_nodes: Annotated[
        int | None,
        typer.Option(
            "--slurm-nodes",
            help="Ask Slurm for N more nodes (a batch job of their agents, sbatch) and run --nproc-per-node workers "
            "on each once granted; --remove of all their workers gives them back (scancel).",
        ),
    ] = None
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", help="--slurm-nodes: workers per node.")] = 1
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option("--sbatch-arg", help="--slurm-nodes: an option for sbatch, e.g. --sbatch-arg=--partition=a10g."),
    ] = None
    remove: Annotated[str | None, typer.Option(help="RANK[,RANK...]: worker ids (metrics' rank) to remove.")] = None
    to: Annotated[int | None, typer.Option("--to", help="Grow or shrink to N workers.")] = None
    scaling_policy: Annotated[str | None, typer.Option(help="fixed-batch or linear-lr (default: the launch's).")] = None
    max_batch: Annotated[int | None, typer.Option(help="linear-lr: cap on the global batch.")] = None
    secret_file: Annotated[Path | None, typer.Option(help="The job secret (default: runs/<id>/secret).")] = None
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the job to switch.")] = 120.0
    runs_root: Annotated[Path, typer.Option(help="Where run directories are.")] = DEFAULT_RUNS_ROOT
    as_json: Annotated[bool, typer.Option("--json", help="Print what changed as one JSON object.")] = False


@takes_options(ScaleCommandOptions)
def scale(options: ScaleCommandOptions) -> None:
    """Rescale a running job. Data parallel: live, the workers that stay keep their processes and
    memory. A pipeline or a sharded stage: it checkpoints a step its workers agree on and restarts
    on the plan for the new workers."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # c10d's connect retries are not the user's news
    from felactl.launcher.slurm_scale import rescale

    o = options
    ops = (("--add", o.add), ("--remove", o.remove), ("--to", o.to), ("--slurm-nodes", o.slurm_nodes))
    if len([name for name, value in ops if value is not None]) != 1:
        raise InputError("give exactly one of --add N, --remove RANK[,RANK...], --to N, --slurm-nodes N")
    check_flag("--timeout", o.timeout, limits.SECONDS, above=0)
    _refuse_flags_of_the_other_kind(o)
    if o.slurm_nodes is not None:
        result = _grow_through_slurm(o)
    else:
        result = rescale(o.run, _command(o), runs_root=o.runs_root, secret_file=o.secret_file, timeout_s=o.timeout)
    output.emit(result, o.as_json, lambda console: console.print(describe(result)))


def _refuse_flags_of_the_other_kind(o: ScaleCommandOptions) -> None:
    """A flag of ``--slurm-nodes`` without it, or one it does not take with it: one line, not ignored."""
    if o.slurm_nodes is None:
        given = [
            flag
            for flag, value in (("--nproc-per-node", o.nproc_per_node != 1 or None), ("--sbatch-arg", o.sbatch_arg))
            if value
        ]
        if given:
            raise InputError(f"{given[0]}: only with --slurm-nodes (the workers of --add go to a node's agent)")
        return
    given = [
        flag
        for flag, value in (
            ("--node", o.node),
            ("--secret-file", o.secret_file),
            ("--scaling-policy", o.scaling_policy),
        )
        if value is not None
    ]
    if given:
        raise InputError(
            f"{given[0]}: not with --slurm-nodes (Slurm chooses the nodes; the run's own secret file is used)"
        )


def _command(o: ScaleCommandOptions) -> dict:
    """The signed request's command: add, to or remove (with a scaling policy where given)."""
    if o.add is not None:
        command = {"op": "add", "count": o.add, "node": o.node}
    elif o.to is not None:
        command = {"op": "to", "count": o.to, "node": o.node}
    else:
        try:
            ranks = [int(r) for r in split_items("--remove", o.remove, "RANK[,RANK...] (integers)")]
        except ValueError:
            raise InputError(f"--remove {o.remove!r}: expected RANK[,RANK...] (integers)") from None
        command = {"op": "remove", "ranks": ranks}
    if o.scaling_policy is not None:
        command.update(scaling_policy=o.scaling_policy, max_batch=o.max_batch)
    for flag, count in (("--add", o.add), ("--to", o.to)):
        check_flag(flag, count, limits.COUNT)
    check_flag("--max-batch", o.max_batch, limits.BATCH)
    return command


def _grow_through_slurm(o: ScaleCommandOptions) -> dict:
    from felactl.launcher.slurm_scale import grow

    check_flag("--slurm-nodes", o.slurm_nodes, limits.COUNT)
    check_flag("--nproc-per-node", o.nproc_per_node, limits.COUNT)
    return grow(
        o.run,
        o.slurm_nodes,
        nproc_per_node=o.nproc_per_node,
        sbatch_args=tuple(o.sbatch_arg or ()),
        runs_root=o.runs_root,
        timeout_s=o.timeout,
    )


def describe(result: dict) -> str:
    """One line for a person: what changed, the pause the staying workers saw, what was copied."""
    if result["kind"] == "unchanged":
        return f"unchanged: the job already runs workers {result.get('members')}"
    line = f"{result['kind']}: workers {result.get('members_before')} -> {result.get('members_after')}"
    if result.get("pause_s") is not None:
        line += f", pause {result['pause_s']:.3f} s"
    if result.get("slurm_job"):
        line += f", on {', '.join(result['nodes'])} (Slurm job {result['slurm_job']})"
    if result.get("slurm_released"):
        line += f", Slurm job(s) {', '.join(result['slurm_released'])} released"
    if result.get("replicated_bytes"):
        senders = ", ".join(sorted(result.get("replicated_from") or {}))
        line += f", {result['replicated_bytes'] / 1e6:.1f} MB replicated" + (f" from {senders}" if senders else "")
    return line


def register(app: typer.Typer) -> None:
    app.command("scale")(scale)

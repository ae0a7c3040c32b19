"""``felactl agent``: join a coordinator with this node's worker slots and run what it assigns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from felactl import limits
from felactl.cli import output
from felactl.cli.options import takes_options
from felactl.errors import WorkerFailed
from felactl.limits import check_flag


@dataclass(frozen=True, kw_only=True)
class AgentCommandOptions:
    """The parameters of ``felactl agent`` (see ``felactl agent --help``)."""

    rdzv_endpoint: Annotated[str, typer.Option(help="HOST:PORT of the coordinator.")]
    secret_file: Annotated[Path, typer.Option(help="The job secret file ('-' reads it from stdin).")]
    nproc_per_node: Annotated[
        int | None,
        typer.Option("--nproc-per-node", min=1, help="Worker slots on this node (default: the GPUs, else 2)."),
    ] = None
    node_name: Annotated[
        str | None,
        typer.Option(help="This node's name (default: the testbed node it runs in, else the short hostname)."),
    ] = None
    log_dir: Annotated[Path | None, typer.Option(help="Worker logs (default: a new temp dir).")] = None
    job: Annotated[
        str | None,
        typer.Option(
            help="Job name on the control plane (default: the job the coordinator at --rdzv-endpoint runs: a "
            "`felactl profile` or the run id of a `felactl launch`)."
        ),
    ] = None
    join_timeout: Annotated[float, typer.Option(help="Seconds to reach and join the coordinator.")] = 60.0
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False


@takes_options(AgentCommandOptions)
def agent(options: AgentCommandOptions) -> None:
    """Join the job at --rdzv-endpoint (proving the secret), run its workers, exit when they end."""
    import os

    # c10d logs a C++ stack trace at warning level when the store goes away; we say it in one line.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    from felactl.agents.local_node import local_agent_config, run_joining_agent, temp_log_dir
    from felactl.control.documents import WorkerState
    from felactl.launcher.controlplane import read_secret_file
    from felactl.launcher.profile import default_nproc_per_node

    check_flag("--nproc-per-node", options.nproc_per_node, limits.COUNT)
    check_flag("--join-timeout", options.join_timeout, limits.SECONDS, above=0)
    secret = read_secret_file(options.secret_file)
    config = local_agent_config(
        options.rdzv_endpoint,
        secret,
        nproc=options.nproc_per_node or default_nproc_per_node(),
        node_name=options.node_name,
        log_dir=options.log_dir or temp_log_dir(),
        join_timeout_s=options.join_timeout,
        job=options.job,
    )
    output.stderr.print(f"agent {config.node_name}: joining {options.rdzv_endpoint} with {config.nproc} slot(s)")
    result, logs = run_joining_agent(
        config,
        temp_logs=options.log_dir is None,
        on_joined=lambda agent_id: output.stderr.print(f"joined as {agent_id}"),
    )
    if result.state is WorkerState.FAILED:
        failures = "; ".join(f"rank {rank}: {line}" for rank, line in result.failures.items())
        raise WorkerFailed(f"workers failed ({failures}); logs in {logs}")
    output.emit(
        {
            "node_name": config.node_name,
            "state": result.state.value,
            "exit_codes": {str(k): v for k, v in result.exit_codes.items()},
            "log_dir": str(logs) if logs else None,
        },
        options.as_json,
        lambda console: console.print(
            f"agent {config.node_name}: workers {result.state.value}" + (f"; logs in {logs}" if logs else "")
        ),
    )


def register(app: typer.Typer) -> None:
    app.command("agent")(agent)

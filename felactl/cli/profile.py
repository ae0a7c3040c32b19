"""``felactl profile``: measure this machine (or the nodes that join) into cluster.yaml.

With ``--model NAME`` it profiles a model's layers into model.yaml instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from felactl import limits
from felactl.cli import output
from felactl.cli.options import takes_options
from felactl.errors import InputError
from felactl.limits import check_flag, split_items

if TYPE_CHECKING:
    from felactl.launcher.profile import ProfileOptions


def _parse_batch_sizes(text: str) -> list[int]:
    expected = "comma-separated integers"
    try:
        sizes = [int(part) for part in split_items("--batch-sizes", text, expected)]
    except ValueError:
        raise InputError(f"--batch-sizes: expected {expected}, got {text!r}") from None
    for size in sizes:
        check_flag("--batch-sizes", size, limits.BATCH)
    return sizes


def render_cluster(console, result) -> None:
    cluster = result.cluster
    devices = Table(title=f"cluster {cluster.name}: {len(cluster.nodes)} node(s)")
    for column in ("device", "node", "kind", "model", "TFLOP/s", "bf16 TFLOP/s", "memory GB", "cores"):
        devices.add_column(column)
    for node in cluster.nodes:
        for dev in node.devices:
            devices.add_row(
                dev.name,
                node.name,
                dev.kind.value,
                dev.model,
                f"{dev.tflops:.3f}",
                f"{dev.bf16_tflops:.2f}" if dev.bf16_tflops else "-",
                f"{dev.memory_gb:.1f}",
                ",".join(map(str, dev.cpu_cores)) if dev.cpu_cores else "-",
            )
    links = Table(title="links (measured send/recv, median)")
    for column in ("src", "dst", "type", "GB/s", "latency µs"):
        links.add_column(column)
    for link in cluster.links:
        links.add_row(
            link.src,
            link.dst,
            link.type.value + (f" x{link.num_links}" if link.num_links > 1 else ""),
            f"{link.bandwidth_gbps:.3f}",
            f"{link.latency_us:.1f}",
        )
    console.print(devices)
    console.print(links)
    for pair, gbps in result.peer_copy_gbps.items():
        console.print(f"peer copy {pair}: {gbps:.1f} GB/s")
    console.print(
        f"profiled in {result.profile_s:.1f} s" + (f"; worker logs in {result.log_dir}" if result.log_dir else "")
    )


BATCH_SIZES_DEFAULT = "1,4,16,64"


@dataclass(frozen=True, kw_only=True)
class ClusterFlags:
    """Which cluster ``felactl profile`` measures and where its job keeps its files, as given."""

    nproc_per_node: int | None
    nnodes: int
    rdzv_endpoint: str | None
    hostfile: Path | None
    secret_file: Path | None
    node_name: str | None
    name: str | None
    log_dir: Path | None
    testbed: str | None
    slurm: bool


@dataclass(frozen=True, kw_only=True)
class ProfileCommandOptions:
    """The parameters of ``felactl profile`` (see ``felactl profile --help``)."""

    nproc_per_node: Annotated[
        int | None,
        typer.Option("--nproc-per-node", min=1, help="Worker slots on this node (default: the GPUs, else 2)."),
    ] = None
    out: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Where to write (default: cluster.yaml, model.yaml with --model)."),
    ] = None
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False
    name: Annotated[str | None, typer.Option(help="Cluster name (default: the node name).")] = None
    node_name: Annotated[
        str | None,
        typer.Option(
            help="This node's name (default: the short hostname); with "
            "--model --cluster, this machine's node in the cluster."
        ),
    ] = None
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto"
    matmul_size: Annotated[
        int,
        typer.Option(help="CPU matmul side for TFLOP/s (with --model: the profiled CPU's, recorded as timed_tflops)."),
    ] = 512
    gpu_matmul_size: Annotated[int, typer.Option(help="GPU matmul side for TFLOP/s.")] = 4096
    message_bytes: Annotated[int, typer.Option(help="Message size for bandwidth.")] = 16 * 2**20
    small_message_bytes: Annotated[int, typer.Option(help="Message size for latency.")] = 8
    repetitions: Annotated[
        int,
        typer.Option(help="Timed repetitions (median taken; a device's are blocks of matmuls of at least 0.1 s each)."),
    ] = 5
    hostfile: Annotated[Path | None, typer.Option(help="DeepSpeed hostfile: start an agent on each host over ssh.")] = (
        None
    )
    rdzv_endpoint: Annotated[str | None, typer.Option(help="HOST:PORT the coordinator listens on for agents.")] = None
    nnodes: Annotated[int, typer.Option(help="Agents to wait for with --rdzv-endpoint.")] = 1
    testbed: Annotated[
        str | None,
        typer.Option(
            help="Profile the nodes of this testbed (felactl testbed up SPEC --name NAME): an agent in each node's "
            "namespace and cgroup, --nproc-per-node slots each (default 1). With --model: time the model in "
            "every node at once, each node's timings keyed by its CPU share."
        ),
    ] = None
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm/--no-slurm",
            help="Inside a Slurm allocation (SLURM_JOB_ID set): profile its nodes, an agent per node as a job step "
            "(srun), --nproc-per-node slots each (default: the node's GPUs, else 2); a heterogeneous job's "
            "components are one cluster. --no-slurm: this machine only.",
        ),
    ] = True
    secret_file: Annotated[Path | None, typer.Option(help="Job secret (created with mode 0600 if missing).")] = None
    log_dir: Annotated[Path | None, typer.Option(help="Worker logs (default: a new temp dir).")] = None
    join_timeout: Annotated[float, typer.Option(help="Seconds to wait for agents.")] = 60.0
    timeout: Annotated[float, typer.Option(help="Seconds the measurement may take.")] = 600.0
    model: Annotated[str | None, typer.Option(help="Profile this model's layers into model.yaml instead.")] = None
    batch_sizes: Annotated[
        str | None, typer.Option(help=f"Micro-batch sizes for --model (default {BATCH_SIZES_DEFAULT}).")
    ] = None
    config: Annotated[list[str] | None, typer.Option("--config", help="--model config key=value (repeat).")] = None
    input_shape: Annotated[
        str | None,
        typer.Option(help="--model: one input sample's shape, e.g. 3,32,32 (user models that bring no data)."),
    ] = None
    cluster: Annotated[
        Path | None,
        typer.Option(
            "--cluster",
            help="--model: time it as this cluster's CPU slots on this machine will run it (beside "
            "the other slots training, and their data-parallel sync measured).",
        ),
    ] = None
    worker_batch: Annotated[
        int | None,
        typer.Option(
            help="--model --cluster: samples per worker step for the sync timing (default: the middle --batch-sizes).",
            min=1,
        ),
    ] = None


CLUSTER_ONLY = (
    "nproc_per_node",
    "nnodes",
    "rdzv_endpoint",
    "hostfile",
    "secret_file",
    "name",
    "log_dir",
    "join_timeout",
    "gpu_matmul_size",
    "message_bytes",
    "small_message_bytes",
)
"""The parameters only a cluster's profile reads; ``--model`` refuses them (:func:`_refuse_given`)."""
MODEL_ONLY = ("config", "input_shape", "cluster", "worker_batch", "batch_sizes")
"""The parameters only a model's profile reads; refused without ``--model``."""


@takes_options(ProfileCommandOptions, context=True)
def profile(ctx: typer.Context, options: ProfileCommandOptions) -> None:
    """Measure devices and the link between every ordered pair of worker slots; write cluster.yaml."""
    if options.model is not None:
        _refuse_given(ctx, CLUSTER_ONLY, "is for profiling a cluster, not with --model")
        _profile_model(options)
        return
    _refuse_given(ctx, MODEL_ONLY, "is for profiling a model: add --model NAME")
    from felactl.launcher.profile import ProfileOptions
    from felactl.profiling.links import LinkProbe

    measurement = ProfileOptions(
        cpu_matmul_size=options.matmul_size,
        gpu_matmul_size=options.gpu_matmul_size,
        device=options.device,
        probe=LinkProbe(
            message_bytes=options.message_bytes,
            small_message_bytes=options.small_message_bytes,
            repetitions=options.repetitions,
        ),
        join_timeout_s=options.join_timeout,
        timeout_s=options.timeout,
    )
    where = ClusterFlags(
        nproc_per_node=options.nproc_per_node,
        nnodes=options.nnodes,
        rdzv_endpoint=options.rdzv_endpoint,
        hostfile=options.hostfile,
        secret_file=options.secret_file,
        node_name=options.node_name,
        name=options.name,
        log_dir=options.log_dir,
        testbed=options.testbed,
        slurm=options.slurm,
    )
    _profile_cluster(where, measurement, options.out, options.as_json)


def _profile_model(options: ProfileCommandOptions) -> None:
    """``felactl profile --model``: the model's layers into model.yaml (:mod:`felactl.cli.model_profile`)."""
    from felactl.cli import model_profile

    flags = model_profile.ModelProfileFlags(
        model=options.model,
        batch_sizes=_parse_batch_sizes(BATCH_SIZES_DEFAULT if options.batch_sizes is None else options.batch_sizes),
        out=options.out,
        as_json=options.as_json,
        config=options.config,
        input_shape=options.input_shape,
        device=options.device,
        repeats=options.repetitions,
        cluster=options.cluster,
        node=options.node_name,
        worker_batch=options.worker_batch,
        matmul_size=options.matmul_size,
        testbed=options.testbed,
        timeout_s=options.timeout,
    )
    model_profile.run(flags)


def _refuse_given(ctx: typer.Context, names: tuple[str, ...], why: str) -> None:
    """Refuse the first of the parameters ``names`` typed on the command line, naming its flag.
    Typed, not valued: ``--nnodes 1`` with ``--model`` is refused too, though 1 is its default."""
    given = [
        max(param.opts, key=len)
        for param in ctx.command.params
        # by name: typer's vendored click and click itself each have their own ParameterSource
        if param.name in names and getattr(ctx.get_parameter_source(param.name), "name", None) == "COMMANDLINE"
    ]
    if given:
        raise InputError(f"{given[0]} {why}")


def _profile_cluster(where: ClusterFlags, options: ProfileOptions, out: Path | None, as_json: bool) -> None:
    """Profile the cluster ``where`` says with ``options``, write it, show it."""
    from felactl.launcher.profile import check_profile_flags, profile_cluster
    from felactl.launcher.slurm import current_allocation, slurm_applies
    from felactl.spec import save, to_dict

    # Bad input is said before the progress bar opens (a transient bar leaves a blank line).
    check_profile_flags(where.nproc_per_node, where.nnodes, where.rdzv_endpoint, where.hostfile, where.testbed)
    applies = slurm_applies(where.slurm, where.testbed, where.hostfile, where.rdzv_endpoint)
    slurm = current_allocation() if applies else None
    with output.progress() as bar:
        task = bar.add_task("starting", total=None)

        def on_progress(phase: str, done: int, total: int) -> None:
            bar.update(task, description=phase, completed=done, total=total)

        result = profile_cluster(
            nproc_per_node=where.nproc_per_node,
            nnodes=where.nnodes,
            endpoint=where.rdzv_endpoint,
            hostfile_path=str(where.hostfile) if where.hostfile else None,
            secret_file=str(where.secret_file) if where.secret_file else None,
            node_name=where.node_name,
            name=where.name,
            log_dir=where.log_dir,
            options=options,
            on_progress=on_progress,
            testbed=where.testbed,
            slurm=slurm,
        )
    path = save(result.cluster, out or Path("cluster.yaml"))
    payload = {**to_dict(result.cluster), "profile_s": round(result.profile_s, 3)}
    if result.peer_copy_gbps:
        payload["peer_copy_gbps"] = result.peer_copy_gbps

    def render(console) -> None:
        render_cluster(console, result)
        console.print(f"wrote {path}")

    output.emit(payload, as_json, render)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile)

"""``felactl testbed up|down|status|exec``: an emulated uneven cluster on this Linux machine.

Nodes are network namespaces joined by shaped veth links, each node with its own CPU share and
pinned cores (:mod:`felactl.testbed`). Needs root.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from felactl.cli import output
from felactl.cli.options import HELP_SETTINGS
from felactl.errors import InputError
from felactl.testbed.state import DEFAULT_NAME

testbed_app = typer.Typer(
    help="An emulated uneven cluster on this machine: nodes as network namespaces with shaped links "
    "(bandwidth, latency, loss per direction) and their own CPU shares. Needs root.",
    no_args_is_help=True,
    **HELP_SETTINGS,
)

NameOption = Annotated[
    str,
    typer.Option(
        "--name",
        help="The testbed's name (a letter, then up to 7 letters or digits); several testbeds may be up at once.",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print what changed as one JSON object.")]


def _describe(state) -> dict:
    from felactl.testbed.faults import cut_nodes, partitioned

    spec = state.spec
    links = []
    from felactl.spec.io import from_dict
    from felactl.testbed.spec import TestbedSpec

    tb = from_dict(TestbedSpec, spec, state.spec_path)
    for link in tb.all_links():
        links.append(
            {
                "src": link.src,
                "dst": link.dst,
                "bandwidth_gbps": link.bandwidth_gbps,
                "latency_us": link.latency_us,
                "loss": link.loss,
            }
        )
    return {
        "name": state.name,
        "spec": state.spec_path,
        "testbed": tb.name,
        "latency_emulated": state.netem,
        "cgroup_version": state.cgroup_version,
        "slurm_conf": state.slurm_conf,
        "nodes": [
            {
                "name": n.name,
                "netns": n.netns,
                "address": n.address,
                "ifname": n.ifname,
                "cpus": n.cpus,
                "cores": list(n.cores),
                "cgroups": list(n.cgroups),
            }
            for n in state.nodes.values()
        ],
        "links": links,
        "cut": cut_nodes(state.name),
        "partitioned": partitioned(state.name),
    }


def _render(result: dict):
    def render(console) -> None:
        console = output.wide(console)
        nodes = Table(title=f"testbed {result['name']} ({result['testbed']}, {result['spec']})")
        for col in ("node", "namespace", "address", "cpus", "cores"):
            nodes.add_column(col)
        for n in result["nodes"]:
            nodes.add_row(
                n["name"],
                n["netns"],
                f"{n['address']} ({n['ifname']})",
                "-" if n["cpus"] is None else f"{n['cpus']:g}",
                ",".join(map(str, n["cores"])),
            )
        console.print(nodes)
        links = Table(title="links")
        for col in ("src -> dst", "GB/s", "latency us", "loss"):
            links.add_column(col)
        for link in result["links"]:
            links.add_row(
                f"{link['src']} -> {link['dst']}",
                f"{link['bandwidth_gbps']:g}",
                f"{link['latency_us']:g}"
                + ("" if result["latency_emulated"] or not link["latency_us"] else " (not emulated)"),
                f"{link['loss']:g}",
            )
        console.print(links)
        if result.get("cut"):
            console.print("cut off: " + ", ".join(result["cut"]))
        if result.get("partitioned"):
            console.print("partitioned: " + ", ".join(result["partitioned"]) + " apart from the other nodes")
        if not result["latency_emulated"]:
            console.print("latency is not emulated: this kernel has no netem qdisc")
        if result.get("slurm_conf"):
            console.print(f"Slurm: export SLURM_CONF={result['slurm_conf']}  (then sinfo, sbatch -N 2 job.sh)")

    return render


@testbed_app.command("up")
def up_command(
    spec: Annotated[Path, typer.Argument(help="A Testbed file (plans/testbeds/*.yaml).")],
    name: NameOption = DEFAULT_NAME,
    no_latency: Annotated[
        bool,
        typer.Option(
            "--no-latency",
            help="Build it even where the kernel cannot add latency (no netem): bandwidth, loss and CPU shares only.",
        ),
    ] = False,
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm",
            help="Run a Slurm cluster of its nodes too: munge, slurmctld here, a slurmd in every node, a partition "
            "per CPU share (Debian's slurm-wlm and munge). Then `SLURM_CONF=... sbatch -N 2 job.sh`.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the testbed as one JSON object.")] = False,
) -> None:
    """Build the testbed SPEC: one namespace, veth and cgroup per node, links shaped per direction.
    Remove it with `felactl testbed down`."""
    from felactl.testbed import load_testbed, up

    tb = load_testbed(spec)
    state = up(tb, str(spec), name=name, allow_no_latency=no_latency, slurm=slurm)
    output.emit(_describe(state), as_json, _render(_describe(state)))


@testbed_app.command("down")
def down_command(
    name: NameOption = DEFAULT_NAME,
    all_: Annotated[bool, typer.Option("--all", help="Remove every felactl testbed on this machine.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was removed as one JSON object.")] = False,
) -> None:
    """Remove a testbed (also one whose `up` crashed half-way): kill the processes in its nodes, delete
    its namespaces, veth pairs, bridge and cgroups. Nothing there is not an error."""
    from felactl.testbed import down, list_testbeds

    names = list_testbeds() if all_ else [name]
    removed = {n: down(n) for n in names}
    result = {"removed": removed}

    def render(console) -> None:
        if not any(any(v.values()) for v in removed.values()):
            console.print("nothing to remove" if not all_ else "no felactl testbed on this machine")
        for n, what in removed.items():
            if any(what.values()):
                console.print(
                    f"testbed {n}: removed {len(what['netns'])} namespace(s), {len(what['links'])} "
                    f"link(s), {len(what['cgroups'])} cgroup tree(s), "
                    f"killed {len(what['processes'])} process(es)"
                    + (", stopped its Slurm" if what.get("slurm") else "")
                )

    output.emit(result, as_json, render)


@testbed_app.command("status")
def status_command(
    name: NameOption = DEFAULT_NAME,
    as_json: Annotated[bool, typer.Option("--json", help="Print the testbed as one JSON object.")] = False,
) -> None:
    """Show a testbed that is up: its nodes (namespace, address, CPU share) and links."""
    from felactl.testbed import read_state

    result = _describe(read_state(name))
    output.emit(result, as_json, _render(result))


@testbed_app.command("link")
def link_command(
    src: Annotated[str, typer.Argument(help="The node the data leaves from.")],
    dst: Annotated[str, typer.Argument(help="The node it arrives at.")],
    bandwidth_gbps: Annotated[float | None, typer.Option("--bandwidth-gbps", help="New bandwidth, GB/s.")] = None,
    latency_us: Annotated[float | None, typer.Option("--latency-us", help="New one-way latency, us (netem).")] = None,
    loss: Annotated[float | None, typer.Option("--loss", help="New loss, 0..1 (1 cuts the link).")] = None,
    name: NameOption = DEFAULT_NAME,
    as_json: Annotated[bool, typer.Option("--json", help="Print the new link as one JSON object.")] = False,
) -> None:
    """Change one direction of a link of a testbed that is up, while traffic flows: `--loss 1` cuts
    SRC -> DST, `--loss 0` heals it."""
    from felactl.limits import SHARE, check_flag
    from felactl.spec.codec import encode
    from felactl.testbed.shaping import set_link
    from felactl.testbed.spec import BANDWIDTH_GBPS, LATENCY_US

    if bandwidth_gbps is None and latency_us is None and loss is None:
        raise InputError("give what to change: --bandwidth-gbps, --latency-us and/or --loss")
    check_flag("--bandwidth-gbps", bandwidth_gbps, BANDWIDTH_GBPS)  # before the testbed is looked up
    check_flag("--latency-us", latency_us, LATENCY_US)
    check_flag("--loss", loss, SHARE)
    new = encode(set_link(name, src, dst, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us, loss=loss))
    output.emit(
        new,
        as_json,
        lambda console: console.print(
            f"{src} -> {dst}: {new['bandwidth_gbps']:g} GB/s, {new['latency_us']:g} us, loss {new['loss']:g}"
        ),
    )


@testbed_app.command("cut")
def cut_command(
    node: Annotated[str, typer.Argument(help="The node to cut off.")],
    name: NameOption = DEFAULT_NAME,
    as_json: JsonOption = False,
) -> None:
    """Cut NODE off the testbed, as a lost machine: every packet to and from it (its peers and the
    control plane alike) is dropped, and open connections hang. `felactl testbed heal NODE` undoes it."""
    from felactl.testbed.faults import cut_node

    cut_node(name, node, cut=True)
    output.emit({"node": node, "cut": True}, as_json, lambda console: console.print(f"{node}: cut off"))


@testbed_app.command("crash")
def crash_command(
    node: Annotated[str, typer.Argument(help="The node to crash.")],
    name: NameOption = DEFAULT_NAME,
    as_json: JsonOption = False,
) -> None:
    """SIGKILL every process in NODE (its namespace and cgroup), as a machine that loses power."""
    from felactl.testbed.faults import crash_node

    pids = crash_node(name, node)
    output.emit(
        {"node": node, "killed": pids},
        as_json,
        lambda console: console.print(f"{node}: killed {len(pids)} process(es)"),
    )


@testbed_app.command("heal")
def heal_command(
    node: Annotated[str, typer.Argument(help="The node to connect again.")],
    name: NameOption = DEFAULT_NAME,
    as_json: JsonOption = False,
) -> None:
    """Connect NODE again after `felactl testbed cut`."""
    from felactl.testbed.faults import cut_node

    cut_node(name, node, cut=False)
    output.emit({"node": node, "cut": False}, as_json, lambda console: console.print(f"{node}: connected again"))


@testbed_app.command("partition")
def partition_command(
    nodes: Annotated[
        str | None, typer.Argument(help="The nodes on one side, comma-separated (the rest are the other side).")
    ] = None,
    heal: Annotated[bool, typer.Option("--heal", help="Join the two sides again.")] = False,
    name: NameOption = DEFAULT_NAME,
    as_json: JsonOption = False,
) -> None:
    """Partition the testbed in two: NODES and the others can no longer reach each other (loss 1 on
    every link between them, both ways), while every node still reaches the control plane on the
    host, as a failed switch between two racks. `--heal` restores the links' loss."""
    from felactl.testbed.faults import partition_nodes

    if heal == bool(nodes):
        raise InputError("give the nodes of one side (felactl testbed partition NA,NB), or --heal alone")
    side = partition_nodes(name, [] if heal else [n for n in nodes.split(",") if n], apart=not heal)
    what = "joined again" if heal else "apart from the other nodes"
    output.emit(
        {"side": side, "partitioned": not heal}, as_json, lambda console: console.print(f"{', '.join(side)}: {what}")
    )


@testbed_app.command("exec", context_settings={"ignore_unknown_options": True})
def exec_command(
    node: Annotated[str, typer.Argument(help="The node to run in.")],
    command: Annotated[list[str] | None, typer.Argument(help="The command and its arguments (after --).")] = None,
    name: NameOption = DEFAULT_NAME,
) -> None:
    """Run a command in NODE: in its namespace (it sees only its own interface, fl0) and its cgroup (its CPU
    share and cores). GLOO_SOCKET_IFNAME, FELACTL_TESTBED_NODE and FELACTL_TESTBED_ADDR are set.
    Exits with the command's exit code."""
    from felactl.testbed import exec_in_node

    command = list(command or ())
    if command[:1] == ["--"]:  # a separator click left in the arguments
        command = command[1:]
    if not command:
        raise InputError("give the command to run: felactl testbed exec NODE -- CMD [ARGS...]")
    raise typer.Exit(exec_in_node(name, node, command))


def register(app: typer.Typer) -> None:
    app.add_typer(testbed_app, name="testbed")

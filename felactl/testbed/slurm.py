"""A real Slurm in a testbed (``felactl testbed up SPEC --slurm``): munge, ``slurmctld`` on the
host, listening on the bridge, and one ``slurmd`` in every node, so that ``sbatch -N 2`` runs
across the emulated nodes, over their uneven links and CPU shares, as on a cluster.

Everything lives in the testbed's Slurm directory (``/run/felactl/testbeds/<name>-slurm``): its
own munge key and socket, ``slurm.conf`` (the client commands read it through ``SLURM_CONF``),
the controller's state, each node's spool and log. Nothing is written to ``/etc``; ``down``
stops the daemons and removes the directory.

Each ``slurmd`` runs in its node's cgroup (its CPU share: the job steps it starts stay in it, as
no Slurm cgroup plugin is configured to move them) and its network namespace, entered with
``nsenter --net`` (``ip netns exec`` remounts ``/sys``, where slurmd looks for the cgroup file
system). Every node shares this machine's hostname, so each slurmd is given its node's name
(``-N``) and a job learns where it runs from ``SLURMD_NODENAME``, never from ``hostname``. A
task prolog puts the node's testbed environment (gloo's interface, the CPU share its profiles are
keyed by: :func:`~felactl.testbed.processes.node_env`) into every job step. Partitions: one per CPU
share (``cpu45``: the nodes at 0.45 of a core, as a real cluster has one per GPU type) and
``all``, the default.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from felactl.machine import CPU_QUOTA_ENV
from felactl.testbed.host import TestbedError, TestbedUnavailable
from felactl.testbed.network import IFNAME
from felactl.testbed.state import state_dir

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")
"""What ``--slurm`` runs: Debian's ``slurm-wlm`` and ``munge`` packages."""
INSTALL_HINT = "apt-get install slurm-wlm munge"
SLURMD_PORT = 6818
"""Every slurmd listens on its own node's address, so one port serves them all."""
READY_TIMEOUT_S = 60.0


def slurm_dir(name: str) -> Path:
    return state_dir() / f"{name}-slurm"


def conf_path(name: str) -> Path:
    """The testbed's ``slurm.conf``: ``SLURM_CONF`` for ``sbatch``, ``srun``, ``sinfo`` ..."""
    return slurm_dir(name) / "slurm.conf"


def client_env(name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a Slurm command on this machine needs to reach testbed ``name``'s Slurm."""
    env = dict(os.environ if base is None else base)
    env["SLURM_CONF"] = str(conf_path(name))
    return env


def require_slurm() -> None:
    """Refuse (exit 2, one line) where Slurm's or munge's programs are missing."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise TestbedUnavailable(
            f"--slurm: {', '.join(missing)} not installed (Debian: {INSTALL_HINT}; as root: "
            "python -m felactl.testbed.slurm --install)"
        )


def partition_name(cpus: float | None) -> str:
    """The partition of the nodes at this CPU share: ``cpu45`` for 0.45 of a core (``cpu`` unlimited)."""
    return "cpu" if cpus is None else f"cpu{round(cpus * 100)}"


def write_conf(doc: dict[str, Any], controller_port: int) -> Path:
    """``slurm.conf`` and the task prolog for the testbed the state document ``doc`` describes."""
    where = slurm_dir(doc["name"])
    nodes = doc["nodes"]
    prolog = where / "task-prolog.sh"
    prolog.write_text(_task_prolog(doc))
    prolog.chmod(0o755)
    lines = [
        f"# felactl testbed {doc['name']}: written by `felactl testbed up --slurm`, removed by `down`",
        f"ClusterName=felactl-{doc['name']}",
        f"SlurmctldHost={socket.gethostname().split('.')[0]}({doc['host_address']})",
        f"SlurmctldPort={controller_port}",
        f"SlurmdPort={SLURMD_PORT}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # a job's credential stays revoked cred_expire s after it ends, and a requeued job waits as long
        # (Slurm's 120 s would hold a requeue test for two minutes; started sooner, slurmd refuses it)
        f"AuthInfo=socket={where / 'munge.sock'},cred_expire=10",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={where / 'ctld'}",
        f"SlurmdSpoolDir={where / 'spool-%n'}",
        f"SlurmctldPidFile={where / 'slurmctld.pid'}",
        f"SlurmdPidFile={where / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={where / 'slurmctld.log'}",
        f"SlurmdLogFile={where / 'slurmd-%n.log'}",
        # no cgroup plugin: a node's job steps stay in the cgroup its slurmd runs in (its CPU share)
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=1",  # heterogeneous jobs start from the backfill pass only
        "ReturnToService=2",
        "SlurmdTimeout=10",  # a lost node is marked down within seconds (its jobs decide what follows)
        "InactiveLimit=0",
        "KillWait=5",
        f"TaskProlog={prolog}",
    ]
    for node in nodes:
        lines.append(f"NodeName={node['name']} NodeAddr={node['address']} CPUs={len(node['cores'])} State=UNKNOWN")
    by_share: dict[str, list[str]] = {}
    for node in nodes:
        by_share.setdefault(partition_name(node["cpus"]), []).append(node["name"])
    lines.append(f"PartitionName=all Nodes={','.join(n['name'] for n in nodes)} Default=YES MaxTime=INFINITE State=UP")
    for partition, members in sorted(by_share.items()):
        lines.append(f"PartitionName={partition} Nodes={','.join(members)} MaxTime=INFINITE State=UP")
    path = conf_path(doc["name"])
    path.write_text("\n".join(lines) + "\n")
    return path


def _task_prolog(doc: dict[str, Any]) -> str:
    """A task prolog printing ``export`` lines: what a process in the node sees (``node_env``)."""
    cases = []
    for node in doc["nodes"]:
        exports = [f"FELACTL_TESTBED_ADDR={node['address']}"]
        if node["cpus"] is not None:
            exports.append(f"{CPU_QUOTA_ENV}={node['cpus']:g}")
        cases.append(f"  {node['name']}) " + "; ".join(f'echo "export {e}"' for e in exports) + " ;;")
    return "\n".join(
        [
            "#!/bin/sh",
            "# felactl testbed: every job step sees its node as felactl's node agents do",
            f'echo "export GLOO_SOCKET_IFNAME={IFNAME}"',
            f'echo "export FELACTL_TESTBED={doc["name"]}"',
            'echo "export FELACTL_TESTBED_NODE=$SLURMD_NODENAME"',
            'case "$SLURMD_NODENAME" in',
            *cases,
            "esac",
            "",
        ]
    )


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _daemon(argv: list[str], log: Path) -> int:
    """Start a daemon in the foreground of a process of its own session; its pid."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    return proc.pid


def start(doc: dict[str, Any], record) -> None:
    """Start munge, the controller and every node's slurmd for the testbed ``doc`` describes (its
    nodes made already), the Slurm directory recorded (``record(kind, what)``) before anything is
    made there and each daemon once started (:func:`stop` finds them by that directory); wait
    until every node is idle. A failure raises :class:`TestbedError` naming the log to read."""
    from felactl.testbed.processes import node_command_net

    require_slurm()
    where = slurm_dir(doc["name"])
    record("slurm", str(where))
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True, mode=0o700)
    (where / "ctld").mkdir()
    key = where / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    doc["slurm"] = {"dir": str(where), "pids": {}}
    pids = doc["slurm"]["pids"]
    pids["munged"] = _daemon(
        [
            "munged",
            "--foreground",
            "--force",
            f"--socket={where / 'munge.sock'}",
            f"--key-file={key}",
            f"--pid-file={where / 'munged.pid'}",
            f"--seed-file={where / 'munged.seed'}",
            f"--log-file={where / 'munged.log'}",
        ],
        where / "munged.out",
    )
    record("slurm-daemon", "munged")
    _wait_for(lambda: (where / "munge.sock").exists(), where / "munged.out", "munged")
    conf = write_conf(doc, _free_port(doc["host_address"]))
    pids["slurmctld"] = _daemon(["slurmctld", "-D", "-i", "-f", str(conf)], where / "slurmctld.out")
    record("slurm-daemon", "slurmctld")
    for node in doc["nodes"]:
        argv = node_command_net(node, ["slurmd", "-D", "-N", node["name"], "-f", str(conf)])
        pids[f"slurmd:{node['name']}"] = _daemon(argv, where / f"slurmd-{node['name']}.out")
    record("slurm-daemon", "slurmd")
    names = [node["name"] for node in doc["nodes"]]
    _wait_for(lambda: _idle(doc["name"], names), where / "slurmctld.log", "the nodes to be idle in Slurm")


def _idle(name: str, nodes: list[str]) -> bool:
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--format=%N %t"],
            env=client_env(name),
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except subprocess.TimeoutExpired:
        return False
    states = dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)
    return all(states.get(node, "").startswith("idle") for node in nodes)


def _wait_for(ready, log: Path, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            raise TestbedError(f"testbed --slurm: waited {READY_TIMEOUT_S:g} s for {what}; see {log}")
        time.sleep(0.2)


def stop(doc: dict[str, Any]) -> list[str]:
    """Stop this testbed's daemons and remove its Slurm directory; what was stopped or removed.
    The daemons are found by their command lines, which all name the directory (the state file
    may be gone: an ``up`` killed half-way); a slurmd also dies with its node's processes."""
    slurm = doc.get("slurm") or {}
    where = Path(slurm.get("dir") or slurm_dir(doc["name"]))
    stopped = []
    for pid in _daemons_of(where):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        stopped.append(f"pid {pid}")
    if where.exists():
        shutil.rmtree(where, ignore_errors=True)
        stopped.append(str(where))
    return stopped


def _daemons_of(where: Path) -> list[int]:
    """The processes whose command line names a file in ``where`` (munged's socket, the daemons'
    ``slurm.conf``), this one aside."""
    inside = f"{where}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if inside in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def install() -> int:
    """Install Debian's packages (root, apt): what the tests and ``--slurm`` need; apt's exit code."""
    if shutil.which("apt-get") is None:
        print("no apt-get here: install Slurm (slurmctld, slurmd, the client commands) and munge yourself")
        return 2
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.call(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], env=env)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--install"]:
        sys.exit("usage: python -m felactl.testbed.slurm --install")
    sys.exit(install())

"""Remote nodes: DeepSpeed's hostfile, and starting ``felactl agent`` on each host over ssh.

The secret travels on ssh's stdin (``--secret-file -``), never on a command line where ``ps`` on
either machine would show it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from felactl.agents.agent import agent_argv, start_agent
from felactl.errors import InputError
from felactl.machine import stop_processes

_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.\-\[\]:]+)(?:\s+slots\s*=\s*(?P<slots>\S+))?$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Host:
    hostname: str
    num_slots: int


def parse_hostfile(text: str, where: str = "hostfile") -> list[Host]:
    """``hostname slots=N`` per line; ``#`` starts a comment; blank lines are skipped."""
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise InputError(f"{where}: line {number}: expected 'hostname slots=N', got {line!r}")
        slots_text = match.group("slots") or "1"
        if not slots_text.isdigit() or int(slots_text) < 1:
            raise InputError(f"{where}: line {number}: slots must be a positive integer, got {slots_text!r}")
        if any(h.hostname == match.group("host") for h in hosts):
            raise InputError(f"{where}: line {number}: host {match.group('host')!r} is listed twice")
        hosts.append(Host(hostname=match.group("host"), num_slots=int(slots_text)))
    if not hosts:
        raise InputError(f"{where}: no hosts listed")
    return hosts


def read_hostfile(path: str | Path) -> list[Host]:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such hostfile")
    return parse_hostfile(p.read_text(encoding="utf-8"), str(p))


def agent_ssh_command(
    host: Host,
    endpoint: str,
    *,
    felactl: str = "felactl",
    log_dir: str | None = None,
    ssh: str = "ssh",
    job: str = "profile",
) -> list[str]:
    """The ssh command line that starts one host's agent (the secret comes on stdin)."""
    remote = agent_argv(
        endpoint, nproc=host.num_slots, node_name=host.hostname, job=job, log_dir=log_dir, felactl=(felactl,)
    )
    return [ssh, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new", host.hostname, shlex.join(remote)]


def start_ssh_agents(
    hosts: list[Host], endpoint: str, secret: str, log_dir: Path, job: str = "profile"
) -> list[subprocess.Popen]:
    """Start ``felactl agent`` on every host; each ssh's output goes to ``log_dir/ssh-<host>.log``."""
    procs: list[subprocess.Popen] = []
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for host in hosts:
            command = agent_ssh_command(host, endpoint, job=job)
            procs.append(start_agent(command, secret, log_dir / f"ssh-{host.hostname}.log"))
    except BaseException:
        stop_processes(procs)
        raise
    return procs

"""This machine, as every room needs it: its short name, the cores this process may use, what an
agent tells the coordinator about its node, and stopping the processes felactl started on it.
(Measuring the machine's speed is :mod:`felactl.profiling`'s.)"""

from __future__ import annotations

import os
import socket
import subprocess

import psutil

GB = 1e9


def available_cores() -> list[int]:
    """The cores this process may run on (honours cgroups/taskset, unlike cpu_count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(psutil.cpu_count(logical=True) or 1))


def short_hostname() -> str:
    """This machine's hostname without its domain: the default node name."""
    return socket.gethostname().split(".")[0] or "localhost"


def num_gpus() -> int:
    """The CUDA GPUs this process can use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_info() -> dict:
    """What an agent tells the coordinator about its machine."""
    return {
        "hostname": socket.gethostname(),
        "num_cpu_cores": len(available_cores()),
        "memory_gb": round(psutil.virtual_memory().total / GB, 3),
        "num_gpus": num_gpus(),
    }


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    """SIGTERM each process still running, SIGKILL those still there after ``grace_s``."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

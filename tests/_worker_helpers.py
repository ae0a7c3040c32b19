"""Shared helpers of the worker/sync tests: plans on local CPUs, runs, and single-process reference."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from typer.testing import CliRunner

from felactl import models
from felactl.agents.worker.checkpoint import checkpoint_path
from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.engine import make_optimizer
from felactl.agents.worker.local import run_local
from felactl.cli.main import app
from felactl.control.metrics import read_metrics
from felactl.errors import InputError
from felactl.launcher.resume import load_stage, pick_checkpoint
from felactl.launcher.rundir import RunDir, read_jsonl
from felactl.spec import (
    DeviceKind,
    ModelRef,
    Placement,
    Plan,
    Schedule,
    Stage,
    StageWorker,
    SyncMode,
    SyncSpec,
    Training,
    save,
)

MLP_CONFIG = {"input_dim": 32, "hidden": 64, "depth": 2}


def dp_plan(
    num_workers: int = 2,
    mode: str = "bsp",
    *,
    shares=None,
    global_batch: int = 32,
    micro_batch: int = 8,
    optimizer: str = "sgd",
    lr: float = 0.05,
    overlap: bool = False,
    config=None,
    **sync,
) -> Plan:
    return models.local_data_parallel_plan(
        "mlp",
        config or MLP_CONFIG,
        num_workers,
        global_batch=global_batch,
        micro_batch=micro_batch,
        shares=shares,
        sync=SyncSpec(mode=SyncMode(mode), overlap=overlap, **sync),
        training=Training(optimizer=optimizer, lr=lr, seed=0),
    )


def local_worker_config(plan_path: Path, run_dir: Path) -> WorkerConfig:
    """The config of a one-worker job's rank 0 in this process, with no store to reach (for what
    needs a worker's config but forms no group)."""
    return WorkerConfig(
        rank=0,
        local_rank=0,
        world_size=1,
        store_host="127.0.0.1",
        store_port=1,
        host_store=False,
        plan_path=plan_path,
        run_dir=run_dir,
    )


def placed(plan: Plan, kind: DeviceKind = DeviceKind.CPU, node: str = "box") -> Plan:
    """``plan`` with every device placed on ``node``, of ``kind``, at indices 0, 1, ..."""
    return dataclasses.replace(
        plan,
        placement=tuple(Placement(device=d, node=node, kind=kind, local_index=i) for i, d in enumerate(plan.devices)),
    )


def pipeline_plan(
    cuts: list[int],
    num_replicas: int = 1,
    schedule: str = "1f1b",
    *,
    global_batch: int = 32,
    micro_batch: int = 4,
    optimizer: str = "sgd",
    lr: float = 0.05,
    config=None,
    sync: str = "bsp",
) -> Plan:
    """``len(cuts) - 1`` stages x ``num_replicas`` pipelines; device ``cpu{r * S + s}`` runs stage s of replica r."""
    num_stages = len(cuts) - 1
    devices = [f"cpu{r * num_stages + s}" for r in range(num_replicas) for s in range(num_stages)]
    stages = tuple(
        Stage(
            layer_start=cuts[s],
            layer_end=cuts[s + 1],
            micro_batch=micro_batch,
            workers=tuple(
                StageWorker(device=f"cpu{r * num_stages + s}", share=1 / num_replicas) for r in range(num_replicas)
            ),
        )
        for s in range(num_stages)
    )
    pipelines = tuple(tuple(f"cpu{r * num_stages + s}" for s in range(num_stages)) for r in range(num_replicas))
    return Plan(
        cluster="local",
        model=ModelRef(name="mlp", source="mlp", config=config or MLP_CONFIG),
        devices=tuple(devices),
        global_batch=global_batch,
        schedule=Schedule(schedule),
        sync=SyncSpec(mode=SyncMode(sync)),
        training=Training(optimizer=optimizer, lr=lr, seed=0),
        stages=stages,
        pipelines=pipelines,
    )


def run_plan(plan: Plan, tmp_path: Path, steps: int, env=None, per_rank_env=None, timeout_s: float = 60) -> Path:
    plan_path = save(plan, tmp_path / "plan.yaml")
    run_dir = tmp_path / "run"
    run_local(
        plan_path,
        run_dir,
        len(plan.devices),
        {"FELACTL_STEPS": str(steps), "FELACTL_CHECKPOINT_EVERY": str(steps), **(env or {})},
        per_rank_env,
        timeout_s=timeout_s,
    )
    return run_dir


def final_params(run_dir: Path, steps: int, stage: int = 0) -> torch.Tensor:
    state = load_stage(checkpoint_path(run_dir, steps, stage))  # a sharded stage's read whole
    return torch.cat([v.reshape(-1) for k, v in state["model"].items()])


def single_process(
    plan: Plan, steps: int, micro_batch: int | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process training on the same global batches: what BSP must reproduce (the job's
    optimizer, LR scheduler and gradient clipping included): the model's state after ``steps``
    and each step's loss. ``micro_batch``: accumulate each step's gradient over micro-batches of
    that size in sample order (each loss weighted by its share of the batch), as a run that splits
    the batch so sums it: the same sum in the same float order. (A whole batch's gradient differs
    from two halves' in the last bits, and some CPUs' kernels make that 2e-5 in a weight after 8
    SGD steps: a bound on that would measure the CPU, not the runtime.)"""
    job = models.build(plan.model.source, plan.model.config, seed=plan.training.seed).job
    model = job.model
    optimizer = make_optimizer(plan, list(model.parameters()), job)
    scheduler = job.lr_scheduler(optimizer) if job.lr_scheduler is not None else None
    losses = []
    size = micro_batch or plan.global_batch
    for step in range(steps):
        first, end = step * plan.global_batch, (step + 1) * plan.global_batch
        loss_sum = 0.0
        for start in range(first, end, size):
            inputs, targets = job.batch(range(start, min(start + size, end)))
            weight = (min(start + size, end) - start) / plan.global_batch
            loss = job.loss_fn(model(inputs), targets)
            (loss * weight if micro_batch else loss).backward()
            loss_sum += loss.item() * weight
        losses.append(loss_sum)
        if job.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    return model.state_dict(), losses


def reference_params(plan: Plan, steps: int, micro_batch: int | None = None) -> torch.Tensor:
    """:func:`single_process`'s weights, flat."""
    return torch.cat([v.reshape(-1) for v in single_process(plan, steps, micro_batch)[0].values()])


def metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


def hybrid_plan(
    stages: list[tuple[int, int, int, list[int]]],
    num_devices: int,
    *,
    global_batch: int = 32,
    optimizer: str = "sgd",
    lr: float = 0.05,
    policy: str = "ads+hf",
    config=None,
) -> Plan:
    """Fela's flexible hybrid: ``stages`` = [(layer_start, layer_end, micro_batch, [device ids])]."""
    return Plan(
        cluster="local",
        model=ModelRef(name="mlp", source="mlp", config=config or MLP_CONFIG),
        devices=tuple(f"cpu{i}" for i in range(num_devices)),
        global_batch=global_batch,
        schedule=Schedule.TOKENS,
        sync=SyncSpec(mode=SyncMode.TOKENS, token_policy=policy),
        training=Training(optimizer=optimizer, lr=lr, seed=0),
        stages=tuple(
            Stage(
                layer_start=a,
                layer_end=b,
                micro_batch=mb,
                workers=tuple(StageWorker(device=f"cpu{d}", share=1 / len(ds)) for d in ds),
            )
            for a, b, mb, ds in stages
        ),
    )


FAKE_SSH = '''#!{python}
"""Stands in for ssh: records its arguments and what came on stdin, then runs the remote command
here (``felactl`` as ``python -m felactl``), as sshd would on the host."""
import json, os, shlex, sys

args = sys.argv[1:]
options = []
while args and args[0] == "-o":
    options.append(args[1])
    args = args[2:]
host, remote = args
secret = sys.stdin.readline()
with open(os.environ["FAKE_SSH_LOG"], "a") as log:
    log.write(json.dumps({{"options": options, "host": host, "remote": remote, "stdin": secret}}) + "\\n")
read, write = os.pipe()
os.write(write, secret.encode())
os.close(write)
os.dup2(read, 0)
command = shlex.split(remote)
os.execv(sys.executable, [sys.executable, "-m", "felactl", *command[1:]])
'''


def fake_ssh(bin_dir):
    """A directory holding ``ssh`` (:data:`FAKE_SSH`) to put first on a child's PATH, with
    ``FAKE_SSH_LOG`` naming where it records each call."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH.format(python=sys.executable))
    ssh.chmod(0o755)
    return bin_dir


class Job:
    """``felactl launch`` in a subprocess of its own session; stop() reaps it and its workers."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None):
        self.root = tmp_path / "runs"
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "felactl", "launch", *args, "--runs-root", str(self.root), "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def records(self, run: str) -> list[dict]:
        return read_jsonl(self.root / run / "metrics.jsonl")

    def wait_step(self, run: str, step: int, timeout_s: float = 40) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(r["step"] >= step for r in self.records(run)):
                return
            assert self.proc.poll() is None, self.proc.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        raise AssertionError(f"step {step} not reached")

    def signal_worker(self, run: str, wid: int, sig: int) -> float:
        """Send ``sig`` to worker ``wid``'s process (its pid from the metrics); returns when."""
        pid = next(r["pid"] for r in self.records(run) if r["rank"] == wid)
        sent_at = time.time()
        os.kill(pid, sig)
        return sent_at

    def scale(self, run: str, *args: str):
        return CliRunner().invoke(app, ["scale", run, *args, "--runs-root", str(self.root), "--json"])

    def finish(self, timeout_s: float = 60) -> dict:
        out, err = self.proc.communicate(timeout=timeout_s)
        assert self.proc.returncode == 0, err.decode()[-3000:]
        return json.loads(out)

    def stop(self) -> None:
        pids = {p.pid for p in _procs_of(self.proc.pid)}
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for r in self.records_all():
            try:
                os.kill(r, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def records_all(self) -> set[int]:
        pids = set()
        for metrics in self.root.glob("*/metrics.jsonl"):
            pids |= {r["pid"] for r in read_jsonl(metrics) if "pid" in r and psutil.pid_exists(r["pid"])}
        return pids & {p.pid for p in psutil.Process().children(recursive=True)}


def wait_checkpoint(runs: Path, run: str, *, at_least: int, timeout_s: float) -> int:
    """The step of the run's newest complete checkpoint, once it is ``at_least``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            step = pick_checkpoint(RunDir.find(run, root=runs)).step
        except InputError:  # none complete yet
            step = -1
        if step >= at_least:
            return step
        assert time.monotonic() < deadline, f"no complete checkpoint at step {at_least} or later within {timeout_s:g} s"
        time.sleep(0.05)


def free_endpoint() -> str:
    """``127.0.0.1:PORT`` of a port nothing listens on (the launch's control plane takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def second_node(job: Job, tmp_path: Path, run: str, endpoint: str, node: str, nproc: int, timeout_s: float = 30):
    """A ``felactl agent`` for node ``node`` of ``job`` (a launch with ``--rdzv-endpoint
    endpoint``), started once the launch has written the run's secret, in its own session (the
    caller kills its process group); its logs in ``tmp_path/<node>-logs``."""
    secret = tmp_path / "runs" / run / "secret"
    deadline = time.monotonic() + timeout_s
    while not secret.exists():
        assert time.monotonic() < deadline and job.proc.poll() is None, "the launch did not start"
        time.sleep(0.05)
    args = ["--rdzv-endpoint", endpoint, "--secret-file", str(secret), "--node-name", node, "--job", run]
    return subprocess.Popen(
        [sys.executable, "-m", "felactl", "agent", *args, "--nproc-per-node", str(nproc), "--log-dir", f"{node}-logs"],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def worker_processes(pid: int) -> dict[int, psutil.Process]:
    """The running workers under process ``pid`` (a launch, an agent) by worker id: each names
    itself ``felactl-w<id>`` (``agents/worker/__main__.py:name_process``; one forked from its
    agent's zygote shows the zygote's command line and environment)."""
    found = {}
    for proc in _procs_of(pid):
        try:
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        if name.startswith("felactl-w") and name[len("felactl-w") :].isdigit():
            found[int(name[len("felactl-w") :])] = proc
    return found


def _procs_of(pid: int) -> list[psutil.Process]:
    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rescale(controller, command: dict, timeout_s: float = 30) -> dict:
    """Send ``command`` to an :class:`ElasticController` as ``felactl scale`` would (a signed
    request on its queue) and poll it until it answers; the answer's result (a refusal fails)."""
    from felactl.control import keys
    from felactl.control.documents import ScaleRequestDoc

    coordinator, request_id = controller.coordinator, f"t{time.monotonic_ns()}"
    request = coordinator.seal.seal(
        keys.SCALE_REQUESTS, ScaleRequestDoc.KIND.value, ScaleRequestDoc(id=request_id, command=command).to_body()
    )
    coordinator.store.queue_push(coordinator.prefix + keys.SCALE_REQUESTS, request)
    deadline = time.monotonic() + timeout_s
    while request_id not in controller.answers:
        assert time.monotonic() < deadline, f"no answer to {command} within {timeout_s} s"
        controller.poll()
        time.sleep(0.02)
    reply = controller.answers[request_id]
    assert reply["ok"], reply
    return reply["result"]


def one_node_controller(coordinator, run, plan: Plan, slots: int, **settings):
    """An ElasticController of ``plan``'s job on one node ``n`` (agent ``a``, ``slots`` slots),
    as the tests that drive the coordinator without workers build it."""
    from felactl.launcher.controlplane import Member
    from felactl.launcher.elastic import ElasticController, ElasticSettings

    member = Member(agent_id="a", node_name="n", num_slots=slots, hostname="n")
    return ElasticController(coordinator, run, plan, [member], {"n": plan.devices}, ElasticSettings(**settings))

"""The worker's connection to the job: the control-plane store and the process groups.

Everything lives under a store prefix per membership generation (``<prefix>/gen<G>/``): the
default process group rendezvous there (:func:`form_group`, the one place a worker's groups are
formed), and so do the token buckets, the WBSP data position and the SDPipe scheduler. Live
rescaling bumps the generation and re-forms everything under a fresh prefix; nothing here
assumes the world size stays fixed across generations.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from felactl.agents.worker.config import WorkerConfig
from felactl.control.store import generation_store
from felactl.errors import ControlPlaneError, InputError


def connect_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """A TCPStore client (or the server, for rank 0 under plain torchrun variables)."""
    try:
        return dist.TCPStore(
            host, port, is_master=is_master, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except (RuntimeError, OSError) as exc:
        raise ControlPlaneError(f"cannot reach the control-plane store at {host}:{port}: {exc}") from exc


@dataclass(frozen=True)
class MembersGroup:
    """A process-group backend over some ranks, used directly (see :meth:`Runtime.members_group`)."""

    ranks: tuple[int, ...]
    backend: dist.ProcessGroup


def all_reduce_async(tensor: torch.Tensor, group):
    """Start a sum-allreduce of ``tensor`` over ``group`` (a process group or a :class:`MembersGroup`)."""
    if isinstance(group, MembersGroup):
        return group.backend.allreduce([tensor])
    return dist.all_reduce(tensor, group=group, async_op=True)


@dataclass
class Runtime:
    cfg: WorkerConfig
    store: dist.Store
    """This generation's prefixed store (shared by the trainer thread)."""
    backend: str
    device: torch.device
    _raw: dist.TCPStore
    _groups: dict[tuple[int, ...], object] = field(default_factory=dict)
    _member_groups: dict[tuple[int, ...], MembersGroup] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.cfg.rank

    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    def new_store_client(self) -> dist.Store:
        """A second connection, for a thread that blocks on the store while the trainer uses it."""
        raw = connect_store(self.cfg.store_host, self.cfg.store_port, is_master=False, timeout_s=self.cfg.timeout_s)
        return generation_store(raw, self.cfg.store_prefix, self.cfg.generation)

    def group(self, ranks: tuple[int, ...]):
        """The process group of ``ranks`` (the default group for everyone). Create groups through
        :meth:`make_groups` first: ``new_group`` is collective over all ranks."""
        if len(ranks) == self.world_size:
            return dist.group.WORLD
        return self._groups[tuple(sorted(ranks))]

    def make_groups(self, rank_sets: list[tuple[int, ...]]) -> None:
        """Create every group in the same order on every rank (pass the same list everywhere)."""
        for ranks in rank_sets:
            key = tuple(sorted(ranks))
            if len(key) < self.world_size and key not in self._groups:
                self._groups[key] = dist.new_group(list(key), backend=self.backend)

    @property
    def forms_member_groups(self) -> bool:
        """Whether :meth:`members_group` works here (gloo; not built for NCCL yet)."""
        return self.backend == "gloo"

    def members_group(self, ranks: tuple[int, ...]) -> MembersGroup:
        """A group of a subset that only its members learn they need, mid-run (the workers that
        summed a tokens iteration another one skipped). ``new_group`` cannot make it: it is
        collective over all ranks, and its ``use_local_synchronization`` names the group after
        how many groups each member already has, which differs between members here. So the
        members build the backend themselves, meeting on a store prefix named after the subset."""
        key = tuple(sorted(ranks))
        if key not in self._member_groups:
            if not self.forms_member_groups:
                raise NotImplementedError(f"groups of a subset formed mid-run on {self.backend}")
            store = dist.PrefixStore("members/" + "_".join(map(str, key)), self.store)
            backend = dist.ProcessGroupGloo(
                store, key.index(self.rank), len(key), datetime.timedelta(seconds=self.cfg.timeout_s)
            )
            self._member_groups[key] = MembersGroup(key, backend)
        return self._member_groups[key]

    def new_world_group(self, backend: str | None = None):
        """A second group over all ranks, for traffic that runs beside the trainer's collectives
        (``gloo`` for CPU-side control traffic even when the trainers use NCCL)."""
        return dist.new_group(list(range(self.world_size)), backend=backend or self.backend)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def choose_device(cfg: WorkerConfig, backend: str) -> torch.device:
    """The device this worker trains on under ``backend``, its plan's
    (:func:`felactl.spec.executable.plan_backend`, the same for every rank: a guess made rank by
    rank could put one group on two backends): the CPU on gloo, GPU ``LOCAL_RANK`` on NCCL."""
    if backend != "nccl":
        return torch.device("cpu")
    if cfg.local_rank >= torch.cuda.device_count():
        raise InputError(
            f"worker {cfg.rank}: the plan puts it on GPU {cfg.local_rank} but this machine has "
            f"{torch.cuda.device_count()} GPU(s)"
        )
    device = torch.device("cuda", cfg.local_rank)
    torch.cuda.set_device(device)
    return device


def form_group(cfg: WorkerConfig, raw: dist.TCPStore, backend: str, *, timeout_s: float) -> Runtime:
    """Rendezvous the default process group of ``cfg``'s generation (its rank and world size) on
    the job's store ``raw``, on ``backend`` (the plan's), its collectives timing out after
    ``timeout_s``: every worker's groups are formed here, a fixed job's once and an elastic job's
    at each generation."""
    store = generation_store(raw, cfg.store_prefix, cfg.generation)
    device = choose_device(cfg, backend)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=cfg.rank,
        world_size=cfg.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return Runtime(cfg, store, backend, device, raw)


def start(cfg: WorkerConfig, backend: str) -> Runtime:
    """Connect to the store and rendezvous the default process group of this generation on ``backend``."""
    raw = connect_store(cfg.store_host, cfg.store_port, is_master=cfg.host_store, timeout_s=cfg.timeout_s)
    return form_group(cfg, raw, backend, timeout_s=cfg.timeout_s)

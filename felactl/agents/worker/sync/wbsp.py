"""WBSP: no worker waits. After every local step a worker pushes ``delta = theta - theta_pushed``;
the server applies ``theta_g += delta / N`` at once. A round closes when every active worker has
pushed at least once; a worker that learns of a closed round pulls ``theta_g`` and goes on from it.

The parameter server is a thread in rank 0 speaking torch.distributed point-to-point on a process
group of its own (so it never mixes with the trainers' collectives): a client sends a header
``[kind, last_round]`` (received with ``src=None``: from whoever comes first), then its delta;
the server answers ``[round]`` and, if that round is newer than the client's, ``theta_g``. Rank 0
itself applies its deltas in-process. With ``overlap``, a second thread per worker does the
push/pull while the first keeps training (deltas queued meanwhile are coalesced). At the end
rank 0 broadcasts ``theta_g`` and every replica adopts it.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.strategy import AtOwnPace, StepResult, Work

PUSH, DONE = 1, 2
TAG_HEADER, TAG_DELTA, TAG_REPLY, TAG_MODEL = 11, 12, 13, 14


class ParameterServer:
    def __init__(self, theta: torch.Tensor, world_size: int, group):
        self.theta = theta.clone()
        self.world_size = world_size
        self.group = group
        self.round = 0
        self.active = set(range(world_size))
        self.pushed: set[int] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name="wbsp-server", daemon=True)
        self.error: BaseException | None = None

    def apply(self, rank: int, delta: torch.Tensor) -> tuple[int, torch.Tensor]:
        with self.lock:
            self.theta += delta / self.world_size
            self.pushed.add(rank)
            self._maybe_close_round()
            return self.round, self.theta.clone()

    def leave(self, rank: int) -> None:
        with self.lock:
            self.active.discard(rank)
            self._maybe_close_round()

    def _maybe_close_round(self) -> None:
        if self.active and self.active <= self.pushed:
            self.round += 1
            self.pushed = set()

    def _serve(self) -> None:
        try:
            remote = self.world_size - 1
            header = torch.zeros(2, dtype=torch.long)
            delta = torch.zeros_like(self.theta)
            while remote:
                src = dist.recv(header, src=None, group=self.group, tag=TAG_HEADER)
                if int(header[0]) == DONE:
                    self.leave(src)
                    remote -= 1
                    continue
                dist.recv(delta, src=src, group=self.group, tag=TAG_DELTA)
                current, theta = self.apply(src, delta)
                dist.send(torch.tensor([current]), dst=src, group=self.group, tag=TAG_REPLY)
                if current > int(header[1]):
                    dist.send(theta, dst=src, group=self.group, tag=TAG_MODEL)
        except BaseException as exc:  # surfaced by the trainer thread on join
            self.error = exc


class Client:
    """One worker's side: ``exchange(delta)`` pushes and returns ``theta_g`` when a round is new."""

    def __init__(self, rank: int, group, server: ParameterServer | None, size: int):
        self.rank, self.group, self.server = rank, group, server
        self.last_round = 0
        self.model_buffer = torch.zeros(size)

    def exchange(self, delta: torch.Tensor) -> torch.Tensor | None:
        if self.server is not None:
            current, theta = self.server.apply(self.rank, delta)
        else:
            dist.send(torch.tensor([PUSH, self.last_round]), dst=0, group=self.group, tag=TAG_HEADER)
            dist.send(delta, dst=0, group=self.group, tag=TAG_DELTA)
            reply = torch.zeros(1, dtype=torch.long)
            dist.recv(reply, src=0, group=self.group, tag=TAG_REPLY)
            current = int(reply[0])
            theta = None
            if current > self.last_round:
                dist.recv(self.model_buffer, src=0, group=self.group, tag=TAG_MODEL)
                theta = self.model_buffer.clone()
        if current > self.last_round:
            self.last_round = current
            return theta
        return None

    def done(self) -> None:
        if self.server is not None:
            self.server.leave(self.rank)
        else:
            dist.send(torch.tensor([DONE, self.last_round]), dst=0, group=self.group, tag=TAG_HEADER)


class Overlapped:
    """The optimized variant: a comm thread pushes coalesced deltas and fetches new models."""

    def __init__(self, client: Client):
        self.client = client
        self.lock = threading.Condition()
        self.pending: torch.Tensor | None = None
        self.pulled: torch.Tensor | None = None
        self.closing = False
        self.comm_s = 0.0
        self.thread = threading.Thread(target=self._loop, name="wbsp-comm", daemon=True)
        self.thread.start()

    def offer(self, delta: torch.Tensor) -> torch.Tensor | None:
        """Queue ``delta``; returns a pulled ``theta_g`` plus the progress not yet pushed, if any."""
        with self.lock:
            self.pending = delta if self.pending is None else self.pending + delta
            adopted = None
            if self.pulled is not None:
                adopted, self.pulled = self.pulled + self.pending, None
            self.lock.notify()
            return adopted

    def _loop(self) -> None:
        while True:
            with self.lock:
                while self.pending is None and not self.closing:
                    self.lock.wait()
                if self.pending is None:
                    return
                delta, self.pending = self.pending, None
            start = time.perf_counter()
            theta = self.client.exchange(delta)
            self.comm_s += time.perf_counter() - start
            if theta is not None:
                with self.lock:
                    self.pulled = theta

    def close(self) -> None:
        with self.lock:
            self.closing = True
            self.lock.notify()
        self.thread.join()


class WBSP(AtOwnPace):
    """Each worker pushes its change after every local step to rank 0's parameter server and
    takes the merged parameters back when a round closed (see the module doc)."""

    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        runtime = trainer.runtime
        self.group = runtime.new_world_group(backend="gloo")
        self.last_pushed = trainer.flat_params().cpu()
        self.server = ParameterServer(self.last_pushed, runtime.world_size, self.group) if runtime.rank == 0 else None
        if self.server is not None:
            self.server.thread.start()
        self.client = Client(runtime.rank, self.group, self.server, self.last_pushed.numel())
        self.overlapped = Overlapped(self.client) if trainer.plan.sync.overlap and self.server is None else None

    def step(self, work: Work) -> StepResult:
        t = self.trainer
        result = t.compute(work.indices)
        t.optimizer_step(at_step=work.step)
        return self.trained_then_synced(result, self._push_and_pull)

    def _push_and_pull(self) -> tuple[float, float]:
        """Push this step's change; take the merged parameters when a round closed."""
        t = self.trainer
        start = time.perf_counter()
        theta = t.flat_params().cpu()
        delta, self.last_pushed = theta - self.last_pushed, theta
        pulled = self.overlapped.offer(delta) if self.overlapped else self.client.exchange(delta)
        if pulled is not None:
            t.set_flat_params(pulled.to(t.runtime.device))
            # A fresh copy, never ``pulled`` itself: ``set_flat_params`` may make the parameters
            # views of the tensor it is given, and the next optimizer step would then move the base
            # along with the model, so the next delta would be zero and that step's progress lost.
            self.last_pushed = t.flat_params().cpu()
        return time.perf_counter() - start, 0.0

    def finish(self) -> None:
        """Every replica takes the server's final parameters."""
        if self.overlapped is not None:
            self.overlapped.close()
        self.client.done()
        if self.server is not None:
            self.trainer.join_thread(self.server.thread, "the parameter server did not hear from every worker")
            if self.server.error is not None:
                raise self.server.error
            final = self.server.theta
        else:
            final = torch.zeros_like(self.last_pushed)
        dist.broadcast(final, src=0, group=self.group)
        self.trainer.set_flat_params(final.to(self.trainer.runtime.device))
        super().finish()

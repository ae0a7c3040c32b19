"""Fela's flexible hybrid: sub-models with their own micro-batch sizes and worker sets, driven by tokens.

Stage ``s`` of the plan is sub-model ``s``; its micro-batch ``b_s`` gives the weight
``w_s = b_s / b_0`` and its workers are the CTD subset allowed to run it. A worker builds every
sub-model it may run. Per iteration, a :class:`~felactl.agents.worker.sync.token_policy.TokenServer` (a thread in
rank 0, fed through the store) hands out tokens; each request carries the token just finished
("report and ask in one small message"), and the reply names the token and which workers hold
its inputs. A backward token normally goes back to the worker that ran its forward (locality:
that worker holds the autograd graph); when an idle worker steals one from a straggler, it
recomputes the forward from the same inputs first (activation recomputation), so stragglers can
shed backward work too.

Data plane: every worker keeps what its tokens produced (forward outputs; input gradients split
per consumer) and serves them from a thread: a consumer sends ``[kind, level, index, rank]`` on a
request group, the producer answers on a data group (point-to-point, gloo). Tensors never pass
the token server or the store. At the end of the iteration each stage's workers sum-allreduce that
stage's gradients (sample-weighted, so the result equals single-process training), then step.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import torch
import torch.distributed as dist

from felactl.agents.worker import wire
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.strategy import Lockstep, StepResult, Work
from felactl.agents.worker.survivors import KeptState, stop_if_another_failed
from felactl.agents.worker.sync.token_policy import Token, TokenDAG, TokenServer, token_samples
from felactl.agents.worker.tied import sum_tied_over_holders, tied_ids
from felactl.agents.worker.waits import WAIT_SLICE_S
from felactl.control import keys
from felactl.models import values
from felactl.spec import Plan
from felactl.spec.executable import num_first_tokens

ACTIVATION, GRADIENT, STOP = 0, 1, 2
TAG_REQUEST, TAG_DATA = 31, 32


def token_weights(plan: Plan) -> tuple[int, ...]:
    """``w_s = b_s / b_0``: whole, as :func:`~felactl.spec.executable.check_executable` made sure."""
    first = plan.stages[0].micro_batch
    return tuple(stage.micro_batch // first for stage in plan.stages)


def make_dag(plan: Plan) -> TokenDAG:
    first, last = plan.stages[0], plan.stages[-1]
    return TokenDAG(
        num_first_tokens(plan.global_batch, first.micro_batch, len(first.workers), last.micro_batch),
        token_weights(plan),
    )


class TokenService:
    """Rank 0's thread: pops requests from a store queue (``queue_push``/``queue_pop``: one round
    trip each way) and answers on each worker's reply queue, parking a request until a token is
    ready for its worker. One :class:`TokenServer` per iteration."""

    def __init__(self, store, plan: Plan, steps: range):
        self.store, self.plan, self.steps = store, plan, steps
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="token-server", daemon=True)

    def _server(self) -> TokenServer:
        plan = self.plan
        level_workers = {s: tuple(plan.rank_of(d) for d in st.devices) for s, st in enumerate(plan.stages)}
        shares = {plan.rank_of(w.device): w.share for w in plan.stages[0].workers}
        return TokenServer(
            make_dag(plan),
            tuple(range(len(plan.devices))),
            plan.sync.token_policy,
            level_workers=level_workers,
            shares=shares,
            max_in_flight={s: st.max_in_flight for s, st in enumerate(plan.stages)},
        )

    def _run(self) -> None:
        try:
            for step in self.steps:
                if not self._iteration(step):
                    return
        except BaseException as exc:
            self.error = exc

    @staticmethod
    def stop_before(store, step: int) -> None:
        """The workers stopped early (a graceful stop) after ``step - 1``: end the server's wait
        (through ``store``, the caller's own connection: the server's is blocked in a pop)."""
        store.queue_push(keys.flexible_requests(step), json.dumps({"stop": True}))

    def _iteration(self, step: int) -> bool:
        """Serve iteration ``step``; False when the workers stopped before it."""
        server, parked, ended = self._server(), [], set()
        while len(ended) < len(server.workers):
            request = json.loads(self.store.queue_pop(keys.flexible_requests(step), block=True))
            if request.get("stop"):
                return False
            if request["done"] is not None:
                server.complete(request["rank"], Token(*request["done"]))
            parked.append(request["rank"])
            still = []
            for rank in parked:
                token = server.request(rank)
                if token is None and not server.finished:
                    still.append(rank)
                    continue
                reply = {"end": True} if token is None else self._reply(server, token)
                self.store.queue_push(keys.flexible_reply(step, rank), json.dumps(reply))
                if token is None:
                    ended.add(rank)
            parked = still
        return True

    @staticmethod
    def _reply(server: TokenServer, token: Token) -> dict:
        """The token and who holds its inputs (for a backward, also its forward's inputs, in case
        it must be recomputed where the forward did not run)."""

        def holders(t: Token) -> list[int]:
            return [server.state.done_by[i] for i in server.dag.inputs(t)]

        reply = {"token": [token.level, token.backward, token.index], "inputs": holders(token)}
        if token.backward:
            reply["forward_inputs"] = holders(Token(token.level, False, token.index))
        return reply


def _send(value, dst: int, group) -> None:
    for tensor in wire.encode(value):
        dist.send(tensor, dst, group=group, tag=TAG_DATA)


def _recv(src: int, group):
    return wire.decode(lambda buffer: dist.recv(buffer, src, group=group, tag=TAG_DATA), torch.device("cpu"))


class TensorStore:
    """What this worker's tokens produced, served to peers by a thread (CPU tensors, gloo)."""

    def __init__(self, rank: int, request_group, data_group):
        self.rank, self.request_group, self.data_group = rank, request_group, data_group
        self.produced: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="tensor-server", daemon=True)

    def put(self, step: int, kind: int, level: int, index: int, value) -> None:
        """Keep a token's output (a tensor, or a split model's tuple of values) for its consumers."""
        with self.lock:
            self.produced[(step, kind, level, index)] = values.map_tensors(lambda t: t.detach().cpu(), value)

    def forget_before(self, step: int) -> None:
        with self.lock:
            self.produced = {k: v for k, v in self.produced.items() if k[0] >= step}

    def fetch(self, step: int, kind: int, level: int, index: int, holder: int):
        if holder == self.rank:
            with self.lock:
                return self.produced[(step, kind, level, index)]
        dist.send(torch.tensor([kind, level, index, step]), holder, group=self.request_group, tag=TAG_REQUEST)
        return _recv(holder, self.data_group)

    def _serve(self) -> None:
        try:
            header = torch.zeros(4, dtype=torch.long)
            while True:
                src = dist.recv(header, None, group=self.request_group, tag=TAG_REQUEST)
                kind, level, index, step = (int(x) for x in header)
                if kind == STOP:
                    return
                with self.lock:
                    tensor = self.produced[(step, kind, level, index)]
                _send(tensor, src, self.data_group)
        except BaseException as exc:
            self.error = exc

    def stop_peer(self, peer: int) -> None:
        dist.send(torch.tensor([STOP, 0, 0, 0]), peer, group=self.request_group, tag=TAG_REQUEST)


class FlexibleWorker:
    def __init__(self, trainer: Trainer):
        self.t = trainer
        plan, rank = trainer.plan, trainer.runtime.rank
        self.dag = make_dag(plan)
        self.stages = [part.stage for part in trainer.parts]  # every sub-model it may run
        self.modules = {part.stage: part.module for part in trainer.parts}
        self.saved: dict[tuple[int, int], tuple] = {}
        self.store = TensorStore(rank, trainer.runtime.new_world_group("gloo"), trainer.runtime.new_world_group("gloo"))
        self.replies = trainer.runtime.new_store_client()
        """The token server's replies, awaited in slices (:meth:`reply`)."""
        self.replies.set_timeout(datetime.timedelta(seconds=WAIT_SLICE_S))
        self.reset_counters()

    def reset_counters(self) -> None:
        self.loss_sum, self.loss_samples, self.samples, self.tokens, self.compute_s = 0.0, 0, 0, 0, 0.0
        self.recomputed = 0
        self.saved = {}  # graphs of forwards whose backward another worker took

    def indices(self, step: int, token: Token) -> list[int]:
        w = self.dag.weights[token.level]
        first = token_samples(self.t.global_batch, self.dag.num_first, token.index * w)
        last = token_samples(self.t.global_batch, self.dag.num_first, (token.index + 1) * w - 1)
        return self.t.step_indices(step, range(first.start, last.stop))

    def _timed(self, fn):
        start = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - start
        self.compute_s += elapsed + self.t.straggler.after_compute(elapsed)
        return out

    def forward(self, step: int, token: Token, holders: list[int], recompute: bool = False) -> tuple:
        """Run forward token ``token`` (or, with ``recompute``, rebuild its graph for a stolen
        backward: same inputs fetched again, nothing counted or published twice)."""
        s, j, device = token.level, token.index, self.t.runtime.device
        indices = self.indices(step, token)
        last = s == self.dag.num_levels - 1
        if s == 0 or last:
            inputs, targets = self.t.batch(indices)
        if s == 0:
            x, sizes = inputs, []
            self.samples += 0 if recompute else len(indices)
        else:
            r = self.dag.weights[s] // self.dag.weights[s - 1]
            parts = [self.store.fetch(step, ACTIVATION, s - 1, j * r + q, holders[q]) for q in range(r)]
            kinds = self.kinds_into(s)
            sizes = [values.samples_in(p, kinds) for p in parts]
            x = values.cut_from_graph(values.to_device(values.merge(parts, kinds), device), True)
        y = self._timed(lambda: self.t.autocast(self.modules[s], x))
        if last:
            loss = self._timed(lambda: self.t.autocast(self.t.bundle.loss, y, targets))
            if not recompute:
                self.loss_sum += loss.item() * len(indices)
                self.loss_samples += len(indices)
            y = loss * (len(indices) / self.t.global_batch)
        elif not recompute:
            self.store.put(step, ACTIVATION, s, j, y)
        self.saved[(s, j)] = (x, y, sizes)
        return self.saved[(s, j)]

    def backward(self, step: int, token: Token, holders: list[int], forward_holders: list[int]) -> None:
        """Run backward token ``token``; where its forward ran elsewhere (an idle worker stole it
        from a straggler), recompute that forward here first."""
        s, j = token.level, token.index
        if (s, j) not in self.saved:
            self.recomputed += 1
            self.forward(step, Token(s, False, j), forward_holders, recompute=True)
        x, out, sizes = self.saved.pop((s, j))
        if s == self.dag.num_levels - 1:
            self._timed(out.backward)
        else:
            grads = values.to_device(self.store.fetch(step, GRADIENT, s, j, holders[0]), self.t.runtime.device)
            self._timed(lambda: values.backward(out, list(grads)))
        if s > 0:
            for q, chunk in enumerate(values.split_input_grads(x, self.kinds_into(s), sizes)):
                self.store.put(step, GRADIENT, s - 1, j * len(sizes) + q, chunk)

    def kinds_into(self, s: int) -> list[str] | None:
        """How the values entering stage ``s`` merge (None: one tensor, an ``nn.Sequential``'s)."""
        kinds = self.t.bundle.boundary_kinds
        return None if kinds is None else kinds[self.t.plan.stages[s].layer_start - 1]

    def iteration(self, step: int) -> float:
        """Pull tokens until the server says the iteration is over; returns seconds spent waiting."""
        store, rank = self.t.runtime.store, self.t.runtime.rank
        done, wait_s = None, 0.0
        while True:
            start = time.perf_counter()
            store.queue_push(keys.flexible_requests(step), json.dumps({"rank": rank, "done": done}))
            reply = self.reply(step)
            wait_s += time.perf_counter() - start
            if reply.get("end"):
                return wait_s
            token = Token(*reply["token"])
            if token.backward:
                self.backward(step, token, reply["inputs"], reply["forward_inputs"])
            else:
                self.forward(step, token, reply["inputs"])
            self.tokens += 1
            done = reply["token"]

    def reply(self, step: int) -> dict:
        """The token server's reply to this worker's request in ``step``, awaited in slices: a worker
        of a job whose survivors keep their state stops waiting once another failed (the server may
        be the one that did)."""
        key = keys.flexible_reply(step, self.t.runtime.rank)
        popped = self.t.wait_in_slices(
            lambda: self.replies.queue_pop(key, True),
            f"no token reply in step {step}",
            lambda: stop_if_another_failed(self.t),
        )
        return json.loads(popped)

    def sync(self) -> float:
        """Each stage's workers sum their gradients (stage order: the same on every rank)."""
        start = time.perf_counter()
        runtime = self.t.runtime
        tied = tied_ids(self.t, self.t.tied)  # summed over all their holders, once, below
        for s in self.stages:
            group_ranks = tuple(self.t.plan.rank_of(d) for d in self.t.plan.stages[s].devices)
            params = [p for p in self.modules[s].parameters() if id(p) not in tied]
            if len(group_ranks) > 1 and params:
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
                dist.all_reduce(flat, group=runtime.group(group_ranks))
                offset = 0
                for p in params:
                    p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
        sum_tied_over_holders(self.t, self.t.tied)
        return time.perf_counter() - start


class Flexible(Lockstep):
    """The flexible hybrid: rank 0 serves each iteration's tokens, every worker pulls until the
    iteration is done, then each stage's workers sum their gradients and step."""

    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        runtime = trainer.runtime
        self.worker = FlexibleWorker(trainer)
        self.kept = KeptState(trainer)
        self.service = None
        if runtime.rank == 0:
            self.service = TokenService(
                runtime.new_store_client(), trainer.plan, range(trainer.start_step, runtime.cfg.steps)
            )
            self.service.thread.start()
        if runtime.world_size > 1:
            self.worker.store.thread.start()

    def step(self, work: Work) -> StepResult:
        worker = self.worker
        self._raise_thread_errors()
        worker.reset_counters()
        worker.store.forget_before(work.step)
        try:
            wait_s = worker.iteration(work.step)
            comm_s = worker.sync()
            committed = self.kept.optimizer_step(work.step)  # every stage it holds (clipping, the scheduler)
        except BaseException:
            self._raise_thread_errors()  # a dead server or data thread is the cause: say so
            raise
        return StepResult(
            worker.samples,
            worker.loss_sum,
            worker.compute_s,
            comm_s,
            wait_s + committed.get("commit_s", 0.0),
            loss_samples=worker.loss_samples,
            extra={"tokens": worker.tokens, "recomputed": worker.recomputed, **committed},
        )

    def kept_state(self) -> KeptState:
        return self.kept

    def stopped_before(self, step: int) -> None:
        if self.service is not None and step < self.trainer.runtime.cfg.steps:
            TokenService.stop_before(self.trainer.runtime.store, step)

    def _raise_thread_errors(self) -> None:
        for thread_owner in (self.service, self.worker.store):
            if thread_owner is not None and thread_owner.error is not None:
                raise thread_owner.error

    def finish(self) -> None:
        runtime = self.trainer.runtime
        self._raise_thread_errors()
        if runtime.world_size > 1:
            self.worker.store.stop_peer((runtime.rank + 1) % runtime.world_size)
            self.worker.store.thread.join()
        if self.service is not None:
            self.service.thread.join()
        self._raise_thread_errors()

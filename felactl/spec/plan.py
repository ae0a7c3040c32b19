"""The Plan format: the contract between planning and running.

A plan says which devices take part (their order is the rank order), how the layers are cut into
stages, which workers run each stage with which share of its samples and micro-batch, how micro-
batches flow between stages (``schedule``), how replicas synchronise (``sync``) and over which
collective trees, and what the planner predicted, so a run can be compared with its prediction.
The stages and where each device lives are :mod:`felactl.spec.stages`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from felactl import limits
from felactl.spec.codec import SCHEMA_VERSION, FieldProblem, check_header, positive
from felactl.spec.stages import Placement, Stage, StageWorker


class SyncMode(str, enum.Enum):
    BSP = "bsp"
    """Allreduce of each stage's gradients every iteration."""
    TOKENS = "tokens"
    """Fela: workers pull tokens from a token server; gradients weighted by samples (still BSP)."""
    WBSP = "wbsp"
    """Worker-busy synchronous parallel: push deltas every step, rounds close when all pushed."""
    SDPIPE = "sdpipe"
    """SDPipe: a central scheduler forms groups; each group averages weights by allreduce."""


class Schedule(str, enum.Enum):
    TOKENS = "tokens"
    """Micro-batches are tokens pulled by any worker of the stage (Fela)."""
    ONE_F_ONE_B = "1f1b"
    """Static pipelines (``Plan.pipelines``), one forward one backward."""
    GPIPE = "gpipe"
    """Static pipelines, all forwards then all backwards."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRef:
    name: str
    source: str
    """Built-in name or ``package.module:function``."""
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncSpec:
    mode: SyncMode = SyncMode.BSP
    use_trees: bool = True
    """BSP: allreduce along the plan's collective trees where present."""
    overlap: bool = False
    """WBSP: push and pull in a second thread while the first trains."""
    max_group: int = 2
    """SDPipe: a group closes when this many workers are ready..."""
    initial_wait_ms: float = 1.0
    """...or this long after the first arrived (then adapted: x2 up to 10 ms, x0.9 down to 0.01 ms)."""
    connect_every: int = 4
    """SDPipe: every P-th local step a worker waits, averaging with each worker that arrives, until the
    groups' union connects every replica of its stage."""
    token_policy: str = "ads+hf"
    """Tokens: ``ads``, ``hf`` or ``ads+hf`` (see SEEDS.md section 1)."""

    def __post_init__(self) -> None:
        if self.max_group < 2:
            raise FieldProblem("max_group", f"must be >= 2, got {self.max_group}")
        positive("initial_wait_ms", self.initial_wait_ms, limits.MILLISECONDS)
        positive("connect_every", self.connect_every, limits.COUNT)
        if self.token_policy not in ("ads", "hf", "ads+hf"):
            raise FieldProblem("token_policy", f"must be one of ads, hf, ads+hf, got {self.token_policy!r}")


TREE_PIECE_BYTES = 1 << 20
"""The largest piece a tree's link carries at once: small enough that a tree's depth fills quickly
and the pieces deal out close to the trees' weights, large enough that each message's fixed cost
(tens of microseconds in gloo) stays small next to its transfer."""

MIN_PIECES_PER_TREE = 128
"""A buffer is cut into at least this many pieces per tree (down to :data:`MIN_TREE_PIECE_BYTES`),
so that it streams through the depth of the trees and splits by their weights. A piece crosses a
tree's every hop before the tree is done (the fill), so a tree D deep pays about 2 D pieces'
time beyond its transfer: 128 pieces keep that to a few percent. (8 pieces of a 16 MiB sum over
the fragment testbed's two trees reached 0.53 of the allreduce's bound, 128 reach 0.84;
BENCHMARKS.md, "Trees at run time".)"""

MIN_TREE_PIECE_BYTES = 64 << 10
"""The smallest piece: each message costs gloo a fixed few tens of microseconds of CPU at either
end (measured on loopback: 16 KiB messages cost 100 us of CPU each, one after another), which a
node held to a share of a core pays several times over; at 64 KiB that stays below the transfer
of the piece on the slowest links the trees are for."""


PIECE_ALIGN_BYTES = 8
"""Pieces are a whole number of elements of any dtype up to this size (:func:`tree_piece_bytes`)."""


def tree_piece_bytes(num_bytes: float, num_trees: int, largest: int = TREE_PIECE_BYTES) -> int:
    """The bytes of each piece an allreduce of ``num_bytes`` over ``num_trees`` trees (the more of
    a collective's broadcast and reduce trees) streams in: the rule the runtime cuts by
    (``felactl.agents.worker.sync.trees``) and the planner prices the pipeline's fill by
    (``felactl.optimizer.tree_cost``), in one place so they cannot drift apart."""
    wanted = MIN_PIECES_PER_TREE * max(1, num_trees)
    # the runtime cuts by whole elements: a size that is not would give it one piece more than priced
    even = PIECE_ALIGN_BYTES * math.ceil(num_bytes / wanted / PIECE_ALIGN_BYTES)
    return int(max(min(largest, even), min(MIN_TREE_PIECE_BYTES, largest)))


def deal(weights: list[float], count: int) -> list[int]:
    """Which tree each of ``count`` pieces goes to: smooth weighted round robin, so that every
    prefix of the pieces is split close to the weights (and every rank deals the same). The
    runtime deals its pieces so, and the planner prices the trees by the same deal: a buffer of
    a few pieces leaves a light tree none, and then its depth costs nothing."""
    total, credit, order = sum(weights), [0.0] * len(weights), []
    for _ in range(count):
        for i, weight in enumerate(weights):
            credit[i] += weight
        best = max(range(len(weights)), key=lambda i: credit[i])
        credit[best] -= total
        order.append(best)
    return order


def _names(roots) -> str:
    return ", ".join(sorted(str(r) for r in roots))


def tree_root(edges: Sequence[Sequence[str]]) -> str | None:
    """The root of a tree given by its ``[parent, child]`` edges: the one parent that is no one's
    child (None where there is not exactly one)."""
    children = {child for _, child in edges}
    roots = {parent for parent, _ in edges if parent not in children}
    return next(iter(roots)) if len(roots) == 1 else None


def root_rates(trees: Sequence[tuple[object, float]]) -> list[tuple[object, float]]:
    """Each root of ``trees`` ((root, weight) each), in order of first appearance, with the rate
    its trees carry: how the pieces of an allreduce are shared among its roots (the broadcast
    trees'; :func:`deal_by_root`)."""
    rates: dict[object, float] = {}
    for root, weight in trees:
        rates[root] = rates.get(root, 0.0) + weight
    return list(rates.items())


def dealt_shares(trees: Sequence[tuple[object, float]], roots: Sequence[tuple[object, float]]) -> list[float]:
    """The share of the data each of ``trees`` ((root, weight) each) carries when pieces are dealt
    as :func:`deal_by_root` deals them: its root's share of the roots' rate, split among the
    root's trees by weight."""
    total = sum(rate for _, rate in roots)
    rate_of = dict(roots)
    family = dict(root_rates(trees))
    missing = next((root for root, _ in trees if root not in rate_of), None)
    if missing is not None:
        raise ValueError(f"a tree is rooted at {missing!r}, to which no pieces are dealt")
    return [rate_of[root] / total * weight / family[root] for root, weight in trees]


def deal_by_root(trees: Sequence[tuple[object, float]], roots: Sequence[tuple[object, float]], count: int) -> list[int]:
    """Which of ``trees`` ((root, weight) each) each of ``count`` pieces goes to, where the pieces
    are first dealt to the ``roots`` ((root, rate) each, :func:`root_rates` of the broadcast trees),
    then each root's pieces to that root's trees by weight (:func:`deal` at both levels). The
    broadcast and the reduce trees are both dealt so, over the same roots, so that a piece goes up
    and comes down trees of one root, which holds its whole sum in between. With one root this is
    :func:`deal` over the trees."""
    to_root = deal([rate for _, rate in roots], count)
    dealt = []
    for i, (root, _) in enumerate(roots):
        members = [k for k, (tree_root_, _) in enumerate(trees) if tree_root_ == root]
        share = to_root.count(i)
        if share and not members:
            raise ValueError(f"pieces are dealt to root {root!r}, which has no tree of this kind")
        dealt.append(iter([members[j] for j in deal([trees[k][1] for k in members], share)]))
    return [next(dealt[i]) for i in to_root]


FIRST_BUCKET_BYTES = 1 << 20
"""The first gradient bucket closes at this many bytes (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``): the
last layers' gradients start their sum while backward still runs through the others."""

BUCKET_BYTES = 25 << 20
"""Every later bucket closes at this many bytes (DDP's ``bucket_cap_mb`` default)."""


def gradient_buckets(sizes: Sequence[int]) -> list[int]:
    """The bucket of each gradient, ``sizes`` (bytes) in the order backward produces them: a bucket
    closes once it holds at least its cap (:data:`FIRST_BUCKET_BYTES`, then :data:`BUCKET_BYTES`),
    as DDP assigns its buckets (``dist._compute_bucket_assignment_by_size``). The rule the
    runtime's buckets follow (DDP under bsp, ``sync.buckets.GradBuckets`` under tokens) and the
    planner prices the overlap of sync with backward by (``CostModel.exposed_sync_s``)."""
    index, filled, buckets = 0, 0, []
    for size in sizes:
        buckets.append(index)
        filled += size
        if filled >= (FIRST_BUCKET_BYTES if index == 0 else BUCKET_BYTES):
            index, filled = index + 1, 0
    return buckets


@dataclass(frozen=True, kw_only=True, slots=True)
class Tree:
    edges: tuple[tuple[str, ...], ...]
    """Directed edges ``[parent, child]`` of a spanning arborescence of the group's devices."""
    weight: float
    """Rate this tree carries, GB/s."""

    def __post_init__(self) -> None:
        positive("weight", self.weight)
        for i, edge in enumerate(self.edges):
            if len(edge) != 2:
                raise FieldProblem(f"edges[{i}]", f"an edge is [parent, child], got {list(edge)}")
        if self.edges and self.root is None:
            raise FieldProblem("edges", "a tree grows from one root: exactly one parent must be no one's child")

    @property
    def root(self) -> str | None:
        """The device the tree grows from (:func:`tree_root`)."""
        return tree_root(self.edges)


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    group: str
    """What the group synchronises, e.g. ``stage0``."""
    devices: tuple[str, ...]
    root: str
    """The root of the (first) broadcast tree. Trees packed for an allreduce where links differ by
    direction may grow from several roots, as a ring's reduce-scatter and all-gather give every
    device a part of the sum: each root's pieces go up its reduce trees and down its broadcast
    trees, shared among the roots by the rate of their broadcast trees (:func:`deal_by_root`)."""
    trees: tuple[Tree, ...] = ()
    reduce_trees: tuple[Tree, ...] = ()
    """Trees the reduce runs up, where the graph is asymmetric enough that trees packed for that
    direction beat reversing ``trees``: arborescences written ``[parent, child]`` as ``trees`` are,
    each rooted where some broadcast tree is, but the data flows child -> parent (over the link
    child -> parent). Empty: the reduce runs up ``trees`` reversed."""
    rate_gbps: float
    """Broadcast rate of the packed trees, GB/s (with several roots: the sum of their rates)."""
    bound_gbps: float
    """Min-cut upper bound of a broadcast from the root (Edmonds), GB/s."""
    ring_gbps: float
    """Rate of the best ring over the same devices, GB/s (0 where no ring exists)."""

    @property
    def roots(self) -> list[str]:
        """The devices the broadcast trees grow from, in order (just ``root`` without trees)."""
        return [root for root, _ in root_rates([(t.root, t.weight) for t in self.trees])] or [self.root]

    def __post_init__(self) -> None:
        if self.root not in self.devices:
            raise FieldProblem("root", f"{self.root!r} is not one of the group's devices")
        positive("rate_gbps", self.rate_gbps, allow_zero=True)
        positive("bound_gbps", self.bound_gbps, allow_zero=True)
        positive("ring_gbps", self.ring_gbps, allow_zero=True)
        members = set(self.devices)
        for key in ("trees", "reduce_trees"):
            for t, tree in enumerate(getattr(self, key)):
                for e, (a, b) in enumerate(tree.edges):
                    if a not in members or b not in members:
                        raise FieldProblem(f"{key}[{t}].edges[{e}]", f"edge {a} -> {b} leaves the group")
        if self.reduce_trees:
            down = {tree.root for tree in self.trees}
            up = {tree.root for tree in self.reduce_trees}
            if down != up:  # a piece dealt to a root must have a way up to it and a way down from it
                raise FieldProblem(
                    "reduce_trees",
                    f"rooted at {_names(up)} where the broadcast trees are rooted at {_names(down)}: "
                    "each root needs trees both ways",
                )


SIMULATION_TOLERANCE = 0.10
"""How far (relative to the prediction) a plan's simulated iteration may be before the plan says
that the two disagree."""


def simulation_agrees(predicted_s: float, simulated_s: float | None) -> bool:
    """Whether a simulated iteration is within :data:`SIMULATION_TOLERANCE` of the predicted one
    (True where nothing was simulated)."""
    return simulated_s is None or abs(simulated_s - predicted_s) <= SIMULATION_TOLERANCE * predicted_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    iteration_s: float
    samples_per_s: float
    baselines: dict[str, float] = field(default_factory=dict)
    """Predicted iteration time of each baseline (``dp``, ``mp``, ``hp``, ``no_trees``), seconds."""
    baselines_missing: dict[str, str] = field(default_factory=dict)
    """Why each baseline absent from ``baselines`` has no plan here (e.g. it does not fit)."""
    simulated_iteration_s: float | None = None
    """The discrete-event simulator's iteration time under this plan."""
    simulated_peak_memory_gb: dict[str, float] = field(default_factory=dict)
    """Each device's peak memory in the simulated iteration (weights, gradients, AdamW state and the
    activations it holds), GB."""

    def __post_init__(self) -> None:
        positive("iteration_s", self.iteration_s)
        positive("samples_per_s", self.samples_per_s)

    @property
    def simulation_agrees(self) -> bool:
        """Whether the simulator's iteration is within :data:`SIMULATION_TOLERANCE` of the prediction."""
        return simulation_agrees(self.iteration_s, self.simulated_iteration_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverInfo:
    name: str
    status: str
    solve_s: float
    gap: float | None = None
    """Relative optimality gap where the search stopped short of proving its plan optimal: a time
    limit, or a ``near optimal`` plan within the solver's held gap (``optimizer.ilp.HELD_GAP``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Training:
    optimizer: str = "adamw"
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adamw"):
            raise FieldProblem("optimizer", f"must be sgd or adamw, got {self.optimizer!r}")
        positive("lr", self.lr)
        if (problem := limits.SEED.problem(self.seed)) is not None:
            raise FieldProblem("seed", problem)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    kind: str = "Plan"
    schema_version: int = SCHEMA_VERSION
    cluster: str
    """Name of the cluster spec planned for."""
    model: ModelRef
    devices: tuple[str, ...]
    """The devices that take part; a worker's RANK is its device's index here."""
    global_batch: int
    schedule: Schedule = Schedule.TOKENS
    sync: SyncSpec = field(default_factory=SyncSpec)
    training: Training = field(default_factory=Training)
    stages: tuple[Stage, ...]
    pipelines: tuple[tuple[str, ...], ...] = ()
    """For static schedules: replica r runs stage s on ``pipelines[r][s]``."""
    collectives: tuple[Collective, ...] = ()
    placement: tuple[Placement, ...] = ()
    """One entry per device, in ``devices`` order: its node, kind and local index. Empty: every
    device is a CPU slot of the one node the job is launched on."""
    predicted: Prediction | None = None
    solver: SolverInfo | None = None

    def __post_init__(self) -> None:
        check_header(self.kind, "Plan", self.schema_version)
        positive("global_batch", self.global_batch, limits.BATCH)
        if not self.devices:
            raise FieldProblem("devices", "a plan needs at least one device")
        if len(set(self.devices)) != len(self.devices):
            raise FieldProblem("devices", "a device is listed twice")
        if not self.stages:
            raise FieldProblem("stages", "a plan needs at least one stage")
        self._check_stages()
        self._check_pipelines()
        self._check_collectives()
        self._check_placement()

    def _check_placement(self) -> None:
        if not self.placement:
            return
        if len(self.placement) != len(self.devices):
            raise FieldProblem(
                "placement", f"needs one entry per device ({len(self.devices)}), got {len(self.placement)}"
            )
        for i, (placed, dev) in enumerate(zip(self.placement, self.devices)):
            if placed.device != dev:
                raise FieldProblem(f"placement[{i}].device", f"must be {dev!r} (devices[{i}]), got {placed.device!r}")

    def _check_stages(self) -> None:
        members = set(self.devices)
        used = set()
        expected_start = 0
        for s, stage in enumerate(self.stages):
            if stage.layer_start != expected_start:
                raise FieldProblem(
                    f"stages[{s}].layer_start",
                    f"stages must be consecutive: expected {expected_start}, got {stage.layer_start}",
                )
            expected_start = stage.layer_end
            for w, worker in enumerate(stage.workers):
                if worker.device not in members:
                    raise FieldProblem(
                        f"stages[{s}].workers[{w}].device", f"{worker.device!r} is not in the plan's devices"
                    )
                used.add(worker.device)
        idle = [d for d in self.devices if d not in used]
        if idle:
            raise FieldProblem("devices", f"device {idle[0]!r} runs no stage")

    def _check_pipelines(self) -> None:
        if self.schedule is Schedule.TOKENS:
            return
        if not self.pipelines:
            raise FieldProblem("pipelines", f"schedule {self.schedule.value} needs the pipelines' devices")
        for r, pipe in enumerate(self.pipelines):
            if len(pipe) != len(self.stages):
                raise FieldProblem(
                    f"pipelines[{r}]", f"needs one device per stage ({len(self.stages)}), got {len(pipe)}"
                )
            for s, dev in enumerate(pipe):
                if dev not in self.stages[s].devices:
                    raise FieldProblem(f"pipelines[{r}][{s}]", f"{dev!r} does not run stage {s}")

    def _check_collectives(self) -> None:
        members = set(self.devices)
        for c, collective in enumerate(self.collectives):
            for d, dev in enumerate(collective.devices):
                if dev not in members:
                    raise FieldProblem(f"collectives[{c}].devices[{d}]", f"{dev!r} is not in the plan's devices")

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layer_end

    def rank_of(self, device: str) -> int:
        return self.devices.index(device)

    def nodes(self) -> dict[str, tuple[str, ...]]:
        """Node name -> its devices in rank order ({"": devices} when the plan has no placement)."""
        if not self.placement:
            return {"": self.devices}
        out: dict[str, list[str]] = {}
        for placed in self.placement:
            out.setdefault(placed.node, []).append(placed.device)
        return {node: tuple(devs) for node, devs in out.items()}


def data_parallel_plan(
    *,
    model: ModelRef,
    num_layers: int,
    devices: tuple[str, ...] | list[str],
    global_batch: int,
    micro_batch: int,
    sync: SyncSpec | None = None,
    training: Training | None = None,
    shares: tuple[float, ...] | list[float] | None = None,
    cluster: str = "local",
) -> Plan:
    """One stage with every layer on every device (equal shares unless given): plain data parallel,
    the plan a hand-run job, a test or a benchmark wants without profiling and planning."""
    shares = shares or [1 / len(devices)] * len(devices)
    workers = tuple(StageWorker(device=d, share=s) for d, s in zip(devices, shares))
    return Plan(
        cluster=cluster,
        model=model,
        devices=tuple(devices),
        global_batch=global_batch,
        sync=sync or SyncSpec(),
        training=training or Training(),
        stages=(Stage(layer_start=0, layer_end=num_layers, micro_batch=micro_batch, workers=workers),),
    )

"""Allreduce along the plan's packed spanning trees (Blink), over torch.distributed point-to-point.

The planner packs weighted broadcast trees rooted at one device of each stage group
(``plan.collectives``; felactl.optimizer.collectives) and predicts the stage's sync time as a
pipelined reduce + broadcast at the trees' rate. This module runs exactly that: the flat buffer is
cut into pieces (:data:`PIECE_BYTES`), the pieces are dealt to the trees in proportion to their
weights (each tree's share of the packed rate), and each piece is summed up its reduce tree to the
root (children first, each parent adds what its children send) and sent back down its broadcast
tree. The pieces stream: a rank posts its receives :data:`WINDOW` pieces ahead and never waits
for a send, and the reduce and the broadcast run in two threads, so while piece p climbs a tree,
the pieces before it descend, every tree moves at once and each link carries data both ways. (In
one thread, a rank's wait for a piece coming down held up the pieces it should send up: every
step then cost a round trip from leaf to root and back, 5x the predicted time on a testbed.)

Deadlock-free by construction: each direction walks the pieces in one order on every rank and
only ever blocks on a receive, whose matching send is issued by a rank further along the same walk
(deeper in the reduce tree, nearer the root in the broadcast tree); the root's broadcast of a piece
waits only for its own reduce of it. Messages between two ranks keep their order per direction,
and reduce and broadcast use their own tags.

Why not the backend's allreduce: gloo's ring crosses every link of its rank order, thin ones
included, and sends 2(n-1)/n of the data over each; the trees route around thin links
(BENCHMARKS.md, "Trees at run time").

BSP installs it as a ``DistributedDataParallel`` communication hook (DDP keeps its buckets; only
the collective changes). The hook blocks the backward thread for its bucket's transfer, so unlike
gloo's asynchronous allreduce a bucket does not overlap the rest of the backward; on one core per
worker nothing overlaps anyway. Pipelines use it for their replicas' flat buffer.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from felactl.spec import Plan

PIECE_BYTES = 1 << 20
"""The largest piece a link carries at once: small enough that a tree's depth fills quickly and
the pieces deal out close to the trees' weights, large enough that each message's fixed cost
(tens of microseconds in gloo) stays small next to its transfer."""

MIN_PIECES_PER_TREE = 8
"""A small buffer is still cut into this many pieces per tree (down to :data:`MIN_PIECE_BYTES`),
so that it streams through the depth of the trees and splits by their weights."""

MIN_PIECE_BYTES = 16 << 10

WINDOW = 8
"""How many pieces ahead each direction posts its receives (the reduce's buffers: WINDOW x
children x piece), enough to keep every link of a tree a few pieces deep busy."""

_REDUCE_TAG, _BROADCAST_TAG = 1, 2


@dataclass(frozen=True)
class _Tree:
    weight: float
    parent: int | None
    """This rank's parent in the tree (None at the root)."""
    children: tuple[int, ...]


def deal(weights: list[float], count: int) -> list[int]:
    """Which tree each of ``count`` pieces goes to: smooth weighted round robin, so that every
    prefix of the pieces is split close to the weights (and every rank deals the same)."""
    total, credit, order = sum(weights), [0.0] * len(weights), []
    for _ in range(count):
        for i, weight in enumerate(weights):
            credit[i] += weight
        best = max(range(len(weights)), key=lambda i: credit[i])
        credit[best] -= total
        order.append(best)
    return order


class TreeAllreduce:
    """Sums a flat tensor in place over the ranks of one stage group along its packed trees
    (reducing up ``reduce_trees`` where the plan packed trees for that direction, else up the
    broadcast trees reversed), streamed in pieces as the module docstring says."""

    def __init__(
        self,
        trees: list[_Tree],
        group,
        size: int,
        reduce_trees: list[_Tree] | None = None,
        *,
        piece_bytes: int = PIECE_BYTES,
    ):
        self.trees, self.group, self.size = trees, group, size
        self.reduce_trees = reduce_trees or trees
        self.piece_bytes = piece_bytes

    def _pieces(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        nbytes = flat.numel() * flat.element_size()
        wanted = MIN_PIECES_PER_TREE * max(len(self.trees), len(self.reduce_trees))
        piece = max(min(self.piece_bytes, math.ceil(nbytes / wanted)), min(MIN_PIECE_BYTES, self.piece_bytes))
        return flat.split(max(1, piece // flat.element_size()))

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.numel() == 0:
            return flat
        pieces = self._pieces(flat)
        up = [self.reduce_trees[i] for i in deal([t.weight for t in self.reduce_trees], len(pieces))]
        down = [self.trees[i] for i in deal([t.weight for t in self.trees], len(pieces))]
        summed = [threading.Event() for _ in pieces]  # at the root: piece p's sum is complete
        failure: list[BaseException] = []

        def broadcast() -> None:
            try:
                self._broadcast(pieces, down, summed)
            except BaseException as exc:  # handed to the caller's thread
                failure.append(exc)

        thread = threading.Thread(target=broadcast, name="felactl-tree-broadcast", daemon=True)
        thread.start()
        try:
            self._reduce(pieces, up, summed)
        finally:
            if failure or thread.is_alive():
                for event in summed:  # a failed reduce must not leave the broadcast waiting on the root
                    event.set()
            thread.join()
        if failure:
            raise failure[0]
        return flat

    def _reduce(self, pieces, up: list[_Tree], summed: list[threading.Event]) -> None:
        """Every piece up its reduce tree, in order: wait for the children's partial sums (their
        receives posted WINDOW pieces ahead), add them, send the result to the parent."""
        parts: dict[int, list] = {}

        def post(p: int) -> None:
            parts[p] = []
            for child in up[p].children:
                buffer = torch.empty_like(pieces[p])
                parts[p].append((dist.irecv(buffer, src=child, group=self.group, tag=_REDUCE_TAG), buffer))

        sends = []
        for p in _posting_ahead(len(pieces), post):
            piece = pieces[p]
            for work, part in parts.pop(p):
                work.wait()
                piece.add_(part)
            if up[p].parent is None:
                summed[p].set()
            else:
                sends.append(dist.isend(piece, dst=up[p].parent, group=self.group, tag=_REDUCE_TAG))
        for work in sends:
            work.wait()

    def _broadcast(self, pieces, down: list[_Tree], summed: list[threading.Event]) -> None:
        """Every piece down its broadcast tree, in order: at the root once its sum is complete,
        elsewhere once the parent's copy has arrived (received straight into the piece: nothing
        arrives before this rank's own part has gone up, since the root's sum needs it)."""
        received: dict[int, object] = {}

        def post(p: int) -> None:
            if down[p].parent is not None:
                received[p] = dist.irecv(pieces[p], src=down[p].parent, group=self.group, tag=_BROADCAST_TAG)

        sends = []
        for p in _posting_ahead(len(pieces), post):
            piece = pieces[p]
            if down[p].parent is None:
                summed[p].wait()
            else:
                received.pop(p).wait()
            sends += [dist.isend(piece, dst=child, group=self.group, tag=_BROADCAST_TAG) for child in down[p].children]
        for work in sends:
            work.wait()


def _posting_ahead(count: int, post) -> Iterator[int]:
    """The pieces 0 .. count - 1 in order, each one's receives posted (``post(p)``) WINDOW pieces
    before it is reached."""
    for p in range(min(WINDOW, count)):
        post(p)
    for p in range(count):
        if p + WINDOW < count:
            post(p + WINDOW)
        yield p


def stage_trees(plan: Plan, stage: int, rank: int, group) -> TreeAllreduce | None:
    """The allreduce over the trees the plan packed for ``stage``'s group, from ``rank``'s side;
    None where the plan has none for it (then the backend's allreduce runs), and on NCCL: NCCL
    matches a pair's point-to-point messages by order alone (no tags), so the reduce and the
    broadcast could not stream between the same two GPUs in two threads; NCCL's own allreduce
    already builds rings and trees over NVLink."""
    if not plan.sync.use_trees:
        return None
    if dist.is_initialized() and dist.get_backend(group) != "gloo":
        return None
    devices = {w.device for w in plan.stages[stage].workers}
    collective = next((c for c in plan.collectives if set(c.devices) == devices and c.trees), None)
    if collective is None or len(devices) < 2:
        return None
    me = plan.devices[rank]
    built = []
    for packed in (collective.trees, collective.reduce_trees):
        trees = []
        for tree in packed:
            if not _spans(tree.edges, collective.root, devices) or tree.weight <= 0:
                return None  # not a spanning arborescence of this group: a receive would never be matched
            parent = next((a for a, b in tree.edges if b == me), None)
            children = tuple(plan.rank_of(b) for a, b in tree.edges if a == me)
            trees.append(_Tree(tree.weight, None if parent is None else plan.rank_of(parent), children))
        built.append(trees)
    return TreeAllreduce(built[0], group, len(devices), reduce_trees=built[1])


def _spans(edges, root: str, devices: set[str]) -> bool:
    """Whether ``edges`` form an arborescence from ``root`` over exactly ``devices``: n - 1 edges,
    one parent for every other device, none for the root, every device reached from the root."""
    parents = {}
    for a, b in edges:
        if b in parents or b == root or a not in devices or b not in devices:
            return False
        parents[b] = a
    if len(parents) != len(devices) - 1:
        return False
    children: dict[str, list[str]] = {}
    for b, a in parents.items():
        children.setdefault(a, []).append(b)
    reached, frontier = {root}, [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in reached:
                reached.add(child)
                frontier.append(child)
    return reached == devices


def ddp_hook(allreduce: TreeAllreduce, bucket):  # no return annotation: DDP rejects the string one
    """DDP communication hook: average one gradient bucket over the trees (DDP's own hook
    averages too; felactl's BSP scales the loss by the group size to turn it back into a sum)."""
    buffer = bucket.buffer()
    allreduce(buffer).div_(allreduce.size)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future

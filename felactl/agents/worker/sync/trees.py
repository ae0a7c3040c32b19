"""Allreduce along the plan's packed spanning trees (Blink), over torch.distributed point-to-point.

The planner packs weighted broadcast trees for each stage group, rooted at one device of it or,
where links differ by direction, at several (``plan.collectives``; felactl.optimizer.collectives),
and predicts the stage's sync time as a pipelined reduce + broadcast at the trees' rate. This
module runs exactly that: the flat buffer is cut into pieces
(:func:`felactl.spec.plan.tree_piece_bytes`), the pieces are dealt to the roots and each root's to
its trees in proportion to their weights (:func:`felactl.spec.plan.deal_by_root`), and each piece
is summed up a reduce tree to its root (children first, each parent adds what its children send)
and sent back down a broadcast tree of that root. The pieces stream: every tree and direction is a walk of its own (a thread, and a tag of its
own, since gloo matches a message by sender and tag), which posts its receives :data:`WINDOW`
pieces ahead and never waits for a send; so while piece p climbs a tree, the pieces before it
descend, every tree moves at its own pace and each link carries data both ways. (In one thread, a
rank's wait for a piece coming down held up the pieces it should send up: every step then cost a
round trip from leaf to root and back, 5x the predicted time on a testbed. With one walk per
direction over all trees, a piece late on one tree held up the other trees' pieces behind it.)

Deadlock-free by construction: each walk takes its tree's pieces in one order on every rank and
only ever blocks on a receive, whose matching send is issued by a rank further along the same walk
(deeper in the reduce tree, nearer the root in the broadcast tree); the root's broadcast of a piece
waits only for its own reduce of it (a piece's reduce and broadcast trees share their root).
Messages between two ranks keep their order per tag.

Why not the backend's allreduce: gloo's ring crosses every link of its rank order, thin ones
included, and sends 2(n-1)/n of the data over each; the trees route around thin links
(BENCHMARKS.md, "Trees at run time").

BSP installs it as a ``DistributedDataParallel`` communication hook (DDP keeps its buckets; only
the collective changes). The hook blocks the backward thread for its bucket's transfer, so unlike
gloo's asynchronous allreduce a bucket does not overlap the rest of the backward; on one core per
worker nothing overlaps anyway. Pipelines use it for their replicas' flat buffer, and tokens for
the stage's gradient buckets (:class:`~felactl.agents.worker.sync.buckets.GradBuckets`, one bucket
at a time in a thread of their own, so the sum still overlaps the last token's backward).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from felactl.spec import Plan
from felactl.spec.plan import TREE_PIECE_BYTES, deal_by_root, root_rates, tree_piece_bytes

WINDOW = 8
"""How many pieces ahead each walk posts its receives (a reduce walk's buffers: WINDOW x children
x piece), enough to keep every link of a tree a few pieces deep busy."""


@dataclass(frozen=True)
class _Tree:
    weight: float
    parent: int | None
    """This rank's parent in the tree (None at the root)."""
    children: tuple[int, ...]
    root: int
    """The tree's root (a rank): pieces dealt to a root go up and down trees of that root."""


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
        piece_bytes: int = TREE_PIECE_BYTES,
    ):
        self.trees, self.group, self.size = trees, group, size
        self.reduce_trees = reduce_trees or trees
        self.roots = root_rates([(t.root, t.weight) for t in trees])
        self.piece_bytes = piece_bytes
        self._process_group = group if group is not None else dist.group.WORLD
        self._group_rank = _GroupRanks(group)

    def _pieces(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        nbytes = flat.numel() * flat.element_size()
        piece = tree_piece_bytes(nbytes, max(len(self.trees), len(self.reduce_trees)), self.piece_bytes)
        return flat.split(max(1, piece // flat.element_size()))

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.numel() == 0:
            return flat
        pieces = self._pieces(flat)
        summed = [threading.Event() for _ in pieces]  # at its root: piece p's sum is complete
        walks = [
            functools.partial(self._reduce, pieces, order, tree, _tag(k, up=True), summed)
            for k, (tree, order) in enumerate(_walks(self.reduce_trees, self.roots, len(pieces)))
        ] + [
            functools.partial(self._broadcast, pieces, order, tree, _tag(k, up=False), summed)
            for k, (tree, order) in enumerate(_walks(self.trees, self.roots, len(pieces)))
        ]
        failure: list[BaseException] = []

        def run(walk) -> None:
            try:
                walk()
            except BaseException as exc:  # handed to the caller's thread
                failure.append(exc)
                for event in summed:  # a failed reduce must not leave a broadcast waiting on the root
                    event.set()

        threads = [threading.Thread(target=run, args=(w,), name="felactl-tree", daemon=True) for w in walks[1:]]
        for thread in threads:
            thread.start()
        run(walks[0])
        for thread in threads:
            thread.join()
        if failure:
            raise failure[0]
        return flat

    def _reduce(self, pieces, order: list[int], tree: _Tree, tag: int, summed: list[threading.Event]) -> None:
        """The pieces ``order`` up ``tree``, in that order: wait for the children's partial sums
        (their receives posted WINDOW pieces ahead), add them, send the result to the parent."""
        # WINDOW + 1 pieces are in flight at most (the next is posted before the current is added),
        # so that many receive buffers per child, reused round: no allocation per piece
        slots = [[torch.empty_like(pieces[0]) for _ in tree.children] for _ in range(WINDOW + 1)]
        parts: dict[int, list] = {}

        def post(position: int, p: int) -> None:
            n = pieces[p].numel()
            buffers = [slot[:n] for slot in slots[position % len(slots)]]
            parts[p] = [(self._recv(b, child, tag), b) for child, b in zip(tree.children, buffers)]

        sends = []
        for p in _posting_ahead(order, post):
            piece = pieces[p]
            for work, part in parts.pop(p):
                work.wait()
                piece.add_(part)
            if tree.parent is None:
                summed[p].set()
            else:
                sends.append(self._send(piece, tree.parent, tag))
        for work in sends:
            work.wait()

    def _broadcast(self, pieces, order: list[int], tree: _Tree, tag: int, summed: list[threading.Event]) -> None:
        """The pieces ``order`` down ``tree``, in that order: at the root once its sum is complete,
        elsewhere once the parent's copy has arrived (received straight into the piece: nothing
        arrives before this rank's own part has gone up, since the root's sum needs it)."""
        received: dict[int, object] = {}

        def post(position: int, p: int) -> None:
            if tree.parent is not None:
                received[p] = self._recv(pieces[p], tree.parent, tag)

        sends = []
        for p in _posting_ahead(order, post):
            piece = pieces[p]
            if tree.parent is None:
                summed[p].wait()
            else:
                received.pop(p).wait()
            sends += [self._send(piece, child, tag) for child in tree.children]
        for work in sends:
            work.wait()

    # The process group's own point-to-point calls, with the group's ranks worked out once:
    # torch.distributed's isend / irecv check their arguments and translate the rank on every
    # call, and a collective makes thousands (measured on loopback, 16 MiB in 64 KiB pieces:
    # 66 ms of CPU per call at a chain's middle rank, 49 with these and the reused buffers).

    def _send(self, tensor: torch.Tensor, rank: int, tag: int):
        return self._process_group.send([tensor], self._group_rank[rank], tag)

    def _recv(self, tensor: torch.Tensor, rank: int, tag: int):
        return self._process_group.recv([tensor], self._group_rank[rank], tag)


class _GroupRanks:
    """A global rank's rank in ``group`` (the trees name global ranks; the process group's own
    calls take its ranks), looked up once per rank."""

    def __init__(self, group):
        self.group, self.ranks = group, {}

    def __getitem__(self, rank: int) -> int:
        if rank not in self.ranks:
            world = self.group is None or self.group is dist.group.WORLD
            self.ranks[rank] = rank if world else dist.get_group_rank(self.group, rank)
        return self.ranks[rank]


def _walks(trees: list[_Tree], roots: list[tuple[int, float]], count: int) -> list[tuple[_Tree, list[int]]]:
    """Each tree with the pieces dealt to it (in order; ``spec.plan.deal_by_root``, the same
    roots for both directions); trees dealt none are left out."""
    orders: list[list[int]] = [[] for _ in trees]
    for p, k in enumerate(deal_by_root([(t.root, t.weight) for t in trees], roots, count)):
        orders[k].append(p)
    return [(tree, order) for tree, order in zip(trees, orders) if order]


def _tag(tree: int, *, up: bool) -> int:
    """Each tree and direction has its own tag: gloo matches a message by sender and tag, so every
    tree streams on its own and a piece late on one holds up none of another's."""
    return 1 + 2 * tree + (0 if up else 1)


def _posting_ahead(order: list[int], post) -> Iterator[int]:
    """The pieces of ``order`` in turn, each one's receives posted (``post(position, p)``, p at
    ``position`` in ``order``) WINDOW pieces before it is reached."""
    for i, p in enumerate(order[:WINDOW]):
        post(i, p)
    for i, p in enumerate(order):
        if i + WINDOW < len(order):
            post(i + WINDOW, order[i + WINDOW])
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
            if tree.root is None or not _spans(tree.edges, tree.root, devices) or tree.weight <= 0:
                return None  # not a spanning arborescence of this group: a receive would never be matched
            parent = next((a for a, b in tree.edges if b == me), None)
            children = tuple(plan.rank_of(b) for a, b in tree.edges if a == me)
            parent_rank = None if parent is None else plan.rank_of(parent)
            trees.append(_Tree(tree.weight, parent_rank, children, plan.rank_of(tree.root)))
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

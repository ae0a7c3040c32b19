"""Allreduce along the plan's packed spanning trees (Blink), over torch.distributed point-to-point.

The planner packs weighted broadcast trees rooted at one device of each stage group
(``plan.collectives``; felactl.optimizer.collectives) and predicts the stage's sync time from their
rate. This module runs exactly those trees: the flat buffer is cut into one contiguous chunk per
tree, sized by the tree's weight (its share of the packed rate), and each chunk is reduced up its
tree to the root (children first, each parent adds what its children send) and broadcast back down
the same edges. Every rank walks the trees in the same order and a tree is acyclic, so the blocking
sends always meet a receiver.

Why not the backend's allreduce: on this project's 2-core machine, gloo's ring allreduce of
gpt-mini's 1.1 MB of gradients between two single-core workers took 4.6–5.2 ms, the two-edge tree
1.7–1.9 ms (both measured in the same run); the link profile the planner uses predicts the tree.

BSP installs it as a ``DistributedDataParallel`` communication hook (DDP keeps its buckets; only
the collective changes). The hook's sends and receives block the backward thread, so unlike
gloo's asynchronous allreduce a bucket's transfer does not overlap the rest of the backward; on
one core per worker nothing overlaps anyway. Pipelines use it for their replicas' flat buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from felactl.spec import Plan


@dataclass(frozen=True)
class _Tree:
    weight: float
    parent: int | None
    """This rank's parent in the tree (None at the root)."""
    children: tuple[int, ...]


class TreeAllreduce:
    """Sums a flat tensor in place over the ranks of one stage group along its packed trees (and,
    where the plan packed trees for the reduce direction, reduces up those first, then broadcasts
    down the broadcast trees)."""

    def __init__(self, trees: list[_Tree], group, size: int, reduce_trees: list[_Tree] | None = None):
        self.trees, self.group, self.size, self.reduce_trees = trees, group, size, reduce_trees or None

    @staticmethod
    def _chunks(trees: list[_Tree], flat: torch.Tensor):
        """(tree, its contiguous chunk of ``flat``), chunks sized by the trees' weights."""
        n, start, total = flat.numel(), 0, sum(t.weight for t in trees)
        for i, tree in enumerate(trees):
            end = n if i == len(trees) - 1 else min(n, start + round(n * tree.weight / total))
            if end > start:
                yield tree, flat[start:end]
            start = end

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        if self.reduce_trees is None:
            for tree, chunk in self._chunks(self.trees, flat):
                self._reduce(tree, chunk)
                self._broadcast(tree, chunk)
            return flat
        for tree, chunk in self._chunks(self.reduce_trees, flat):  # the root ends with the whole sum
            self._reduce(tree, chunk)
        for tree, chunk in self._chunks(self.trees, flat):
            self._broadcast(tree, chunk)
        return flat

    def _reduce(self, tree: _Tree, chunk: torch.Tensor) -> None:
        if tree.children:  # what each child's subtree summed, added here
            incoming = torch.empty_like(chunk)
            for child in tree.children:
                dist.recv(incoming, src=child, group=self.group)
                chunk.add_(incoming)
        if tree.parent is not None:
            dist.send(chunk, dst=tree.parent, group=self.group)

    def _broadcast(self, tree: _Tree, chunk: torch.Tensor) -> None:
        if tree.parent is not None:
            dist.recv(chunk, src=tree.parent, group=self.group)  # the group's sum
        pending = [dist.isend(chunk, dst=child, group=self.group) for child in tree.children]
        for work in pending:
            work.wait()


def stage_trees(plan: Plan, stage: int, rank: int, group) -> TreeAllreduce | None:
    """The allreduce over the trees the plan packed for ``stage``'s group, from ``rank``'s side;
    None where the plan has none for it (then the backend's allreduce runs)."""
    if not plan.sync.use_trees:
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

"""The cost model's sync: what summing a stage's gradients over its group costs, over Blink trees,
a ring of direct links or of routes, or NCCL's rings, with the CPU a quota-held slot spends on it
and the calibration by measured syncs.

:class:`SyncCosts` is the sync part of :class:`felactl.optimizer.cost.CostModel`, which inherits
it: the fields it reads (``cluster``, ``model``, ``use_trees``, ``max_tree_devices``,
``sync_reference``, ``ring_order``, ``trees_ever_faster`` and the caches ``_collectives``,
``_shapes``, ``_sync``, ``_sync_factors``) are declared there, as are the compute and transfer
costs it asks (``_prefix_sums``, ``host_slowdown``, ``_direct_or_relay``). What a collective
costs on its own is priced in :mod:`felactl.optimizer.tree_cost` and
:mod:`felactl.optimizer.ring_cost`.

A stage group's sync is an allreduce of the stage's gradients (``param_bytes``), over the
group's packed Blink trees or a ring, whichever is faster when trees are on; a ring otherwise.
Where the group's direct links close no ring, the ring runs over routes (paths through other
devices, :meth:`SyncCosts.ring_sync_s`); a group that neither trees nor routes join costs
infinitely much, so the planner leaves its stage options out instead of refusing the cluster.
The runtime sums in DDP's buckets, each as soon as backward completed it, so a device's iteration
pays only what of the sum its last backward did not hide (:meth:`SyncCosts.exposed_sync_s`).
Where the model profile measured the whole model's sync on this cluster's devices
(``ModelSpec.data_parallel_sync``: a DDP step with and without sync, as training runs it), a
group inside the measured set costs that estimate times measured / estimate of the set (the
set's whole-model sum that backward did not hide, :meth:`SyncCosts.measured_sync_estimate_s`; at
least 1): on CPU slots the links' ping-pong prices gloo's allreduce several times too low.
A timing whose difference was not above its noise (no ``sync_ms``, or an old profile's 0) is
no measurement: its group keeps the link estimate, the floor sync never beats, and counts as
uncalibrated (``uncalibrated_cpu_groups``), so the plan says its sync is priced too low.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from felactl.errors import PlanInfeasible
from felactl.spec import Collective, DeviceKind, SyncTiming, cpu_slot_quota
from felactl.spec.plan import gradient_buckets

SYNC_CPU_S_PER_BYTE = 1.0e-9
"""Full-core CPU seconds per byte a member of a gloo allreduce sends (with the receive and the
add of as much): mlp's 3.7 MB summed over three testbed nodes cost each 4.4-5.6 ms of CPU, 4.9 MB
sent (BENCHMARKS.md, issue 15 item 4, "What still misses"). On a tenth of a core that is ~50 ms a step
nothing hides (:meth:`SyncCosts.quota_sync_cpu_s`); unpriced, three-speeds' DP plan measured
0.75 of its prediction with every node's own timings (eleventh session)."""


class SyncCosts:
    """The sync costs of a :class:`~felactl.optimizer.cost.CostModel` (module docstring)."""

    def collective(self, devices: tuple[str, ...]) -> Collective | None:
        """The packed trees of a group (cached), or None where trees are off, not worth it, or
        would not run: a group of GPUs syncs over NCCL's own allreduce (:meth:`on_nccl`), since
        the runtime streams Blink trees over gloo only."""
        if not self.use_trees or len(devices) < 2 or len(devices) > self.max_tree_devices or self.on_nccl(devices):
            return None
        key = tuple(sorted(devices))
        if key not in self._collectives:
            try:
                self._collectives[key] = self._pack_like(key)
            except PlanInfeasible:  # no spanning trees over the group's links: it syncs over a ring
                self._collectives[key] = None
        return self._collectives[key]

    def _pack_like(self, key: tuple[str, ...]) -> Collective:
        """The trees of ``key``: those of an earlier group with the same shape, renamed, else packed.

        The shape is what packing reads: the links among the group's devices (by position in the
        sorted group) and how the positions fall into nodes. Identical servers (or identical
        halves of a server) give identical shapes, so a cluster of them packs each shape once."""
        from felactl.optimizer.collectives import plan_collective
        from felactl.optimizer.graph import devices_by_node, local_signature

        position = {name: i for i, name in enumerate(key)}
        nodes = tuple(tuple(position[d] for d in names) for names in devices_by_node(self.cluster, key).values())
        shape = (nodes, local_signature(self.cluster, key))
        if shape not in self._shapes:
            self._shapes[shape] = (key, plan_collective(self.cluster, list(key), group="group"))
            return self._shapes[shape][1]
        first, packed = self._shapes[shape]
        rename = dict(zip(first, key))

        def renamed(trees):
            return tuple(replace(t, edges=tuple((rename[a], rename[b]) for a, b in t.edges)) for t in trees)

        return replace(
            packed,
            devices=tuple(rename[d] for d in packed.devices),
            root=rename[packed.root],
            trees=renamed(packed.trees),
            reduce_trees=renamed(packed.reduce_trees),
        )

    def sync_time_s(self, devices: tuple[str, ...], num_bytes: float) -> float:
        """Allreduce of ``num_bytes`` over ``devices``: trees or ring, whichever is faster, times the
        group's measured slowdown (:meth:`sync_factor`)."""
        if len(devices) < 2 or num_bytes <= 0:
            return 0.0
        key = (tuple(sorted(devices)), num_bytes)
        if key not in self._sync:
            group = key[0]
            self._sync[key] = self._link_sync_s(group, num_bytes) * self.sync_factor(group)
            self._sync[key] += self.quota_sync_cpu_s(group, num_bytes)
        return self._sync[key]

    def exposed_sync_s(self, devices: tuple[str, ...], start: int, end: int, device: str, micro_batch: int) -> float:
        """What the sum of layers [start, end)'s gradients over ``devices`` adds after ``device``
        ends the backward of its last micro-batch of the iteration (:meth:`_exposed_link_s`),
        times the group's measured slowdown (:meth:`sync_factor`)."""
        if len(devices) < 2:
            return 0.0
        group = tuple(sorted(devices))
        key = ("exposed", group, start, end, device, micro_batch)
        if key not in self._sync:
            exposed = self._exposed_link_s(group, start, end, device, micro_batch) * self.sync_factor(group)
            nbytes = sum(layer.param_bytes for layer in self.model.layers[start:end])
            self._sync[key] = exposed + self.quota_sync_cpu_s(group, nbytes)
        return self._sync[key]

    def quota_sync_cpu_s(self, group: tuple[str, ...], num_bytes: float) -> float:
        """What a sum of ``num_bytes`` costs the group's slowest quota-held CPU slot in CPU beyond
        its links: a member sends and receives 2 (n - 1) / n of the buffer and adds what it
        receives, :data:`SYNC_CPU_S_PER_BYTE` of a full core per byte sent, stretched by the slot's
        :meth:`host_slowdown`. That CPU comes out of the quota the backward computes on, so nothing
        hides it; the link profile saw it at a full core's speed, where it overlaps the transfer.
        0 where no member is held by a quota. Where the trees are the faster sum, their time
        already holds their own CPU as a bound (``tree_cost.TreeAllreduceCost.busiest_cpu``) and
        this adds the ring's CPU besides: a double count of part of it, left while the plans it
        prices measure within 20% (BENCHMARKS.md, "Measured plan quality", thirteenth session).
        Calibrated on data-parallel rings."""
        held = [self.cluster.device(d) for d in group]
        held = [d for d in held if d.kind is DeviceKind.CPU and cpu_slot_quota(d.model)]
        stretch = max((self.host_slowdown(d) for d in held), default=0.0)
        n = len(group)
        return 2 * (n - 1) / n * num_bytes * SYNC_CPU_S_PER_BYTE * stretch if n > 1 else 0.0

    def _exposed_link_s(self, group: tuple[str, ...], start: int, end: int, device: str, micro_batch: int) -> float:
        """The runtime sums gradients in buckets (:func:`~felactl.spec.plan.gradient_buckets`, DDP's
        under bsp, the same under tokens), each launched the moment backward has produced all of
        it and summed after the one before: bucket k is ready when backward has passed its
        earliest layer and done at ``max(ready_k, done_(k-1)) + allreduce(bytes_k)``. All but what
        is left when backward ends runs under it: with a 1 MiB first bucket, DDP's sum of a small
        model hid up to a third of itself (priced whole, data parallel on the fragment testbed
        read 0.405 s a step and ran 0.333)."""
        layers = [i for i in range(end - 1, start - 1, -1) if self.model.layers[i].param_bytes > 0]
        if not layers:
            return 0.0
        _, bwd = self._prefix_sums(self.cluster.device(device), micro_batch)
        ready: dict[int, float] = {}
        size: dict[int, int] = {}
        for i, bucket in zip(layers, gradient_buckets([self.model.layers[i].param_bytes for i in layers])):
            ready[bucket] = bwd[end] - bwd[i]  # layers end-1 down to i are through backward
            size[bucket] = size.get(bucket, 0) + self.model.layers[i].param_bytes
        done = 0.0
        for bucket in sorted(ready):
            done = max(done, ready[bucket]) + self._link_sync_s(group, size[bucket])
        return max(0.0, done - (bwd[end] - bwd[start]))

    def _link_sync_s(self, group: tuple[str, ...], num_bytes: float) -> float:
        """The faster of the ring (:meth:`ring_sync_s`) and the trees; inf where neither exists."""
        ring_s = self.ring_sync_s(group, num_bytes)
        tree_s = self.tree_sync_s(group, num_bytes)
        self.trees_ever_faster = self.trees_ever_faster or tree_s < ring_s
        return min(ring_s, tree_s)

    def tree_sync_s(self, group: tuple[str, ...], num_bytes: float) -> float:
        """Allreduce over the group's packed trees; inf where trees are off or cannot be packed.
        (:func:`tree_cost.allreduce_time_s`, whose rate and fill are worked out once per group.)"""
        from felactl.optimizer.tree_cost import tree_allreduce_cost

        if len(group) < 2 or num_bytes <= 0:
            return 0.0
        coll = self.collective(group)
        if coll is None:
            return math.inf
        key = ("trees", tuple(sorted(group)))
        if key not in self._sync:
            try:
                self._sync[key] = tree_allreduce_cost(
                    self.cluster, coll, lambda d: self.host_slowdown(self.cluster.device(d))
                )
            except PlanInfeasible:  # a link the trees need is missing: the ring (or routes) carries it
                self._sync[key] = None
        if self._sync[key] is None:
            return math.inf
        return self._sync[key].seconds(num_bytes)

    def ring_sync_s(self, group: tuple[str, ...], num_bytes: float) -> float:
        """Ring allreduce over the best ring of direct links (over the backend's ring in the rank
        order, where :attr:`ring_order` fixes it; on GPUs over the rings NCCL lays, :meth:`on_nccl`);
        where the group's direct links close no ring (two devices linked only through a third,
        one-way links), over the best ring of routes (:meth:`CostModel.link_time_s`'s paths, which
        may pass devices outside the group; the traffic they relay for the ring is not charged to
        them); inf where some device reaches no other."""
        if len(group) < 2 or num_bytes <= 0:
            return 0.0
        key = ("ring", group)
        if key not in self._sync:  # (fixed s, s per byte): the ring is found once per group
            self._sync[key] = self._ring_line(group)
        fixed_s, per_byte_s = self._sync[key]
        return fixed_s + num_bytes * per_byte_s

    def _ring_line(self, group: tuple[str, ...]) -> tuple[float, float]:
        """:meth:`ring_sync_s` as ``fixed_s + bytes * per_byte_s`` ((inf, inf) where no ring is)."""
        from felactl.optimizer.graph import GBPS_TO_BYTES_PER_S, best_ring_in_graph, ring_hops
        from felactl.optimizer.ring_cost import nccl_allreduce_line, ring_allreduce_line

        order = self._backend_ring(group)
        try:
            if self.on_nccl(group):
                return nccl_allreduce_line(self.cluster, list(group))
            return ring_allreduce_line(self.cluster, list(group), order=order)
        except PlanInfeasible:
            pass
        import networkx as nx

        routes = nx.DiGraph()
        routes.add_nodes_from(group)
        for a in group:
            for b in group:
                if a != b:
                    latency_s, per_byte_s = self._direct_or_relay(a, b)
                    if per_byte_s < math.inf:
                        routes.add_edge(a, b, capacity=1.0 / (per_byte_s * GBPS_TO_BYTES_PER_S), latency_s=latency_s)
        if order is None:
            order, bottleneck_gbps = best_ring_in_graph(routes)
        else:
            bottleneck_gbps = min(routes.edges[h]["capacity"] if routes.has_edge(*h) else 0.0 for h in ring_hops(order))
        if bottleneck_gbps <= 0:
            return math.inf, math.inf
        slowest_s = max(routes.edges[h]["latency_s"] for h in ring_hops(order))
        steps = 2 * (len(group) - 1)
        return steps * slowest_s, steps / len(group) / (bottleneck_gbps * GBPS_TO_BYTES_PER_S)

    def ranks_decide_ring(self, group: Sequence[str]) -> bool:
        """Whether the rank order decides the ring the backend's allreduce takes over ``group``:
        gloo's on CPU devices does (:func:`~felactl.optimizer.collectives.gloo_ring`); NCCL builds
        its own rings on GPUs, whatever the ranks."""
        return all(self.cluster.device(d).kind == DeviceKind.CPU for d in group)

    def on_nccl(self, group: Sequence[str]) -> bool:
        """Whether ``group`` syncs over NCCL's own rings, not trees (:func:`ring_cost.on_nccl`)."""
        from felactl.optimizer.ring_cost import on_nccl

        return on_nccl(self.cluster, group)

    def _backend_ring(self, group: tuple[str, ...]) -> tuple[str, ...] | None:
        """The ring the backend's allreduce follows over ``group`` where the rank order fixes it
        (:attr:`ring_order`, :meth:`ranks_decide_ring`); None for the best ring."""
        from felactl.optimizer.collectives import gloo_ring

        if self.ring_order is None or not self.ranks_decide_ring(group):
            return None
        members = set(group)
        return gloo_ring([d for d in self.ring_order if d in members])

    def sync_factor(self, group: tuple[str, ...]) -> float:
        """How many times its link estimate a group's sync takes, from the model profile's
        ``data_parallel_sync``: a measurement on this cluster (by name) over a set of devices that
        holds the whole group gives measured / link estimate of the measured set; the most such
        factor, else 1. Never below 1: sync cannot beat what its links move, and a lower
        measurement is noise. Subsets share their superset's factor, so the planner sees a
        calibrated cost for every group on those slots, not just the measured one."""
        return max((factor for measured, factor in self._calibrations() if measured.issuperset(group)), default=1.0)

    def _calibrations(self) -> list[tuple[frozenset[str], float]]:
        """(measured device set, measured / link estimate of it, at least 1) for each of the
        model profile's sync timings on this cluster (by name) whose devices it has and that told
        sync apart from noise (``SyncTiming.measured``). The link
        estimates come from a cost model of their own, so working them out neither needs this
        cluster to hold the measured set (see ``sync_reference``) nor counts as a sync asked for
        (``trees_ever_faster``)."""
        if self._sync_factors is None:
            reference = self.sync_reference or self.cluster
            names = set(reference.device_names)
            links = type(self)(reference, self.model, use_trees=self.use_trees, max_tree_devices=self.max_tree_devices)
            self._sync_factors = []
            for timing in self.model.data_parallel_sync:
                if not timing.measured or timing.cluster != reference.name or not names.issuperset(timing.devices):
                    continue
                link_s = links.measured_sync_estimate_s(timing)
                if link_s > 0:
                    self._sync_factors.append((frozenset(timing.devices), max(1.0, timing.sync_ms / 1e3 / link_s)))
        return self._sync_factors

    def measured_sync_estimate_s(self, timing: SyncTiming) -> float:
        """The link estimate of what a profile's ``data_parallel_sync`` timing measured: a DDP step
        of the whole model with its sum less one without, on :meth:`timed_sync_device`, so the
        sum partly hidden under backward."""
        group = tuple(sorted(timing.devices))
        device = self.timed_sync_device(timing)
        return self._exposed_link_s(group, 0, self.model.num_layers, device, timing.micro_batch)

    def timed_sync_device(self, timing: SyncTiming) -> str:
        """The device of a measured set whose whole-model backward is longest: the last bucket
        waits for it, so the measured step's exposed sum is its."""
        return max(
            sorted(timing.devices),
            key=lambda d: self._prefix_sums(self.cluster.device(d), timing.micro_batch)[1][-1],
        )

    def uncalibrated_cpu_groups(self, groups) -> list[tuple[str, ...]]:
        """The groups of two or more CPU slots that no measured sync set holds: their sync is priced
        from the link profile alone, several times too low on CPU slots (``felactl profile --model
        --cluster`` measures it)."""
        measured = [devices for devices, _ in self._calibrations()]
        return [
            tuple(g)
            for g in groups
            if len(g) > 1
            and not any(m.issuperset(g) for m in measured)
            and all(self.cluster.device(d).kind == DeviceKind.CPU for d in g)
        ]

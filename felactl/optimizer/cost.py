"""The cost model every planner part shares: compute, transfer, sync and memory of a stage.

One source of truth: the ILP's coefficients, the exhaustive oracle, the baselines and the
simulator all call these functions, so they can only disagree on how they combine costs.

Formulas (times in seconds, sizes in bytes):

* **Compute** of layer ``l`` on device ``d`` at micro-batch ``b``: from the model profile's
  timings of the device model that prices ``d``, else from FLOPs (the formula:
  :mod:`felactl.optimizer.compute_cost`). Measured timings (and the optimizer step) are of the
  device the model was profiled on; where the profile recorded that device's matmul TFLOP/s
  (``ModelSpec.timed_tflops``) they are scaled by timed / ``d.tflops``: a device
  of the same model at another speed (a CPU slot held to a share of a core by a cgroup, a
  throttled GPU) is that much slower or faster, which its cluster profile measured. A CPU slot a
  cgroup quota holds is a device model of its own (``Intel Xeon @ 0.1 cores``,
  :func:`felactl.spec.cpu_slot_model`): priced by its own timings where the profile has them
  (``felactl profile --model --testbed`` times the model in every node), else by its CPU's,
  scaled as above (:meth:`CostModel.timed_as`); the scaling priced a tenth of a core 1.4x too
  fast.
* **Transfer** of a stage boundary per micro-batch, paid by the device that fetches it: a stage's
  worker waits for its input activation (the cut before it) and for its output's gradient (the
  cut after it), each a request there and ``latency + b * activation_bytes_per_sample /
  bandwidth`` back on the actual link (:meth:`CostModel.mean_fetch_s`; :meth:`CostModel.transfer_gbps`:
  a node's shared NIC is divided among its devices in the cluster planned for, a switch port caps
  its device's links). Serving a tensor costs its producer nothing: the runtimes send from a
  thread (tokens) or with ``isend`` (static pipelines) while it computes. Charging both ends, as
  this model once did, priced the hybrid baseline's exchange-bound last stage up to 1.5x too slow
  on the emulated testbeds (BENCHMARKS.md, issue 15 item 4).
* **Sync** of a stage group: the allreduce of its gradients, over trees or rings, calibrated by
  measured syncs: :mod:`felactl.optimizer.sync_cost` (:class:`~felactl.optimizer.sync_cost.SyncCosts`,
  which :class:`CostModel` inherits).
* **Per token**, the runtime's own work beyond compute (claiming the token, gathering its
  inputs, publishing its output): :data:`TOKEN_OVERHEAD_S` of a full core's CPU, times one over
  the quota of a CPU slot a cgroup holds (one thread's work), or the slowdown of another CPU slot
  (:meth:`CostModel.host_slowdown`, :meth:`CostModel.token_overhead_s`), for each
  token a worker claims (:meth:`CostModel.tokens_per_micro_batch`). It is what keeps the planner
  from micro-batches too small to pay for themselves. A pipeline's token also waits for rank 0's
  token server to answer its request: the server's CPU and a wake-up on either side of a
  throttled CPU slot (:meth:`CostModel.claim_s`, :meth:`CostModel.quota_wake_s`). A static
  pipeline claims no token: its stage pays :data:`PIPELINE_MESSAGE_CPU_S` per message from and
  to its neighbours instead (:meth:`CostModel.message_overhead_s`, in the simulator, which prices
  static pipelines).
* **Optimizer step** of a stage, once per iteration on each of its devices: the profiled AdamW
  ``step()`` over the whole model (``ModelSpec.optimizer_step_ms_of`` the device model that
  prices the device, :meth:`CostModel.timed_as`) times the stage's share of the parameters (the
  step is a few passes over each parameter: linear in their number), scaled as the timings are.
  Where the profile timed no model that prices the device (and for profiles without the field)
  it is not known and costs 0.
* **Memory** per device holding a stage: parameters + gradients (``2 * param_bytes``) + AdamW's
  two fp32 moments (``8 * params``) + what autograd saves (``saved_bytes_per_sample``, else each
  layer's input + output) for ``in_flight`` micro-batches of the stage (the plan records that
  number per stage, ``Stage.max_in_flight``: as many as memory holds, :func:`evaluate.memory_limits`;
  the simulator holds every device to it, and the cost model prices the wait it imposes).
* **Headroom**: a plan may fill only a device's *usable* memory (:func:`usable_memory_bytes`):
  its ``memory_gb`` less ``MemoryHeadroom.fraction`` of it (the caching allocator's
  fragmentation, default 10%) and, on CUDA devices, less ``MemoryHeadroom.reserved_gb`` (the
  CUDA context, cuBLAS and NCCL workspaces, default 1 GB). ``felactl plan --reserve-gb
  --fragmentation`` set them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

from felactl.optimizer.compute_cost import layer_times_s
from felactl.optimizer.sync_cost import SyncCosts
from felactl.spec import (
    ClusterSpec,
    Device,
    DeviceKind,
    ModelSpec,
    cpu_of_slot_model,
    cpu_slot_quota,
    quota_period_us,
    quota_slowdown,
)

ADAMW_STATE_BYTES_PER_PARAM = 8
"""Two fp32 moments per parameter."""
GB = 1e9
FULL_CORE = 1.0
"""The quota of a CPU slot no cgroup holds, in cores, as far as one thread's speed goes."""
FSDP_GATHER_CPU_S = 1.7e-3
"""Host CPU seconds one FSDP2 unit's gather (or reduce-scatter) costs beyond its bytes, in
full-core seconds: the unit's hooks, the copies in and out of the flat buffer, the collective's
call. Measured by ``benchmarks/bench_fsdp_gather.py`` (BENCHMARKS.md, "What an FSDP gather costs
the host"), not fitted to any plan's run. A sharded stage pays it per unit per gather
(:func:`felactl.optimizer.sharding.sharded_comm_s`), its slowest host's way: a CPU slot under a
quota pays it over its quota (:meth:`CostModel.host_slowdown`), where every gather of the stage
waits for it."""

TOKEN_OVERHEAD_S = 1.5e-3
"""Host CPU seconds a tokens runtime spends on one token outside its compute, at the speed the
model was profiled at: claiming it (a data-parallel stage under sync ``tokens``: store ``add``s
on its bucket's counters; a pipeline's stage: a request to rank 0's token server and its reply),
the token's batch indices and inputs, publishing its output. Measured for the first: on the
three-speeds testbed, felactl's data-parallel plan at micro-batches 16, 64 and 256 (the
difference of the workers' non-compute time over the difference of their token counts): 0.8-1.1
ms on rank 0's node, 2.0 ms on the other, each in full-core seconds (BENCHMARKS.md, issue 15
item 4, ninth session). A pipeline's token is priced the same, not measured apart. Unpriced, it
made micro-batches of 64 look as good as 1024 and ran them at 0.51-0.58 of their prediction.
On an H200's host, one worker with the store in its own process, a token cost 0.29 ms
(``benchmarks/bench_token_overhead.py``, BENCHMARKS.md, 2026-11-27): there the price is high,
which tips the planner only towards larger micro-batches; not yet measured with remote workers."""


@dataclass(frozen=True)
class MemoryHeadroom:
    """What a plan leaves free on each device (module doc, **Headroom**)."""

    reserved_gb: float = 1.0
    """Per CUDA device: the CUDA context and the libraries' workspaces, which no tensor counts."""
    fraction: float = 0.10
    """Of every device's memory: fragmentation of the caching allocator."""


def usable_memory_bytes(device: Device, headroom: MemoryHeadroom) -> float:
    """Bytes of ``device`` a plan may fill: its memory less the headroom (never below 0)."""
    reserved = headroom.reserved_gb if device.kind is DeviceKind.CUDA else 0.0
    return max(0.0, device.memory_gb * (1.0 - headroom.fraction) - reserved) * GB


def stage_param_bytes(model: ModelSpec, start: int, end: int) -> int:
    return sum(layer.param_bytes for layer in model.layers[start:end])


def saved_bytes_per_sample(model: ModelSpec, index: int) -> int:
    """What autograd keeps of layer ``index`` per sample until its backward: the profiled number
    where there is one, else the layer's input plus its output (a fair bound for simple layers)."""
    layer = model.layers[index]
    if layer.saved_bytes_per_sample is not None:
        return layer.saved_bytes_per_sample
    inputs = model.input_bytes_per_sample if index == 0 else model.layers[index - 1].activation_bytes_per_sample
    return inputs + layer.activation_bytes_per_sample


def stage_memory_bytes(model: ModelSpec, start: int, end: int, micro_batch: int, in_flight: int) -> float:
    """Bytes a device needs to hold layers [start, end) and ``in_flight`` micro-batches of them."""
    weights = sum(2 * l.param_bytes + ADAMW_STATE_BYTES_PER_PARAM * l.params for l in model.layers[start:end])
    activations = sum(saved_bytes_per_sample(model, i) for i in range(start, end)) * micro_batch * in_flight
    return weights + activations


def boundary_bytes_per_sample(model: ModelSpec, boundary: int) -> int:
    """Bytes per sample crossing the cut before layer ``boundary`` (0 and num_layers cross nothing)."""
    if boundary <= 0 or boundary >= model.num_layers:
        return 0
    return model.layers[boundary - 1].activation_bytes_per_sample


PIPELINE_MESSAGE_CPU_S = 1.5e-3
"""Host CPU seconds a static pipeline's stage spends on one message to or from a neighbour
(felactl's wire: a header and the tensors, each a gloo send or receive, encoded and decoded in
Python), at the speed the model was profiled at. A forward receives from the stage
before and sends to the one after, a backward the reverse: two messages a micro-batch at either
end of a pipeline, four inside. Measured on the one-slow testbed, a 1F1B chain of its four nodes
at micro-batch 1 (each node's cgroup CPU less the priced compute, per micro-batch: 3.3 ms on the
first stage, 7.1 and 6.0 on the inner ones, 5.9 on the last, which also computes the loss;
BENCHMARKS.md, 2026-11-30): 1.5-1.6 ms a message, charged as a token's
(:data:`TOKEN_OVERHEAD_S`) before, which priced an inner stage half its host work and ran a chain
through a 0.12-core node at 0.66 of its prediction. Over loopback without the testbed's network
namespaces a message costs 0.22 ms (two processes on full cores): :data:`LOCAL_MESSAGE_CPU_S`, the
price of a message to a neighbour on the same node. This one was measured when a message also
sent its header's size ahead of it (three operations for one tensor, two now), which cost 1.45x
the round trip and 1.5x the CPU over loopback (``benchmarks/bench_wire.py``): it may price a
testbed's message a little dear. The last stage's loss, unpriced then (2.6 ms more there, at micro-batch 1
of the example LM), is on the last layer since (``ModelSpec.loss_ms``)."""


LOCAL_MESSAGE_CPU_S = 0.22e-3
"""Host CPU seconds of a static pipeline's message to or from a neighbouring stage on the same
node (loopback): ``benchmarks/bench_wire.py`` sends a split LM's boundary through the very link a
stage uses, between two processes pinned to a core each of this project's 2-core machine (a
4-value message one way, a tensor back): 0.215 and 0.223 ms a message, medians of 5 (0.32 on the
framing before the fixed header, which priced it 0.28). Priced at the testbed's
:data:`PIPELINE_MESSAGE_CPU_S`, a chain of two local CPU slots (a user's own four-block LM,
micro-batch 1) was predicted 83 samples/s and ran 155; at 0.28 ms, 140."""

TOKEN_SERVER_CPU_S = 0.18e-3
"""Host CPU seconds rank 0's token server (the flexible hybrid's) spends on one request: popping
it from the store, the token DAG's update, pushing the reply. Measured by
``benchmarks/bench_token_server.py`` (the real service and request loop on a real store, this
project's 2-core VM): 0.15-0.18 ms (BENCHMARKS.md, "What a pipeline token's claim waits for")."""


@dataclass
class CostModel(SyncCosts):
    """Costs of one model on one cluster, with the per-layer sums cached for fast segment queries."""

    cluster: ClusterSpec
    model: ModelSpec
    use_trees: bool = True
    max_tree_devices: int = 64
    """Groups larger than this use a ring: packing trees over hundreds of devices costs seconds."""
    headroom: MemoryHeadroom = field(default_factory=MemoryHeadroom)
    """What the plan leaves free on each device (module doc)."""
    sync_reference: ClusterSpec | None = None
    """The whole cluster, when ``cluster`` is a part of it (``plan --devices``, a re-plan after a
    scale-in): the model profile's sync timings were measured on the whole one, so their
    calibration is worked out there (its measured set may hold devices the part lacks)."""
    ring_order: tuple[str, ...] | None = None
    """The rank order of the plan's devices where it is fixed (a baseline's, or a plan's once
    :func:`~felactl.optimizer.ranks.rank_order` chose it): a group of CPU devices then syncs over
    gloo's ring in that order (:func:`~felactl.optimizer.collectives.gloo_ring`). None: over the
    group's best ring, which the planner gives the ranks' order to realise. (NCCL builds its own
    rings on GPUs, whatever the ranks.)"""
    token_cpu_s: float = TOKEN_OVERHEAD_S
    """Host CPU seconds per token beyond compute, at the profiled speed (:meth:`token_overhead_s`)."""
    token_server_cpu_s: float = TOKEN_SERVER_CPU_S
    """Rank 0's host CPU seconds per pipeline token it answers (:meth:`claim_s`)."""
    message_cpu_s: float = PIPELINE_MESSAGE_CPU_S
    """Host CPU seconds per message a static pipeline's stage exchanges with another node
    (:meth:`message_overhead_s`)."""
    local_message_cpu_s: float = LOCAL_MESSAGE_CPU_S
    """The same with a neighbour on its own node."""
    gather_cpu_s: float = FSDP_GATHER_CPU_S
    """Host CPU seconds per FSDP unit gather beyond its bytes (:meth:`gather_overhead_s`)."""
    data_parallel_tokens: bool = True
    """Whether a whole-model stage's micro-batches are tokens claimed through the store (sync
    ``tokens``) and pay :meth:`token_overhead_s`; False for the modes whose workers loop over their
    own share (``bsp``: DDP, ``wbsp``, ``sdpipe``), which ask nobody. A pipeline's stages claim
    tokens on the flexible schedule the ILP plans; a static pipeline's pay their messages instead
    (:meth:`message_overhead_s`, in the simulator)."""
    trees_ever_faster: bool = field(default=False, init=False)
    """Whether some sync time asked so far went over trees: if not, rings-only costs are the same."""
    _prefix: dict = field(default_factory=dict, init=False, repr=False)
    _collectives: dict = field(default_factory=dict, init=False, repr=False)
    _shapes: dict = field(default_factory=dict, init=False, repr=False)
    _fetch: dict = field(default_factory=dict, init=False, repr=False)
    _sync: dict = field(default_factory=dict, init=False, repr=False)
    _sync_factors: list | None = field(default=None, init=False, repr=False)
    _links: dict = field(default_factory=dict, init=False, repr=False)
    _timed_models: set | None = field(default=None, init=False, repr=False)

    def usable_memory_bytes(self, device_name: str) -> float:
        """Bytes of a device the plan may fill (module doc, **Headroom**)."""
        return usable_memory_bytes(self.cluster.device(device_name), self.headroom)

    # --- compute -------------------------------------------------------------------------
    def _prefix_sums(self, device: Device, micro_batch: int) -> tuple[list[float], list[float]]:
        key = (device.model, device.tflops, micro_batch)
        if key not in self._prefix:
            fwd, bwd = [0.0], [0.0]
            slower = self.timed_slowdown(device)
            timed_as = self.timed_as(device)
            for layer in self.model.layers:
                f, b = layer_times_s(layer, device, micro_batch, timed_as)
                if any(t.device_model == timed_as for t in layer.timings):
                    f, b = f * slower, b * slower
                fwd.append(fwd[-1] + f)
                bwd.append(bwd[-1] + b)
            self._prefix[key] = (fwd, bwd)
        return self._prefix[key]

    def timed_as(self, device: Device) -> str | None:
        """The device model whose timings price ``device``: its own where the model profile has
        them; else, for a CPU slot, those of the same CPU (under no quota where the profile timed
        that, else under the quota nearest the slot's: ``Intel Xeon @ 0.1 cores`` is priced by
        ``Intel Xeon``'s timings, an unprofiled ``@ 0.2 cores`` by ``@ 0.3 cores``'), scaled by
        :meth:`timed_slowdown` as before slots were keyed by their quota; None where the profile
        timed neither (its compute then comes from FLOPs)."""
        if self._timed_models is None:
            self._timed_models = self.model.timed_device_models
        timed = self._timed_models
        if device.model in timed:
            return device.model
        if device.kind is not DeviceKind.CPU:
            return None
        cpu = cpu_of_slot_model(device.model)
        same_cpu = [m for m in timed if cpu_of_slot_model(m) == cpu]
        if not same_cpu:
            return None
        quota = cpu_slot_quota(device.model) or FULL_CORE

        def distance(timed_model: str) -> tuple[float, str]:
            return abs(math.log((cpu_slot_quota(timed_model) or FULL_CORE) / quota)), timed_model

        return min(same_cpu, key=distance)

    def priced_from_flops(self, device_names) -> list[str]:
        """Of ``device_names``, those no timing of the model profile prices (:meth:`timed_as`),
        where it has timings: their compute comes from FLOPs and TFLOP/s, not from a measurement."""
        if not self.model.timed_device_models:
            return []
        return [d for d in device_names if self.timed_as(self.cluster.device(d)) is None]

    def timed_slowdown(self, device: Device) -> float:
        """How many times its timings (:meth:`timed_as`) a device takes: the timed device's matmul
        TFLOP/s over this one's (``ModelSpec.timed_tflops``; module doc, **Compute**), 1 where the
        profile did not record it."""
        timed = self.model.timed_tflops.get(self.timed_as(device) or device.model)
        return timed / device.tflops if timed and device.tflops > 0 else 1.0

    def host_slowdown(self, device: Device) -> float:
        """How many times a full core's seconds the host work of ``device`` takes (the runtime's
        own per-token work, :data:`TOKEN_OVERHEAD_S`): on a CPU slot under a quota, one over the
        quota (up to a core: the work is one thread); on another CPU slot, :meth:`timed_slowdown`;
        a GPU's host runs at full speed. Not the slot's :meth:`timed_slowdown` where the slot has
        timings of its own: those make it ~1, and a tenth of a core would pay a token as a core."""
        if device.kind is not DeviceKind.CPU:
            return 1.0
        return quota_slowdown(device.model) or self.timed_slowdown(device)

    def stage_times_s(self, start: int, end: int, device_name: str, micro_batch: int) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch of layers [start, end) on a device."""
        fwd, bwd = self._prefix_sums(self.cluster.device(device_name), micro_batch)
        return fwd[end] - fwd[start], bwd[end] - bwd[start]

    def whole_model(self, start: int, end: int) -> bool:
        """Whether layers [start, end) are the whole model: a stage that exchanges nothing with
        another, whose forward and backward a worker runs as one."""
        return start == 0 and end == self.model.num_layers

    def tokens_per_micro_batch(self, start: int, end: int) -> int:
        """Tokens a worker claims per micro-batch of a stage of layers [start, end), each paying
        :meth:`token_overhead_s`: a pipeline's stage on the tokens schedule runs a forward and a
        backward token (on a static schedule it claims none and pays its messages instead,
        :meth:`message_overhead_s`); a whole-model stage one under sync ``tokens``, none where its
        workers loop over their own share (:attr:`data_parallel_tokens`)."""
        if not self.whole_model(start, end):
            return 2
        return 1 if self.data_parallel_tokens else 0

    def token_overhead_s(self, device_name: str) -> float:
        """What one token costs ``device_name`` beyond its compute (:data:`TOKEN_OVERHEAD_S`, the
        CostModel's ``token_overhead_s``): host CPU work, so a CPU device held to part of a core
        takes :meth:`host_slowdown` times as long."""
        return self.token_cpu_s * self.host_slowdown(self.cluster.device(device_name))

    def quota_wake_s(self, device_name: str) -> float:
        """What a thread woken on ``device_name`` waits for its CPU on average: a CPU slot held to
        a quota q < 1 core, kept busy (a pipeline's worker is), is throttled for (1 - q) of each
        CFS period (:func:`~felactl.spec.quota_period_us`, a testbed's), and a wake-up in
        that part waits for its end: (1 - q)^2 * period / 2. 0 on other devices."""
        device = self.cluster.device(device_name)
        quota = cpu_slot_quota(device.model) if device.kind is DeviceKind.CPU else None
        if quota is None or quota >= 1.0:
            return 0.0
        return (1.0 - quota) ** 2 * quota_period_us(quota) * 1e-6 / 2

    def claim_s(self, start: int, end: int, device_name: str, server: str | None = None) -> float:
        """What one token of layers [start, end) costs ``device_name`` beyond its compute: its
        own work on it (:meth:`token_overhead_s`), and for a pipeline's stage, the wait for rank
        0's token server to answer its request (:data:`TOKEN_SERVER_CPU_S` on the server's host)
        and a wake-up on either side (:meth:`quota_wake_s`). On the two-servers testbed (0.45 of
        a core a node) the wait measured 2.7-3.3 ms a token, priced 3.4; unpriced, the tokens
        runtime ran 0.68-0.73 of its price. ``server``: rank 0's device (None: the first of
        ``ring_order`` where it is fixed, else taken to be like ``device_name``)."""
        own = self.token_overhead_s(device_name)
        if self.whole_model(start, end):
            return own
        server = server or (self.ring_order[0] if self.ring_order else device_name)
        answer = self.token_server_cpu_s * self.host_slowdown(self.cluster.device(server))
        return own + answer + self.quota_wake_s(server) + self.quota_wake_s(device_name)

    def message_overhead_s(self, device_name: str, peer: str) -> float:
        """What one message to or from ``peer``, a neighbouring stage of a static pipeline, costs
        ``device_name`` beyond its bytes: :data:`PIPELINE_MESSAGE_CPU_S` across nodes,
        :data:`LOCAL_MESSAGE_CPU_S` on one; host CPU work, so a CPU device held to part of a core
        takes :meth:`host_slowdown` times as long."""
        local = self.cluster.node_of(device_name).name == self.cluster.node_of(peer).name
        per_message = self.local_message_cpu_s if local else self.message_cpu_s
        return per_message * self.host_slowdown(self.cluster.device(device_name))

    def gather_overhead_s(self, devices) -> float:
        """What one FSDP unit gather among ``devices`` costs beyond its bytes: the slowest host's
        share of :data:`FSDP_GATHER_CPU_S` (every member waits for it)."""
        return self.gather_cpu_s * max(self.host_slowdown(self.cluster.device(d)) for d in devices)

    def per_sample_s(self, start: int, end: int, device_name: str, micro_batch: int) -> float:
        fwd, bwd = self.stage_times_s(start, end, device_name, micro_batch)
        return (fwd + bwd) / micro_batch

    def optimizer_step_s(self, start: int, end: int, device_name: str) -> float:
        """Seconds of one optimizer step over layers [start, end) on a device (see module doc)."""
        model = self.model
        device = self.cluster.device(device_name)
        timed_as = self.timed_as(device)
        step_ms = model.optimizer_step_ms_of(timed_as) if timed_as is not None else None
        if not step_ms or model.total_params <= 0:
            return 0.0
        share = sum(layer.params for layer in model.layers[start:end]) / model.total_params
        return step_ms / 1e3 * share * self.timed_slowdown(device)

    # --- transfer ------------------------------------------------------------------------
    def _direct_or_relay(self, src: str, dst: str) -> tuple[float, float]:
        """(latency s, seconds per byte) of src -> dst: the direct link, else the relay through one
        device with the least seconds per byte (large messages dominate activation traffic)."""
        if (src, dst) not in self._links:
            self._links[(src, dst)] = self._find_route(src, dst)
        return self._links[(src, dst)]

    def transfer_gbps(self, link) -> float:
        """What one activation transfer gets of a link while every device sends at once (token
        scheduling keeps them all busy): across nodes at most a node's shared NIC
        (``Node.nic_gbps``) divided among its devices in the cluster planned for; behind a switch at
        most the port."""
        src, dst = self.cluster.node_of(link.src), self.cluster.node_of(link.dst)
        gbps = link.bandwidth_gbps
        if src.name != dst.name:
            for node in (src, dst):
                if node.nic_gbps:
                    gbps = min(gbps, node.nic_gbps / len(node.devices))
        elif src.switch_gbps:
            gbps = min(gbps, src.switch_gbps)
        return gbps

    def _find_route(self, src: str, dst: str) -> tuple[float, float]:
        """The direct link, else the path of least seconds per byte (store and forward: the hops'
        seconds per byte and latencies add up); (inf, inf) where ``dst`` cannot be reached."""
        link = self.cluster.link(src, dst)
        if link is not None:
            return link.latency_us * 1e-6, 1.0 / (self.transfer_gbps(link) * GB)
        import networkx as nx

        graph = self._route_graph()
        try:
            path = nx.dijkstra_path(graph, src, dst, weight="per_byte")
        except (nx.NetworkXNoPath, nx.NodeNotFound):
            return math.inf, math.inf
        hops = list(zip(path, path[1:]))
        return (sum(graph[a][b]["latency_s"] for a, b in hops), sum(graph[a][b]["per_byte"] for a, b in hops))

    def _route_graph(self):
        """Every direct link of the cluster as a networkx graph (built once, where a route is asked)."""
        if "_graph" not in self._links:
            import networkx as nx

            graph = nx.DiGraph()
            graph.add_nodes_from(self.cluster.device_names)
            for link in self.cluster.links_among(self.cluster.device_names):
                graph.add_edge(
                    link.src, link.dst, per_byte=1.0 / (self.transfer_gbps(link) * GB), latency_s=link.latency_us * 1e-6
                )
            self._links["_graph"] = graph
        return self._links["_graph"]

    def link_time_s(self, src: str, dst: str, num_bytes: float) -> float:
        """One message src -> dst (direct link, else the best one-device relay)."""
        if src == dst:
            return 0.0
        latency_s, per_byte_s = self._direct_or_relay(src, dst)
        return latency_s + num_bytes * per_byte_s

    def mean_fetch_s(self, device: str, num_bytes: float) -> float:
        """Expected time for ``device`` to fetch one boundary tensor (an activation into a later
        stage, a gradient back into an earlier one) from a peer drawn uniformly from the cluster's
        other devices: its small request there, the tensor back.

        The consumer waits for it; the producer does not (the tokens runtime's server thread
        answers while its worker computes, a static pipeline's ``isend`` returns at once), so a
        tensor is charged once, to the device that fetches it, over the link it arrives on.
        Under token scheduling a stage's input comes from whichever worker produced it, so the
        planner charges the mean over the plan's devices; the simulator uses the actual producer.
        """
        if num_bytes <= 0 or len(self.cluster.device_names) < 2:
            return 0.0
        if device not in self._fetch:
            others = [p for p in self.cluster.device_names if p != device]
            latency_s = per_byte_s = 0.0
            for p in others:
                request_latency_s, _ = self._direct_or_relay(device, p)
                reply_latency_s, reply_per_byte_s = self._direct_or_relay(p, device)
                latency_s += request_latency_s + reply_latency_s
                per_byte_s += reply_per_byte_s
            self._fetch[device] = (latency_s / len(others), per_byte_s / len(others))
        latency_s, per_byte_s = self._fetch[device]
        return latency_s + num_bytes * per_byte_s

    def exchange_signature(self, device: str) -> tuple[float, float]:
        """What the device's exchange cost depends on; devices alike here cost alike."""
        self.mean_fetch_s(device, 1.0)
        return self._fetch.get(device, (0.0, 0.0))


@cache
def micro_batch_options(global_batch: int, largest: int = 1024, max_options: int | None = None) -> tuple[int, ...]:
    """Powers of two up to the global batch (and ``largest``): the micro-batches searched; with
    ``max_options``, every second (third, ...) power from the largest down, so at most that many."""
    options, b = [], 1
    while b <= min(global_batch, largest):
        options.append(b)
        b *= 2
    if max_options is not None and len(options) > max_options:
        step = -(-len(options) // max_options)
        options = options[::-1][::step][::-1]
    return tuple(options)

"""The links of a testbed: tc shaping per directed pair of nodes, made at ``up`` and changed live.

Shaping, per directed pair ``a -> b``, all inside the nodes' namespaces:
- bandwidth: an htb class per destination on ``a``'s ``fl0`` (a u32 filter on ``b``'s address),
  its rate raised by the header overhead of a 1500-byte frame so that a TCP stream's payload gets
  ``bandwidth_gbps``;
- latency: a netem qdisc under that class (kernels without netem cannot add latency);
- loss: a classic-BPF filter on ``b``'s ingress that drops that fraction of ``a``'s packets (at
  the receiver, so the sender's TCP sees a real loss, not a local drop it silently retries).
"""

from __future__ import annotations

from felactl.errors import InputError
from felactl.spec.codec import FieldProblem, encode
from felactl.spec.io import from_dict
from felactl.testbed.host import run
from felactl.testbed.network import IFNAME, MTU
from felactl.testbed.spec import TestbedLink, TestbedSpec
from felactl.testbed.state import NodeInfo, read_state, read_state_doc, state_lock, write_state

FRAME_OVERHEAD = (MTU + 14) / (MTU - 20 - 20 - 12)
"""An Ethernet frame of a TCP segment (with timestamps) over its payload: the htb rate is raised
by this so that ``bandwidth_gbps`` is what an application's stream gets."""


def _bits(gbps: float) -> str:
    return f"{max(8, round(gbps * 1e9 * 8 * FRAME_OVERHEAD))}bit"


def _burst(gbps: float) -> str:
    """htb's bucket: a millisecond of the rate (tc's default, rate/HZ + a frame, is a frame or two
    and loses 10-15% at a few hundred MB/s to timer slack), and at least two frames."""
    return f"{max(2 * (MTU + 14), round(gbps * 1e9 * FRAME_OVERHEAD * 1e-3))}b"


def _loss_bytecode(src_address: str, loss: float) -> str:
    """Classic BPF for a direct-action ingress filter: drop ``loss`` of the IPv4 packets from
    ``src_address`` (TC_ACT_SHOT), pass everything else on (TC_ACT_UNSPEC)."""
    src = int.from_bytes(bytes(int(p) for p in src_address.split(".")), "big")
    prog: list[tuple[int, int, int, int]] = [
        (0x28, 0, 0, 12),
        (0x15, 0, -1, 0x0800),  # ldh [12]; jeq IPv4
        (0x20, 0, 0, 26),
        (0x15, 0, -1, src),
    ]  # ld [26]; jeq src
    if loss < 1.0:
        threshold = min(2**32 - 1, round(loss * 2**32))
        prog += [(0x20, 0, 0, (2**32 - 0x1000 + 56)), (0x35, 1, 0, threshold)]  # ld rand; jge -> pass
    prog += [(0x06, 0, 0, 2), (0x06, 0, 0, 2**32 - 1)]  # ret SHOT; pass: ret UNSPEC
    last = len(prog) - 1
    fixed = [(op, jt, (last - k - 1) if jf == -1 else jf, v) for k, (op, jt, jf, v) in enumerate(prog)]
    return f"{len(fixed)}," + ",".join(f"{op} {jt} {jf} {v}" for op, jt, jf, v in fixed)


def _class_id(dst_index: int) -> str:
    return f"1:{dst_index + 16:x}"


def _netem_handle(dst_index: int) -> str:
    return f"{dst_index + 16:x}:"


def _rate_args(link: TestbedLink) -> list[str]:
    rate, burst = _bits(link.bandwidth_gbps), _burst(link.bandwidth_gbps)
    return ["htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst, "quantum", str(MTU + 14)]


def _netem_args(link: TestbedLink) -> list[str]:
    # room for a bandwidth-delay product of packets, and then some
    bdp_packets = link.bandwidth_gbps * 1e9 * link.latency_us * 1e-6 / MTU
    return ["netem", "delay", f"{link.latency_us:g}us", "limit", str(max(1000, int(4 * bdp_packets)))]


def _loss_args(src_index: int, src_address: str, loss: float) -> list[str]:
    """The receiver's ingress filter that drops ``loss`` of what comes from node ``src_index``."""
    bpf = ["bpf", "da", "bytecode", _loss_bytecode(src_address, loss)]
    return ["parent", "ffff:", "protocol", "ip", "prio", str(src_index + 1), "handle", "1", *bpf]


def shape_node(spec: TestbedSpec, info: dict, by_name: dict, netem: bool) -> None:
    """htb per destination on the node's egress (+ netem for latency), loss filters on its ingress."""
    tc = ["tc", "-n", info["netns"]]
    run([*tc, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "htb", "default", "1"])
    default_class = ["classid", "1:1", "htb", "rate", "10gbit", "quantum", "60000"]
    run([*tc, "class", "add", "dev", IFNAME, "parent", "1:", *default_class])
    for other in spec.node_names:
        if other == info["name"]:
            continue
        link = spec.link(info["name"], other)
        dst = by_name[other]
        classid = _class_id(dst["index"])
        run([*tc, "class", "add", "dev", IFNAME, "parent", "1:", "classid", classid, *_rate_args(link)])
        if netem and link.latency_us > 0:
            handle = _netem_handle(dst["index"])
            run([*tc, "qdisc", "add", "dev", IFNAME, "parent", classid, "handle", handle, *_netem_args(link)])
        match = ["u32", "match", "ip", "dst", f"{dst['address']}/32", "flowid", classid]
        run([*tc, "filter", "add", "dev", IFNAME, "parent", "1:", "protocol", "ip", "prio", "1", *match])
    run([*tc, "qdisc", "add", "dev", IFNAME, "handle", "ffff:", "ingress"])
    for src in spec.node_names:
        loss = spec.link(src, info["name"]).loss if src != info["name"] else 0.0
        if loss > 0:
            sender = by_name[src]
            run([*tc, "filter", "add", "dev", IFNAME, *_loss_args(sender["index"], sender["address"], loss)])


def set_link(
    name: str,
    src: str,
    dst: str,
    *,
    bandwidth_gbps: float | None = None,
    latency_us: float | None = None,
    loss: float | None = None,
) -> TestbedLink:
    """Change the link ``src -> dst`` of a testbed that is up, while it carries traffic (``loss=1``
    cuts it, the old loss heals it); the state file, and so ``status``, follows. Returns the new link."""
    state = read_state(name)
    a, b = state.node(src), state.node(dst)
    if src == dst:
        raise InputError(f"a link joins two different nodes, got {src} -> {dst}")
    spec = from_dict(TestbedSpec, state.spec, state.spec_path)
    old = spec.link(src, dst)
    try:
        new = TestbedLink(
            src=src,
            dst=dst,
            bandwidth_gbps=old.bandwidth_gbps if bandwidth_gbps is None else bandwidth_gbps,
            latency_us=old.latency_us if latency_us is None else latency_us,
            loss=old.loss if loss is None else loss,
        )
    except FieldProblem as exc:
        raise InputError(f"--{exc.key.replace('_', '-')} {exc.problem}") from None
    if new.latency_us > 0 and new.latency_us != old.latency_us and not state.netem:
        raise InputError("--latency-us: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM) to add latency")
    _reshape(a, b, old, new, state.netem)
    with state_lock():
        doc = read_state_doc(name)
        if doc is not None:
            links = [l for l in doc["spec"].get("links", []) if (l["src"], l["dst"]) != (src, dst)]
            doc["spec"]["links"] = [*links, encode(new)]
            write_state(doc)
    return new


def _reshape(a: NodeInfo, b: NodeInfo, old: TestbedLink, new: TestbedLink, netem: bool) -> None:
    """Change what differs between ``old`` and ``new``, the link ``a -> b``, in place."""
    egress, ingress, classid = ["tc", "-n", a.netns], ["tc", "-n", b.netns], _class_id(b.index)
    if new.bandwidth_gbps != old.bandwidth_gbps:
        run([*egress, "class", "change", "dev", IFNAME, "parent", "1:", "classid", classid, *_rate_args(new)])
    if new.latency_us != old.latency_us and netem:
        if new.latency_us > 0:
            netem_qdisc = ["parent", classid, "handle", _netem_handle(b.index), *_netem_args(new)]
            run([*egress, "qdisc", "replace", "dev", IFNAME, *netem_qdisc])
        else:
            run([*egress, "qdisc", "del", "dev", IFNAME, "parent", classid])
    if new.loss != old.loss:
        if new.loss > 0:
            run([*ingress, "filter", "replace", "dev", IFNAME, *_loss_args(a.index, a.address, new.loss)])
        else:
            run([*ingress, "filter", "del", "dev", IFNAME, "parent", "ffff:", "prio", str(a.index + 1)])

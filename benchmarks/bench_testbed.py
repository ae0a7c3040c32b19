"""Does `felactl profile` see the emulated cluster? Configured vs measured, per shipped testbed.

Run (root, Linux): ``OMP_NUM_THREADS=1 python benchmarks/bench_testbed.py [--specs a.yaml,b.yaml] [--json]``

For each spec in plans/testbeds/ it builds the testbed (``felactl.testbed.up``; without netem,
latencies are left out and said so), runs the real ``felactl profile --testbed`` against it (one
agent per node in its namespace and cgroup, links timed by real worker processes over the shaped
veths), and compares:

* every ordered pair of nodes: the measured bandwidth over the configured one (target: within 15%);
* every node: its measured matmul speed over the fastest node's, against its CPU share over the
  largest share (target: within 15%).

Then it removes the testbed. One run of the profile per spec; the profile itself takes the median
of its repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from felactl.testbed import TestbedUnavailable, down, load_testbed, probe_host, up

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "plans" / "testbeds"
TOLERANCE = 0.15
MESSAGE_BYTES = 8 * 2**20
"""At 100 MB/s a 2 MiB message (20 ms) measures 1.2x the configured rate (socket buffers and the
htb bucket carry part of it); 8 MiB measures within 6%."""


def profile(name: str, out: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "felactl",
        "profile",
        "--testbed",
        name,
        "-o",
        str(out),
        "--json",
        "--matmul-size",
        "128",
        "--message-bytes",
        str(MESSAGE_BYTES),
        "--repetitions",
        "5",
        "--join-timeout",
        "60",
        "--timeout",
        "240",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"felactl profile --testbed {name} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)


def compare(spec, measured: dict) -> dict:
    """Per pair and per node, measured ÷ configured (bandwidth) and measured ÷ expected (speed ratio)."""
    links = {
        (link["src"].rsplit("-", 1)[0], link["dst"].rsplit("-", 1)[0]): link["bandwidth_gbps"]
        for link in measured["links"]
    }
    pairs = []
    for src in spec.node_names:
        for dst in spec.node_names:
            if src != dst:
                configured = spec.link(src, dst).bandwidth_gbps
                got = links.get((src, dst))
                pairs.append(
                    {
                        "src": src,
                        "dst": dst,
                        "configured_gbps": configured,
                        "measured_gbps": got,
                        "ratio": None if got is None else got / configured,
                    }
                )
    speed = {node["name"]: node["devices"][0]["tflops"] for node in measured["nodes"]}
    shares = {node.name: node.cpus if node.cpus is not None else float(len(node.cores)) for node in spec.nodes}
    fastest, largest = max(speed.values()), max(shares.values())
    nodes = [
        {
            "node": name,
            "cpus": shares[name],
            "tflops": speed[name],
            "expected_ratio": shares[name] / largest,
            "measured_ratio": speed[name] / fastest,
            "ratio": (speed[name] / fastest) / (shares[name] / largest),
        }
        for name in spec.node_names
    ]
    worst = lambda rows: max(abs(r["ratio"] - 1) for r in rows if r["ratio"] is not None)  # noqa: E731
    return {
        "pairs": pairs,
        "nodes": nodes,
        "worst_link_error": worst(pairs),
        "worst_speed_error": worst(nodes),
        "missing_pairs": sum(r["measured_gbps"] is None for r in pairs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="", help="comma-separated testbed files (default: plans/testbeds/*.yaml)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        host = probe_host()
    except TestbedUnavailable as exc:
        print(f"bench_testbed: {exc}", file=sys.stderr)
        return 2
    paths = [Path(p) for p in args.specs.split(",") if p] or sorted(SPECS.glob("*.yaml"))
    results = []
    for path in paths:
        spec = load_testbed(path)
        name = f"b{os.getpid() % 100000}"
        started = time.perf_counter()
        up(spec, str(path), name=name, host=host, allow_no_latency=not host.netem)
        try:
            measured = profile(name, Path(f"/tmp/{name}-cluster.yaml"))
        finally:
            down(name)
        result = {"spec": spec.name, "seconds": round(time.perf_counter() - started, 1), **compare(spec, measured)}
        results.append(result)
        print(
            f"{spec.name}: worst link error {result['worst_link_error']:.1%}, "
            f"worst speed-ratio error {result['worst_speed_error']:.1%} ({result['seconds']} s)",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    load = os.getloadavg()[0]
    print(f"netem: {'yes' if host.netem else 'no (latencies left out)'}; load average at the end {load:.1f}\n")
    print(
        "| testbed | pairs | measured ÷ configured bandwidth (min–max) | worst | nodes | measured ÷ expected "
        "speed ratio (min–max) | worst | within 15% |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        link_ratios = [p["ratio"] for p in r["pairs"] if p["ratio"] is not None]
        speed_ratios = [n["ratio"] for n in r["nodes"]]
        ok = r["worst_link_error"] <= TOLERANCE and r["worst_speed_error"] <= TOLERANCE and not r["missing_pairs"]
        print(
            f"| {r['spec']} | {len(r['pairs'])} | {min(link_ratios):.2f}–{max(link_ratios):.2f} | "
            f"{r['worst_link_error']:.1%} | {len(r['nodes'])} | {min(speed_ratios):.2f}–{max(speed_ratios):.2f} | "
            f"{r['worst_speed_error']:.1%} | {'yes' if ok else '**no**'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

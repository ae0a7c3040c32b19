"""How fast a CPU slot held by a cgroup quota runs a short burst of work, back to back vs after idling.

CFS bandwidth control gives a cgroup ``quota`` of CPU time per ``period`` (100 ms): work that
fits in what is left of the quota runs at a full core, and only work that outlasts it waits for
the next period. So a node held to a tenth of a core runs a few milliseconds of work at full speed
after idling, and at a tenth of its speed back to back. felactl's profiler times a slot back to
back (``profiling.model_timing.Clock`` stretches by wall / CPU), which is the price of a slot kept busy;
a pipeline stage that mostly waits runs its bursts faster (issue 15, item 4: hp measured 1.05-1.21x
its price on the quota testbeds).

Run it in a testbed node, e.g.::

    felactl testbed up plans/testbeds/three-speeds.yaml --name burst --no-latency
    felactl testbed exec --name burst small -- python benchmarks/bench_quota_bursts.py
    felactl testbed down --name burst

It times mlp's first layer (Linear 256 -> 512 + ReLU, forward and backward, micro-batch 256, one
thread) ``--repeat`` times back to back, then ``--bursts`` times each after ``--idle-ms`` of sleep,
and prints the medians, the back-to-back mean (the slot's steady rate) and its ratio to the
burst's median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="back-to-back runs")
    parser.add_argument("--bursts", type=int, default=15, help="runs after idling")
    parser.add_argument("--idle-ms", type=float, default=200.0, help="sleep before each burst")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layer = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU())
    x = torch.randn(256, 256)

    def step() -> float:
        start = time.perf_counter()
        layer(x).sum().backward()
        return time.perf_counter() - start

    for _ in range(5):
        step()
    runs = [step() for _ in range(args.repeat)]
    back_to_back, mean = statistics.median(runs), statistics.mean(runs)
    bursts = []
    for _ in range(args.bursts):
        time.sleep(args.idle_ms / 1e3)
        bursts.append(step())
    after_idle = statistics.median(bursts)
    print(
        f"back to back {back_to_back * 1e3:.2f} ms (mean {mean * 1e3:.2f}: its share of a core, the waits "
        f"for the next period included), after {args.idle_ms:g} ms idle {after_idle * 1e3:.2f} ms "
        f"(mean back to back / after idle: {mean / after_idle:.2f}x)"
    )


if __name__ == "__main__":
    main()

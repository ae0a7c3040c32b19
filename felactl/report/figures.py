"""The report's figures (matplotlib, drawn off screen): each a function of what it shows,
returning the figure, so a test reads back what was plotted.

Figures are made with :class:`matplotlib.figure.Figure`, never ``pyplot``: no global state, no
display, safe in any process.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from felactl.fsutil import atomic_write
from felactl.optimizer.simulator import SimResult
from felactl.report.series import RunSeries
from felactl.spec import Plan

EVENT_COLORS = {
    "scale-out": "tab:green",
    "scale-in": "tab:orange",
    "node-joined": "tab:olive",
    "failure": "tab:red",
    "failed": "tab:red",
    "re-form": "tab:purple",
    "restart": "tab:brown",
    "resume": "tab:blue",
    "stopped": "tab:gray",
}
WORK_COLORS = {"compute": "tab:blue", "comm": "tab:orange", "wait": "tab:red"}
MAX_WORKER_ROWS = 8
"""Workers drawn one row each in the time breakdown; a larger job shows its first ones and says so."""


def progress_figure(series: RunSeries) -> Figure:
    """Loss per step and samples/s per time bin over the run's time (and what the job's evaluate
    hook returned, where it has one), every event marked."""
    rows = 3 if series.evaluations else 2
    fig = Figure(figsize=(10, 3 * rows), layout="constrained")
    loss_ax, rate_ax, *eval_ax = fig.subplots(rows, 1, sharex=True)
    times, losses = with_gaps(series.step_t_s, series.loss)
    loss_ax.plot(times, losses, color="tab:blue", linewidth=0.8, alpha=0.4, label="loss")
    window = max(1, len(series.loss) // 50)
    if window > 1:
        smooth = np.convolve(series.loss, np.ones(window) / window, mode="valid")
        times, smooth = with_gaps(series.step_t_s[window - 1 :], tuple(smooth))
        loss_ax.plot(times, smooth, color="tab:blue", linewidth=1.6, label=f"mean of {window} steps")
    loss_ax.legend(loc="lower left", fontsize=8)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(f"run {series.run} ({series.state})")
    rate_ax.step(series.bin_t_s, series.samples_per_s, where="mid", color="tab:green", label="samples/s")
    rate_ax.set_ylabel(f"samples/s (per {series.bin_s:.3g} s)")
    for ax in eval_ax:
        for name, points in series.evaluations.items():
            ax.plot([t for t, _ in points], [v for _, v in points], marker="o", markersize=3, label=name)
        ax.set_ylabel("evaluate hook")
        ax.legend(loc="lower left", fontsize=8)
    (eval_ax or [rate_ax])[0].set_xlabel("seconds since the first step")
    for ax in (loss_ax, rate_ax, *eval_ax):
        _mark_events(ax, series, labelled=ax is loss_ax)
        ax.grid(alpha=0.3)
    return fig


def with_gaps(times: tuple[float, ...], values: tuple[float, ...]) -> tuple[list[float], list[float]]:
    """``times``, ``values`` with a NaN where the run stopped training for a while (a pause over
    five times the usual step and over a second: a restart, a lost node): the line breaks there
    instead of drawing a slope nobody trained along."""
    if len(times) < 3:
        return list(times), list(values)
    usual = float(np.median(np.diff(times)))
    out_t, out_v = [times[0]], [values[0]]
    for (t0, t1), value in zip(zip(times, times[1:]), values[1:]):
        if t1 - t0 > max(1.0, 5 * usual):
            out_t.append((t0 + t1) / 2)
            out_v.append(math.nan)
        out_t.append(t1)
        out_v.append(value)
    return out_t, out_v


def _mark_events(ax, series: RunSeries, labelled: bool) -> None:
    for mark in series.marks:
        ax.axvline(mark.t_s, color=EVENT_COLORS.get(mark.kind, "black"), linestyle="--", linewidth=1)
        if labelled:
            ax.annotate(
                mark.label,
                (mark.t_s, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=7,
                va="top",
                ha="right",
                color=EVENT_COLORS.get(mark.kind, "black"),
            )


def workers_figure(series: RunSeries) -> Figure:
    """Each worker's share of the samples, and its compute / communication / waiting over time:
    a straggler computes while the others wait for it."""
    shown = series.workers[:MAX_WORKER_ROWS]
    fig = Figure(figsize=(10, 2 + 1.3 * max(1, len(shown))), layout="constrained")
    grid = fig.add_gridspec(max(1, len(shown)), 2, width_ratios=(1, 3))
    share_ax = fig.add_subplot(grid[:, 0])
    shares = series.shares
    share_ax.barh([f"worker {r}" for r in shares], list(shares.values()), color="tab:blue")
    share_ax.invert_yaxis()
    share_ax.set_xlabel("share of the samples")
    share_ax.set_title("who trained what")
    for row, worker in enumerate(shown):
        ax = fig.add_subplot(grid[row, 1])
        ax.stackplot(
            series.bin_t_s,
            worker.compute,
            worker.comm,
            worker.wait,
            labels=("compute", "communication", "waiting"),
            colors=tuple(WORK_COLORS.values()),
        )
        ax.set_ylim(0, max(1.0, *(c + m + w for c, m, w in zip(worker.compute, worker.comm, worker.wait))))
        ax.set_ylabel(f"worker {worker.rank}", fontsize=8)
        _mark_events(ax, series, labelled=False)
        if row == 0:
            ax.set_title("share of each time bin" + _more(series))
            ax.legend(loc="upper right", fontsize=7, ncols=3)
        if row == len(shown) - 1:
            ax.set_xlabel("seconds since the first step")
    return fig


def _more(series: RunSeries) -> str:
    hidden = len(series.workers) - MAX_WORKER_ROWS
    return f" (the first {MAX_WORKER_ROWS} workers; {hidden} more not drawn)" if hidden > 0 else ""


def prediction_figure(series: RunSeries) -> Figure:
    """Each generation's measured samples/s beside its plan's prediction (none: the plan was not
    made by the planner, e.g. ``--job``)."""
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    names = [f"gen {g.generation}\n{g.workers} worker(s)" for g in series.generations]
    x = range(len(names))
    measured = [g.measured_samples_per_s or 0.0 for g in series.generations]
    predicted = [g.predicted_samples_per_s or 0.0 for g in series.generations]
    ax.bar([i - 0.2 for i in x], predicted, width=0.4, label="predicted", color="tab:gray")
    ax.bar([i + 0.2 for i in x], measured, width=0.4, label="measured", color="tab:green")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("samples/s")
    missing = not any(predicted)
    ax.set_title("measured vs predicted" + (" (the plans carry no prediction)" if missing else ""))
    ax.legend()
    return fig


def plan_figure(plan: Plan, simulated: SimResult | None = None) -> Figure:
    """The plan as a picture: which layers each device runs (stages, with shares); one simulated
    iteration as a Gantt chart (where a cost model is known); each collective's trees."""
    rows = 1 + (simulated is not None) + bool(plan.collectives)
    fig = Figure(figsize=(10, 1 + max(2.0, 0.35 * len(plan.devices)) * rows), layout="constrained")
    axes = list(fig.subplots(rows, 1, squeeze=False)[:, 0])
    _draw_stages(axes.pop(0), plan)
    if simulated is not None:
        draw_gantt(axes.pop(0), plan, simulated)
    if plan.collectives:
        _draw_trees(axes.pop(0), plan)
    return fig


def _draw_stages(ax, plan: Plan) -> None:
    row = {device: i for i, device in enumerate(plan.devices)}
    for s, stage in enumerate(plan.stages):
        for worker in stage.workers:
            span = (stage.layer_start, stage.layer_end - stage.layer_start)
            ax.broken_barh([span], (row[worker.device] - 0.4, 0.8), color=f"C{s % 10}", alpha=0.8)
            ax.text(
                stage.layer_start + span[1] / 2,
                row[worker.device],
                f"stage {s}{' (sharded)' if stage.shard else ''}, {worker.share:.2f}",
                ha="center",
                va="center",
                fontsize=7,
            )
    ax.set_yticks(range(len(plan.devices)), plan.devices)
    ax.invert_yaxis()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layers")
    ax.set_title(f"stages on devices ({plan.model.name}, global batch {plan.global_batch})")


def draw_gantt(ax, plan: Plan, simulated: SimResult) -> None:
    """One simulated iteration: a row per device, forward (F), backward (B), sync (S),
    optimizer step (O) and sleeps, by stage."""
    row = {device: i for i, device in enumerate(plan.devices)}
    for interval in simulated.intervals:
        kind = interval.label[0] if interval.label != "sleep" else "z"
        stage_color = f"C{int(interval.label[1:]) % 10}" if kind in "FB" else "lightgray"
        ax.broken_barh(
            [(interval.start_s, interval.end_s - interval.start_s)],
            (row[interval.device] - 0.4, 0.8),
            color={"S": "black", "O": "gray"}.get(kind, stage_color),
            alpha=1.0 if kind == "F" else 0.55,
            edgecolor="white",
            linewidth=0.3,
        )
    ax.set_yticks(range(len(plan.devices)), plan.devices)
    ax.invert_yaxis()
    ax.set_xlabel(
        "seconds (one simulated iteration; solid forward, pale backward, black sync, gray optimizer, light gray sleep)"
    )
    ax.set_title(f"schedule: {plan.schedule.value}, {simulated.iteration_s:.4g} s an iteration")


def _draw_trees(ax, plan: Plan) -> None:
    devices = sorted({d for c in plan.collectives for tree in c.trees for edge in tree.edges for d in edge})
    angle = {d: 2 * math.pi * i / max(1, len(devices)) for i, d in enumerate(devices)}
    where = {d: (math.cos(a), math.sin(a)) for d, a in angle.items()}
    for c_index, collective in enumerate(plan.collectives):
        for t_index, tree in enumerate(collective.trees):
            color = f"C{(c_index * 3 + t_index) % 10}"
            for a, b in tree.edges:
                ax.annotate("", where[b], where[a], arrowprops={"arrowstyle": "->", "color": color, "alpha": 0.7})
            ax.plot([], [], color=color, label=f"{collective.group}: tree {t_index} ({tree.weight:.2f} GB/s)")
    for device, (x, y) in where.items():
        ax.text(x, y, device, ha="center", va="center", fontsize=8, bbox={"facecolor": "white", "alpha": 0.8})
    ax.set_xlim(-1.5, 1.5)
    ax.set_ylim(-1.3, 1.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    ax.set_title("collective trees over the links")


def save_png(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path``, whole or not at all (:func:`~felactl.fsutil.atomic_write`)."""
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), mode=0o644)

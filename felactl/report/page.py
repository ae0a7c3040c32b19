"""``felactl report``'s page: the run's figures as PNGs and one HTML page that holds them inline."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from felactl.fsutil import atomic_write_text, check_directory

FIGURES = ("progress", "workers", "prediction", "plan")


def write_report(run: str, runs_root: Path, out_dir: Path | None = None) -> dict[str, Any]:
    """Write run ``run``'s figures (``<name>.png``) and ``report.html`` into ``out_dir`` (default:
    the run's ``report/``); what was written, and why a figure was left out."""
    from felactl.launcher.rundir import RunDir
    from felactl.report import figures
    from felactl.report.series import read_run

    rundir = RunDir.find(run, root=runs_root)
    out_dir = Path(out_dir) if out_dir is not None else rundir.path / "report"
    check_directory("-o", out_dir)
    series = read_run(str(rundir.path), runs_root)
    drawn: dict[str, Path] = {}
    left_out: dict[str, str] = {}
    if series.steps:
        drawn["progress"] = figures.save_png(figures.progress_figure(series), out_dir / "progress.png")
        drawn["workers"] = figures.save_png(figures.workers_figure(series), out_dir / "workers.png")
        drawn["prediction"] = figures.save_png(figures.prediction_figure(series), out_dir / "prediction.png")
    else:
        left_out.update(dict.fromkeys(("progress", "workers", "prediction"), "no step recorded yet"))
    if series.plan is not None:
        simulated, why = simulated_iteration(series.plan, rundir.profiles())
        if why:
            left_out["schedule"] = why
        drawn["plan"] = figures.save_png(figures.plan_figure(series.plan, simulated), out_dir / "plan.png")
    else:
        left_out["plan"] = "the run has no plan (a --script run)"
    page = atomic_write_text(out_dir / "report.html", render_page(series, drawn, left_out), mode=0o644)
    return {
        "run": series.run,
        "state": series.state,
        "html": str(page),
        "figures": {k: str(v) for k, v in drawn.items()},
        "left_out": left_out,
    }


def simulated_iteration(plan, profiles) -> tuple[Any, str]:
    """One simulated iteration of ``plan`` (None where its profiles are unknown, with why)."""
    if profiles is None:
        return None, "the launch was not given the profiles the plan was made from (--cluster, --model)"
    from felactl.optimizer.planner import plan_cost_model
    from felactl.optimizer.simulator import simulate

    cluster, model = profiles
    return simulate(plan, plan_cost_model(plan, cluster, model, use_trees=plan.sync.use_trees)), ""


def render_page(series, drawn: dict[str, Path], left_out: dict[str, str]) -> str:
    """The HTML page: the run's figures inline (base64 PNGs), its summary and its events."""
    summary = series.summary or {}
    facts = {
        "state": f"{series.state}{f' ({series.state_reason})' if series.state_reason else ''}",
        "steps": len(series.steps),
        "workers": len(series.workers),
        "first loss": _number(series.loss[0]) if series.loss else "-",
        "last loss": _number(series.loss[-1]) if series.loss else "-",
        "samples/s": _number(summary.get("samples_per_s")) if summary else "-",
        "wall s": _number(summary.get("wall_s")) if summary else "-",
    }
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts.items())
    events = (
        "".join(f"<tr><td>{m.t_s:.1f}</td><td>{html.escape(m.label)}</td></tr>" for m in series.marks)
        or "<tr><td colspan=2>none</td></tr>"
    )
    images = "".join(
        f'<h2>{html.escape(name)}</h2><img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}">'
        for name, path in drawn.items()
    )
    missing = "".join(f"<li>{html.escape(k)}: {html.escape(v)}</li>" for k, v in left_out.items())
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>felactl report: {html.escape(series.run)}</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
        "img{max-width:100%;border:1px solid #eee}</style></head><body>"
        f"<h1>run {html.escape(series.run)}</h1><table>{rows}</table>"
        f"<h2>events (seconds since the first step)</h2><table>{events}</table>"
        f"{images}" + (f"<h2>not drawn</h2><ul>{missing}</ul>" if missing else "") + "</body></html>\n"
    )


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}"

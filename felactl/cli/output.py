"""Where output goes: one JSON object on stdout with --json; everything for people on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console

# Human output (tables, progress, messages) never touches stdout, so `--json | jq` always works.
# Lines are not wrapped by rich (soft_wrap): a path or a command broken across lines cannot be
# copied; a terminal still folds a long line for the eye. Tables keep their own layout. Text is
# printed as it is, never read as rich markup: what felactl prints is mostly others' words (a
# user's exception, gloo's errors, which name their C++ source in brackets, paths, plan fields).
stderr = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)


def emit(result: dict[str, Any], as_json: bool, render: Callable[[Console], None]) -> None:
    """Print ``result`` as one JSON object on stdout, or ``render`` it for people on stderr."""
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
        sys.stdout.flush()
    else:
        render(stderr)


def wide(console: Console) -> Console:
    """``console`` on a terminal; piped to a file or a CI log, where there is no width to respect,
    a 160-column console on the same file, so tables keep their numbers whole."""
    if console.is_terminal:
        return console
    return Console(file=console.file, width=160, highlight=False, soft_wrap=True, markup=False)


def progress():
    """The progress bar of a long command, on stderr: gone when it ends, and off where stderr is
    not a terminal (a log would keep every redraw)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
        disable=not stderr.is_terminal,
    )


def debug_enabled(ctx) -> bool:
    """``--debug`` on the command line (on this command's context or a parent's), or
    ``FELACTL_DEBUG=1``: tracebacks instead of one line, and what a command keeps for debugging."""
    import os

    if os.environ.get("FELACTL_DEBUG") == "1":
        return True
    while ctx is not None:
        if isinstance(ctx.obj, dict) and ctx.obj.get("debug"):
            return True
        ctx = ctx.parent
    return False

"""Where output goes: one JSON object on stdout with --json; everything for people on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

from rich.console import Console

# Human output (tables, progress, messages) never touches stdout, so `--json | jq` always works.
stderr = Console(stderr=True, highlight=False)


def emit(result: dict[str, Any], as_json: bool, render: Callable[[Console], None]) -> None:
    """Print ``result`` as one JSON object on stdout, or ``render`` it for people on stderr."""
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
        sys.stdout.flush()
    else:
        render(stderr)

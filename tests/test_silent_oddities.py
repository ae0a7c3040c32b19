"""Oddities that used to pass in silence are refused, or said (issue 30, item 6).

Each test here failed before its fix: a list flag that dropped an empty item, a cluster file
claiming a core no machine has, a micro-batch larger than any worker's share, a dataset shorter
than the global batch, a built-in model too large for this machine, a run without an ETA.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["profile", "--model", "mlp", "--batch-sizes", "1,,2"], "--batch-sizes"),
        (["profile", "--model", "mlp", "--batch-sizes", "1,2,"], "--batch-sizes"),
        (["profile", "--model", "mlp", "--input-shape", "3,,32"], "--input-shape"),
    ],
)
def test_an_empty_item_in_a_list_flag_is_refused(argv, flag, tmp_path, monkeypatch):
    """``1,,2`` profiled batch sizes 1 and 2 and said nothing of the item it dropped."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"felactl: error: {flag}") and "empty item" in lines[0], (
        result.stderr
    )
    assert not list(tmp_path.iterdir())

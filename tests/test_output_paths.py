"""Output never replaces what is not a regular file, and a path that cannot be written is one line
and exit 2 (issue 30 item 3): ``plan -o`` and ``export -o`` onto a device, a FIFO, a socket, a
directory, ``/proc``, a read-only or a full filesystem; a truncated or corrupt checkpoint given to
``export``."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest
from test_export import _write_run
from typer.testing import CliRunner

from felactl.cli.main import app
from tests._worker_helpers import dp_plan

ROOT = Path(__file__).resolve().parents[1]
PLAN = [
    "plan",
    "--cluster",
    str(ROOT / "plans" / "clusters" / "dgx1v.yaml"),
    "--model",
    str(ROOT / "plans" / "models" / "vgg-mini.yaml"),
    "--global-batch",
    "64",
    "--devices",
    "0,1",
]
runner = CliRunner()
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and mount need root")


def _plan_to(path: Path):
    return runner.invoke(app, [*PLAN, "-o", str(path)])


def _export_to(tmp_path: Path, path: Path):
    runs = tmp_path / "runs"
    if not (runs / "r").exists():
        _write_run(runs, "r", dp_plan(2), {2: [0]})
    return runner.invoke(app, ["export", "r", "--runs-root", str(runs), "-o", str(path)])


def _one_line(result, needle: str) -> str:
    """The one stderr line of an exit 2 that names ``needle`` (asserted), returned."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "internal error" not in lines[0], result.stderr
    return lines[0]


def _kinds(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a socket and a directory (and, as root, a character device like /dev/full)."""
    made = {"FIFO": tmp_path / "fifo", "socket": tmp_path / "sock", "directory": tmp_path / "dir"}
    os.mkfifo(made["FIFO"])
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(made["socket"]))
    made["directory"].mkdir()
    if os.geteuid() == 0:
        made["character device"] = tmp_path / "full"
        os.mknod(made["character device"], stat.S_IFCHR | 0o666, os.makedev(1, 7))
    return made


@pytest.mark.parametrize("command", ["plan", "export"])
def test_output_onto_a_device_fifo_socket_or_directory_is_refused_and_the_node_stays(tmp_path, command):
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    kinds = _kinds(nodes)
    for kind, path in kinds.items():
        before = path.lstat()
        result = _plan_to(path) if command == "plan" else _export_to(tmp_path, path)
        _one_line(result, f"{path}: is a {kind}")
        after = path.lstat()
        assert (stat.S_IFMT(after.st_mode), after.st_ino) == (stat.S_IFMT(before.st_mode), before.st_ino), kind
    assert sorted(nodes.iterdir()) == sorted(kinds.values())  # no temp file left beside them


@pytest.mark.parametrize("command", ["plan", "export"])
def test_output_under_proc_is_one_line(tmp_path, command):
    path = Path("/proc/felactl-output-test")
    result = _plan_to(path) if command == "plan" else _export_to(tmp_path, path)
    line = _one_line(result, "/proc/felactl-output-test")
    assert line.startswith("felactl: error: cannot write /proc/felactl-output-test"), line
    assert not path.exists()


@pytest.fixture
def small_filesystem(tmp_path):
    """A 256 KiB tmpfs, mounted for the test and unmounted after it."""
    where = tmp_path / "mnt"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@as_root
@pytest.mark.parametrize("command", ["plan", "export"])
def test_output_onto_a_full_filesystem_is_one_line_and_leaves_nothing(tmp_path, small_filesystem, command):
    fd = os.open(small_filesystem / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # no space left: what the test wants
        pass
    finally:
        os.close(fd)
    out = small_filesystem / "out"
    result = _plan_to(out) if command == "plan" else _export_to(tmp_path, out)
    _one_line(result, f"cannot write {out}")
    assert sorted(p.name for p in small_filesystem.iterdir()) == ["filler"]


@as_root
@pytest.mark.parametrize("command", ["plan", "export"])
def test_output_onto_a_read_only_filesystem_is_one_line(tmp_path, small_filesystem, command):
    subprocess.run(["mount", "-o", "remount,ro", str(small_filesystem)], check=True)
    out = small_filesystem / "out"
    result = _plan_to(out) if command == "plan" else _export_to(tmp_path, out)
    _one_line(result, f"cannot write {out}")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_truncated_or_corrupt_checkpoint_is_one_line_for_export(tmp_path, damage):
    runs = tmp_path / "runs"
    run = _write_run(runs, "r", dp_plan(2), {2: [0]})
    (checkpoint,) = run.glob("checkpoints/*/stage0.pt")
    data = checkpoint.read_bytes()
    checkpoint.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a checkpoint" * 64)
    result = runner.invoke(app, ["export", "r", "--runs-root", str(runs), "-o", str(tmp_path / "m.pt")])
    _one_line(result, str(checkpoint))
    assert not (tmp_path / "m.pt").exists()

"""This machine's facts that profiles are keyed by: the CPU quota a cgroup holds a process to."""

from __future__ import annotations

from pathlib import Path

import pytest

from felactl import machine


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def _write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("_", ".", 1)).write_text(text)


@pytest.fixture
def two_cores(monkeypatch):
    """A process that may run on two cores, told no quota (a testbed node tells one)."""
    monkeypatch.setattr(machine, "available_cores", lambda: [0, 1])
    monkeypatch.delenv(machine.CPU_QUOTA_ENV, raising=False)


def test_a_v1_quota_and_the_smallest_along_the_way_to_the_root(tmp_path, two_cores):
    mount = tmp_path / "cgroup" / "cpu"
    _write(mount / "felactl" / "tb", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    _write(mount / "felactl" / "tb" / "small", cpu_cfs_quota_us="1000", cpu_cfs_period_us="10000")
    proc = _proc(
        tmp_path,
        "4:memory:/x\n1:cpu:/felactl/tb/small\n0::/\n",
        f"31 23 0:28 / {tmp_path / 'cgroup'} rw - tmpfs tmpfs rw\n32 31 0:29 / {mount} rw - cgroup cgroup rw,cpu\n",
    )
    assert machine.cpu_quota_cores(proc) == pytest.approx(0.1)
    _write(mount / "felactl", cpu_cfs_quota_us="5000", cpu_cfs_period_us="100000")  # a parent holds it lower
    assert machine.cpu_quota_cores(proc) == pytest.approx(0.05)


def test_a_v2_quota_is_read_whether_or_not_it_binds_on_the_cores_in_hand(tmp_path, two_cores, monkeypatch):
    """A slot pinned to one of a 1.5-core container's two cores and the unpinned model profile
    must name the slot alike: the quota does not depend on the process's affinity."""
    mount = tmp_path / "unified"
    _write(mount / "job", cpu_max="150000 100000\n")
    proc = _proc(tmp_path, "0::/job\n", f"40 23 0:40 / {mount} rw - cgroup2 cgroup2 rw\n")
    assert machine.cpu_quota_cores(proc) == pytest.approx(1.5)
    monkeypatch.setattr(machine, "available_cores", lambda: [0])
    assert machine.cpu_quota_cores(proc) == pytest.approx(1.5)
    (mount / "job" / "cpu.max").write_text("max 100000\n")
    assert machine.cpu_quota_cores(proc) is None


def test_no_readable_cgroup_is_no_quota(tmp_path, two_cores):
    assert machine.cpu_quota_cores(tmp_path / "missing") is None
    proc = _proc(tmp_path, "1:cpu:/gone\nnot a cgroup line\n", "garbage\n")
    assert machine.cpu_quota_cores(proc) is None
    mount = tmp_path / "cgroup" / "cpu"
    _write(mount / "x", cpu_cfs_quota_us="1000", cpu_cfs_period_us="ten")
    proc = _proc(tmp_path / "b", "1:cpu:/x\n", f"32 31 0:29 / {mount} rw - cgroup cgroup rw,cpu\n")
    assert machine.cpu_quota_cores(proc) is None


def test_a_quota_told_in_the_environment_counts_where_no_cgroup_file_system_is_mounted(
    tmp_path, two_cores, monkeypatch
):
    """Inside ``ip netns exec`` (a testbed node) /sys is a fresh mount: no cgroup to read."""
    proc = _proc(tmp_path, "1:cpu:/felactl-tb/small\n", "")
    assert machine.cpu_quota_cores(proc) is None
    monkeypatch.setenv(machine.CPU_QUOTA_ENV, "0.1")
    assert machine.cpu_quota_cores(proc) == pytest.approx(0.1)
    monkeypatch.setenv(machine.CPU_QUOTA_ENV, "nonsense")
    assert machine.cpu_quota_cores(proc) is None

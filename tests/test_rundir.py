import os
import threading

import pytest

from felactl.errors import InputError
from felactl.launcher.rundir import RunDir, append_jsonl, read_jsonl


def test_create_and_find(tmp_path):
    run = RunDir.create("exp-1", root=tmp_path)
    assert run.logs.is_dir() and run.checkpoints.is_dir()
    run.plan.write_text("kind: Plan\n")
    assert RunDir.find("exp-1", root=tmp_path).path == run.path
    assert RunDir.find("", root=tmp_path).path == run.path
    with pytest.raises(InputError, match="already exists"):
        RunDir.create("exp-1", root=tmp_path)
    with pytest.raises(InputError, match="no run 'nope'"):
        RunDir.find("nope", root=tmp_path)


@pytest.mark.parametrize("bad", ["../x", "a/b", " x", "x" * 65])
def test_bad_run_ids_are_refused(tmp_path, bad):
    with pytest.raises(InputError, match="--run-id"):
        RunDir.create(bad, root=tmp_path)


def test_jsonl_concurrent_appends_stay_whole_lines(tmp_path):
    path = tmp_path / "m.jsonl"

    def writer(w):
        for i in range(200):
            append_jsonl(path, {"worker": w, "step": i, "pad": "x" * 300})

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = read_jsonl(path)
    assert len(records) == 800
    assert sorted((r["worker"], r["step"]) for r in records) == [(w, i) for w in range(4) for i in range(200)]


def test_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "e.jsonl"
    append_jsonl(path, {"kind": "join"})
    with open(path, "a") as f:
        f.write('{"kind": "le')
    assert read_jsonl(path) == [{"kind": "join"}]


def test_summary_written_atomically(tmp_path):
    run = RunDir.create(None, root=tmp_path)
    run.write_summary({"steps": 3})
    assert run.read_summary() == {"steps": 3}
    assert not [p for p in os.listdir(run.path) if p.endswith(".tmp")]


def test_jsonl_tail_reads_only_the_last_whole_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in range(1000):
        append_jsonl(path, {"step": step, "pad": "x" * 40})
    tail = read_jsonl(path, tail_bytes=2000)
    steps = [r["step"] for r in tail]
    assert steps == list(range(steps[0], 1000)) and 20 < len(steps) < 50  # whole records, the newest
    assert read_jsonl(path, tail_bytes=10 ** 9) == read_jsonl(path)
    assert read_jsonl(tmp_path / "absent.jsonl", tail_bytes=100) == []


def test_old_checkpoints_are_pruned_once_newer_ones_are_complete(tmp_path):
    from felactl.launcher.resume import prune_checkpoints

    root = tmp_path / "checkpoints"
    for step, stages in [(10, 2), (20, 2), (30, 1), (40, 2), (50, 1)]:  # 30 and 50: stage 1 missing
        (root / f"step{step:06d}").mkdir(parents=True)
        for s in range(stages):
            (root / f"step{step:06d}" / f"stage{s}.pt").write_bytes(b"x")
    assert prune_checkpoints(root, 2, keep=0) == []  # keep everything
    gone = prune_checkpoints(root, 2, keep=2)  # complete: 10, 20, 40 -> keep 20 and 40
    assert [p.name for p in gone] == ["step000010"]
    assert sorted(p.name for p in root.iterdir()) == ["step000020", "step000030", "step000040", "step000050"]
    assert prune_checkpoints(root, 2, keep=2) == []  # 50 is still being written: nothing else goes


def test_a_resume_takes_what_it_does_not_restate_from_the_run_it_continues(tmp_path):
    from felactl.fsutil import atomic_write_text
    from felactl.launcher.resume import run_counts

    assert run_counts(None, tmp_path, steps=None, checkpoint_every=None, keep_checkpoints=None) == {}, \
        "a new run takes LaunchOptions' defaults"
    assert run_counts(None, tmp_path, steps=7, checkpoint_every=None, keep_checkpoints=None) == {"steps": 7}
    run = RunDir.create("r", root=tmp_path)
    atomic_write_text(run.plan, "kind: Plan\n")  # what marks a run directory
    atomic_write_text(run.path / "launch.json", '{"steps": 500, "checkpoint_every": 20}')
    assert run_counts("r", tmp_path, steps=800, checkpoint_every=None, keep_checkpoints=None) == {
        "steps": 800, "checkpoint_every": 20, "keep_checkpoints": 0}  # launched before pruning: keep all


def test_a_runs_state_follows_its_newest_start_or_end(tmp_path):
    run = RunDir.create("r", root=tmp_path)
    states = [run.state()]
    for kind in ("launch", "scale-out", "failed", "resume", "refused"):
        append_jsonl(run.events, {"kind": kind, "endpoint": "127.0.0.1:1"})
        states.append(run.state())
    assert states == ["created", "running", "running", "failed", "running", "running"], \
        "a failed run that was resumed is running again"
    run.write_summary({"steps": 1})
    assert run.state() == "finished"

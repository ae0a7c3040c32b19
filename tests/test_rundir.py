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

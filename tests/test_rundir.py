import os
import subprocess
import sys
import threading
import time

import pytest

from felactl.errors import InputError
from felactl.launcher import liveness
from felactl.launcher.liveness import LaunchIdentity, Liveness, judge
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
    assert read_jsonl(path, tail_bytes=10**9) == read_jsonl(path)
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

    assert run_counts(None, tmp_path, steps=None, checkpoint_every=None, keep_checkpoints=None) == {}, (
        "a new run takes LaunchOptions' defaults"
    )
    assert run_counts(None, tmp_path, steps=7, checkpoint_every=None, keep_checkpoints=None) == {"steps": 7}
    run = RunDir.create("r", root=tmp_path)
    atomic_write_text(run.plan, "kind: Plan\n")  # what marks a run directory
    atomic_write_text(run.path / "launch.json", '{"steps": 500, "checkpoint_every": 20}')
    assert run_counts("r", tmp_path, steps=800, checkpoint_every=None, keep_checkpoints=None) == {
        "steps": 800,
        "checkpoint_every": 20,
        "keep_checkpoints": 0,
    }  # launched before pruning: keep all
    atomic_write_text(run.path / "launch.json", '{"steps": 500, "slowdown": "1=3", "straggler": null}')
    assert run_counts("r", tmp_path, slowdown=None, straggler="prob:0.1:1") == {
        "steps": 500,
        "keep_checkpoints": 0,
        "slowdown": "1=3",
        "straggler": "prob:0.1:1",
    }


def test_the_runs_plan_records_the_sync_mode_it_runs_with(tmp_path):
    """launch --sync X over a plan of another mode: the run's own plan says X, so a resume (which
    runs the run's plan) keeps X. (A user trial's --sync bsp run resumed as tokens, silently.)"""
    from felactl.launcher.prepare import LaunchOptions, prepare_run, runnable_plan
    from felactl.models import local_data_parallel_plan
    from felactl.spec import SyncMode, SyncSpec, load_plan, save

    plan = save(
        local_data_parallel_plan("mlp", {}, 2, global_batch=8, micro_batch=4, sync=SyncSpec(mode=SyncMode.TOKENS)),
        tmp_path / "plan.yaml",
    )
    options = LaunchOptions(plan_path=plan, run_id="s", runs_root=tmp_path / "runs", sync=SyncMode.WBSP)
    run, _, _ = prepare_run(options, runnable_plan(options, None))
    assert load_plan(run.plan).sync.mode is SyncMode.WBSP


def test_a_runs_state_follows_its_newest_start_or_end(tmp_path):
    run = RunDir.create("r", root=tmp_path)
    me = LaunchIdentity.of_this_process().to_dict()  # this test plays the launch process
    states = [run.state()]
    for kind in ("launch", "scale-out", "failed", "resume", "refused"):
        append_jsonl(run.events, {"kind": kind, "endpoint": "127.0.0.1:1", "launcher": me})
        states.append(run.state())
    assert states == ["created", "running", "running", "failed", "running", "running"], (
        "a failed run that was resumed is running again"
    )
    run.write_summary({"steps": 1})
    assert run.state() == "finished"


def _dead_launch() -> dict:
    """The identity of a launch process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    identity = LaunchIdentity(
        host=liveness.short_hostname(),
        pid=proc.pid,
        started=liveness.psutil.Process(proc.pid).create_time(),
        pid_ns=liveness._pid_namespace(),
    )
    proc.wait()
    return identity.to_dict()


def test_a_run_whose_launch_process_died_is_lost(tmp_path):
    run = RunDir.create("r", root=tmp_path)
    append_jsonl(run.events, {"kind": "launch", "endpoint": "127.0.0.1:1", "launcher": _dead_launch()})
    run.heartbeat.touch()  # fresh: on its own machine the kernel's word wins over the heartbeat
    state = run.run_state()
    assert state.name == "lost" and "its launch process (pid " in state.reason and "is gone" in state.reason


def test_a_recycled_pid_is_not_the_launch(tmp_path):
    run = RunDir.create("r", root=tmp_path)
    me = LaunchIdentity.of_this_process()
    recycled = {**me.to_dict(), "started": me.started - 3600.0}  # this pid, but a process of an hour ago
    append_jsonl(run.events, {"kind": "launch", "endpoint": "127.0.0.1:1", "launcher": recycled})
    assert run.state() == "lost"


def test_a_launch_on_another_host_is_judged_by_its_heartbeat(tmp_path):
    run = RunDir.create("r", root=tmp_path)
    elsewhere = {"host": "not-" + liveness.short_hostname(), "pid": 1, "started": 1.0, "pid_ns": None}
    append_jsonl(run.events, {"kind": "launch", "endpoint": "10.0.0.9:29500", "launcher": elsewhere})
    assert run.run_state().name == "unknown", "no heartbeat file: nothing to tell by"
    run.heartbeat.touch()
    assert run.state() == "running"
    stale = time.time() - liveness.LOST_AFTER_S - 5
    os.utime(run.heartbeat, (stale, stale))
    state = run.run_state()
    assert state.name == "lost" and "has not touched its heartbeat for 35 s" in state.reason, state.reason


def test_a_run_from_before_the_evidence_is_unknown_not_running(tmp_path):
    run = RunDir.create("r", root=tmp_path)
    append_jsonl(run.events, {"kind": "launch", "endpoint": "127.0.0.1:1"})
    state = run.run_state()
    assert state.name == "unknown" and "older felactl" in state.reason
    append_jsonl(run.events, {"kind": "resume", "endpoint": "127.0.0.1:1", "launcher": {"pid": "x"}})
    assert run.state() == "unknown", "a malformed identity is no evidence either"


@pytest.mark.parametrize(
    "same_machine, observed_start, heartbeat_age_s, verdict",
    [
        (True, 100.0, None, "alive"),
        (True, 100.4, 999.0, "alive"),  # a stopped launch keeps its process: still there
        (True, None, 0.0, "gone"),  # no such process, even with a fresh heartbeat
        (True, 250.0, 0.0, "gone"),  # the pid now belongs to a younger process
        (False, None, 1.0, "alive"),
        (False, None, liveness.LOST_AFTER_S + 1, "gone"),
        (False, None, None, "unknown"),
    ],
)
def test_the_liveness_judgement(same_machine, observed_start, heartbeat_age_s, verdict):
    identity = LaunchIdentity(host="box", pid=42, started=100.0)
    assert (
        judge(
            identity, same_machine=same_machine, observed_start=observed_start, heartbeat_age_s=heartbeat_age_s
        ).verdict
        == verdict
    )
    assert judge(None, same_machine=True, observed_start=1.0, heartbeat_age_s=0.0).verdict == "unknown"
    assert Liveness("alive").reason == ""


def test_the_heartbeat_is_touched_until_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(liveness, "HEARTBEAT_S", 0.05)
    path = tmp_path / "heartbeat"
    beat = liveness.Heartbeat(path)
    assert path.exists(), "the file exists as soon as the heartbeat does"
    os.utime(path, (1.0, 1.0))
    deadline = time.monotonic() + 5
    while path.stat().st_mtime == 1.0 and time.monotonic() < deadline:
        time.sleep(0.02)
    beat.stop()
    assert path.stat().st_mtime > 1.0 and not beat._thread.is_alive()


def test_scale_refuses_a_lost_run_and_says_how_to_continue_it(tmp_path):
    from felactl.launcher.scale import coordinator_endpoint

    run = RunDir.create("r", root=tmp_path)
    append_jsonl(run.events, {"kind": "launch", "endpoint": "127.0.0.1:1", "launcher": _dead_launch()})
    with pytest.raises(
        InputError,
        match=r"run r is lost: its launch process .* is gone, so nothing can "
        r"rescale it; continue it from its newest checkpoint with "
        r"`felactl launch --resume r`",
    ):
        coordinator_endpoint(run)


def test_a_runs_root_that_is_a_file_is_refused_in_one_line(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("not a directory")
    with pytest.raises(InputError, match=r"--runs-root .*runs: cannot make the run directory"):
        RunDir.create("a", root=blocker)


@pytest.mark.multiprocess
def test_launch_script_with_a_runs_root_that_is_a_file_exits_2(tmp_path):
    (tmp_path / "runs").write_text("")
    (tmp_path / "train.py").write_text("print('never runs')\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "felactl",
            "launch",
            "--script",
            str(tmp_path / "train.py"),
            "--nproc-per-node",
            "1",
            "--runs-root",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "cannot make the run directory" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_status_reads_runs_without_importing_torch():
    """launcher/resume.py imports torch only where a checkpoint is read, so `felactl status`
    (which reads a run's last launch through it) stays quick."""
    code = "import sys, felactl.launcher.status; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_newest_run_is_the_one_that_last_recorded_not_the_one_last_reported(tmp_path):
    """`felactl report A` writes A/report/, which moves A's directory mtime: `felactl status`
    without a run then took A for the newest (was: sorted by the directory's mtime)."""
    older, newer = RunDir.create("a", root=tmp_path), RunDir.create("b", root=tmp_path)
    for run, at in ((older, 1000.0), (newer, 2000.0)):
        (run.path / "launch.json").write_text("{}")
        append_jsonl(run.events, {"time": at, "kind": "launch"})
        os.utime(run.events, (at, at))
    (older.path / "report").mkdir()  # what felactl report a leaves
    assert RunDir.find("", root=tmp_path).run_id == "b"

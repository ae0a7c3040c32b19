"""The control-plane protocol on its own: sealing and opening documents, keys, modes, binding."""

from __future__ import annotations

import json
import stat
from types import SimpleNamespace

import psutil
import pytest

from felactl.control import Forged, Reader, Seal, job_binding, keys
from felactl.control.documents import GenerationDoc, StopDoc, StuckDoc
from felactl.control.store import serve_store
from felactl.launcher.controlplane import new_secret
from felactl.launcher.rundir import RunDir

SECRET = new_secret()
JOB = job_binding("run-1", "s1")


def _gen_doc(generation: int = 3) -> str:
    doc = GenerationDoc(generation=generation, members=[0, 1], plan="/p.yaml", kind="scale-out")
    return Seal(SECRET, JOB).seal(
        keys.generation_document(generation), doc.KIND.value, doc.to_body(), generation=generation
    )


def test_a_sealed_document_opens_with_its_key_job_and_generation():
    opened = Seal(SECRET, JOB).open(keys.generation_document(3), _gen_doc(3), "generation", generation=3)
    assert GenerationDoc.from_body(opened.body).members == [0, 1] and opened.generation == 3


def _tampered(field: str, value) -> str:
    envelope = json.loads(_gen_doc(3))
    if field == "members":
        envelope["body"]["members"] = value
    else:
        envelope[field] = value
    return json.dumps(envelope)


@pytest.mark.parametrize(
    "raw, key, expected, why",
    [
        (_tampered("members", [0]), keys.generation_document(3), {}, "wrong signature"),  # altered field
        (_tampered("seq", 1), keys.generation_document(3), {}, "wrong signature"),  # altered sequence
        (_gen_doc(3), keys.generation_document(8), {}, "moved here"),  # another key
        (_gen_doc(3), keys.generation_document(3), {"generation": 4}, "generation 3, expected 4"),  # wrong generation
        ("garbage", keys.STOP, {}, "not a signed document"),
        ("{}", keys.done(0), {}, "not a signed document"),
        (json.dumps([1, 2]), keys.STOP, {}, "not a signed document"),
    ],
    # named, not by the documents: those hold a time-based sequence, and pytest-xdist's workers
    # must collect the same names
    ids=["altered-field", "altered-seq", "moved", "wrong-generation", "garbage", "empty", "a-list"],
)
def test_a_forgery_is_refused_naming_what_is_wrong(raw, key, expected, why):
    with pytest.raises(Forged, match=why):
        Seal(SECRET, JOB).open(key, raw, "generation", **expected)


def test_another_secret_another_job_or_an_earlier_launch_is_refused():
    raw = _gen_doc(3)
    key = keys.generation_document(3)
    with pytest.raises(Forged, match="wrong signature"):
        Seal(new_secret(), JOB).open(key, raw, "generation")
    for other in (job_binding("run-2", "s1"), job_binding("run-1", "s0")):  # another job; an earlier launch
        with pytest.raises(Forged, match="another job or launch"):
            Seal(SECRET, other).open(key, raw, "generation")


def test_a_document_of_another_kind_is_refused():
    seal = Seal(SECRET, JOB)
    raw = seal.seal(keys.STOP, "job", {"assignments": {}})
    with pytest.raises(Forged, match="where a 'stop' one belongs"):
        seal.open(keys.STOP, raw, "stop")


class _Store:
    """The part of a TCPStore a Reader uses, in memory."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def check(self, names):
        return all(n in self.values for n in names)

    def get(self, name):
        return self.values[name]

    def set(self, name, value):
        self.values[name] = value.encode() if isinstance(value, str) else value

    def compare_set(self, name, expected, desired):
        """As c10d's: a missing key is set only when ``expected`` is empty, else ``expected`` comes back."""
        expected = expected.encode() if isinstance(expected, str) else expected
        if name not in self.values:
            if expected:
                return expected
            self.set(name, desired)
        elif self.values[name] == expected:
            self.set(name, desired)
        return self.values[name]


def test_a_replayed_document_is_refused_and_each_forgery_reported_once():
    store, refused = _Store(), []
    writer = Reader(Seal(SECRET, JOB), store, "p/")
    reader = Reader(Seal(SECRET, JOB), store, "p/", on_refused=lambda key, why: refused.append((key, why)))
    writer.write(keys.STOP, "stop", StopDoc("first").to_body())
    old = store.values["p/" + keys.STOP]
    writer.write(keys.STOP, "stop", StopDoc("second").to_body())
    assert reader.read(keys.STOP, "stop").body["reason"] == "second"
    store.values["p/" + keys.STOP] = old  # the older document put back
    assert reader.read(keys.STOP, "stop") is None and reader.read(keys.STOP, "stop") is None
    assert len(refused) == 1 and "replayed" in refused[0][1]
    store.values["p/" + keys.STOP] = b"garbage"
    assert reader.read(keys.STOP, "stop") is None
    assert [key for key, _ in refused] == [keys.STOP, keys.STOP]


def test_a_typed_read_refuses_a_signed_but_malformed_body_once():
    """What a worker reads from a member's stuck report or arrival: a document signed with the
    secret whose fields are of the wrong type is refused (reported once), not trusted half-way."""
    store, refused = _Store(), []
    writer = Reader(Seal(SECRET, JOB), store, "p/")
    reader = Reader(Seal(SECRET, JOB), store, "p/", on_refused=lambda key, why: refused.append((key, why)))
    name = keys.stuck(2, 1)
    assert reader.read_doc(name, StuckDoc, generation=2) is None and not refused  # absent
    writer.write(name, "stuck", {"why": "timeout", "unreachable": [0]}, generation=2)
    assert reader.read_doc(name, StuckDoc, generation=2) == StuckDoc("timeout", [0])
    writer.write(name, "stuck", {"why": 7}, generation=2)
    assert reader.read_doc(name, StuckDoc, generation=2) is None
    assert reader.read_doc(name, StuckDoc, generation=2) is None
    assert refused == [(name, "malformed (why: int)")]
    writer.write(name, "stuck", {"why": "a member"}, generation=2)  # an older report without the field
    assert reader.read_doc(name, StuckDoc, generation=2) == StuckDoc("a member", [])


def test_an_agreement_replaces_a_forgery_and_keeps_the_first_valid_proposal():
    store, refused = _Store(), []
    reader = Reader(Seal(SECRET, JOB), store, "", on_refused=lambda key, why: refused.append(key))
    store.set(keys.LAST_STEP, "999")  # forged: everybody would stop at step 999
    assert reader.agree(keys.LAST_STEP, "last-step", {"step": 12}) == {"step": 12}
    assert reader.agree(keys.LAST_STEP, "last-step", {"step": 40}) == {"step": 12}  # the first one stands
    assert refused == [keys.LAST_STEP]


def test_no_store_key_is_written_as_an_f_string_outside_the_protocol():
    """The store's key names live in felactl/control/keys.py only."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent / "felactl"
    pattern = re.compile(
        r'f"[^"]*(elastic/|agents/|join/|scale/|/gen|done/|hb/|ready/|switched/|stuck/|'
        r"switch/|drain/|auth/|tok/|fx/|profile/|b/\{|helpers/|sum/|sd/|arrival/|group/|tickets)"
    )
    offenders = [
        f"{p.relative_to(root)}:{n}"
        for p in root.rglob("*.py")
        if "control" not in p.parts
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders


def test_run_directories_are_private(tmp_path):
    run = RunDir.create("r", root=tmp_path / "runs")
    for path in (run.path, run.path / "logs", run.path / "checkpoints"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def test_the_store_server_listens_on_the_address_it_is_given_only():
    store, port = serve_store("127.0.0.1")
    try:
        listening = [
            c
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)
    finally:
        del store


def test_run_local_serves_its_store_on_loopback_only(monkeypatch, tmp_path):
    """run_local's store used to be a plain TCPStore server: listening on every address."""
    from felactl.agents.worker import local

    seen = []
    real = local.serve_store
    monkeypatch.setattr(local, "serve_store", lambda host: seen.append(host) or real(host))
    monkeypatch.setattr(local, "_wait_all", lambda procs, logs, deadline: None)
    zygote = SimpleNamespace(close=lambda: None)
    monkeypatch.setattr(local, "Zygote", SimpleNamespace(unless_switched_off=lambda env: zygote))
    monkeypatch.setattr(
        local, "start_process", lambda *a: SimpleNamespace(poll=lambda: 0, wait=lambda: 0, kill=lambda: None)
    )
    local.run_local(tmp_path / "plan.yaml", tmp_path / "run", 1)
    assert seen == ["127.0.0.1"]


def test_forgeries_written_in_a_loop_do_not_fill_the_events_file(tmp_path):
    from felactl.control.events import REFUSALS_PER_KEY, RefusalLog
    from felactl.launcher.rundir import read_jsonl

    log = RefusalLog(tmp_path / "events.jsonl")
    for i in range(500):
        log(keys.STOP, f"forgery {i}")
    log(keys.done(0), "another key")
    events = read_jsonl(tmp_path / "events.jsonl")
    assert len(events) == REFUSALS_PER_KEY + 2 and "not recorded" in events[-2]["reason"]
    assert events[-1]["key"] == keys.done(0)


def test_reading_a_missing_or_deleted_key_never_waits_for_it():
    """A ``check`` then ``get`` of a key deleted in between waited for the store's timeout."""
    import time

    store, port = serve_store("127.0.0.1")
    try:
        reader = Reader(Seal(SECRET, JOB), store, "p/")
        started = time.monotonic()
        assert reader.raw(keys.GENERATION) is None
        store.set("p/" + keys.GENERATION, "7")
        assert reader.raw(keys.GENERATION) == b"7"
        store.delete_key("p/" + keys.GENERATION)
        assert reader.raw(keys.GENERATION) is None and not store.check(["p/" + keys.GENERATION])
        assert time.monotonic() - started < 1
    finally:
        del store


def test_status_history_names_the_tampered_key():
    from rich.console import Console

    from felactl.cli.status import history_table
    from felactl.launcher.status import HISTORY_KINDS

    assert {"refused", "repaired"} <= set(HISTORY_KINDS)
    console = Console(width=250, record=True)
    console.print(
        history_table(
            [
                {"time": 0, "kind": "refused", "key": keys.STOP, "reason": "not a signed document"},
                {"time": 1, "kind": "repaired", "key": keys.GENERATION, "reason": "deleted; written back"},
            ]
        )
    )
    text = console.export_text()
    assert "stop: not a signed document" in text and "elastic/generation: deleted; written back" in text


class _QueueStore(_Store):
    def __init__(self):
        super().__init__()
        self.pushed = []

    def queue_push(self, name, value):
        self.pushed.append(name)


def test_felactl_scale_takes_only_the_coordinators_signed_answer():
    """A forged success is never reported (it is recorded, and the request is sent again); an
    unsigned answer is taken only when it says no; the signed answer to this request is the result."""
    from felactl.control.documents import ScaleReplyDoc
    from felactl.errors import ControlPlaneError
    from felactl.launcher.scale import _exchange

    store, refused = _QueueStore(), []
    reader = Reader(Seal(SECRET, JOB), store, "p/", on_refused=lambda key, why: refused.append(key))
    name = keys.scale_reply("abc")
    store.set("p/" + name, json.dumps({"ok": True, "result": {"members_after": [0, 1, 666]}}))
    with pytest.raises(ControlPlaneError, match="timed out"):
        _exchange(store, reader, "request", "abc", timeout_s=0.3)
    assert refused == [name] and store.pushed == ["p/" + keys.SCALE_REQUESTS]
    other = Seal(SECRET, JOB).seal(
        keys.scale_reply("zzz"), "scale-reply", ScaleReplyDoc(id="zzz", ok=True, result={"kind": "x"}).to_body()
    )
    store.set("p/" + name, other)  # a genuine answer to another request, moved here
    with pytest.raises(ControlPlaneError):
        _exchange(store, reader, "request", "abc", timeout_s=0.2)
    store.set("p/" + name, json.dumps({"ok": False, "error": "not signed with this job's secret"}))
    assert not _exchange(store, reader, "request", "abc", timeout_s=0.2).ok
    reader.write(name, "scale-reply", ScaleReplyDoc(id="abc", ok=True, result={"kind": "unchanged"}).to_body())
    assert _exchange(store, reader, "request", "abc", timeout_s=1).result == {"kind": "unchanged"}


def test_the_arrival_barrier_counts_signed_arrivals_only_and_names_the_missing_one():
    """Members used to count themselves on a counter anyone could move (``add``): a forged
    arrival now counts for nothing, and the wait ends with a line naming the missing member's key."""
    import threading
    import time
    from types import SimpleNamespace

    from felactl.agents.worker.elastic import ElasticMembership
    from felactl.errors import WorkerFailed

    store = _Store()
    member = SimpleNamespace(
        reader=Reader(Seal(SECRET, JOB), store, "p/"),
        wid=0,
        cfg=SimpleNamespace(timeout_s=0.5),
        probe=SimpleNamespace(address="127.0.0.1:1"),
        heartbeat=SimpleNamespace(generation=4),
    )
    store.set("p/" + keys.arrived(4, 1), json.dumps({"worker_id": 1}))  # forged: member 1 is not here
    with pytest.raises(WorkerFailed, match=r"only 1 of 2 members of generation 4 .*elastic/arrived/4/1"):
        ElasticMembership._arrive(member, 4, 0, 2)
    other = Reader(Seal(SECRET, JOB), store, "p/")
    threading.Timer(0.2, lambda: other.write(keys.arrived(4, 1), "arrived", {"worker_id": 1}, generation=4)).start()
    member.cfg.timeout_s = 5
    started = time.monotonic()
    ElasticMembership._arrive(member, 4, 0, 2)
    assert 0.15 < time.monotonic() - started < 2


def test_the_arrival_gives_up_once_a_newer_generation_is_published():
    """A member that never comes (a node that could not start) is dropped by the coordinator,
    which publishes a generation without it: the others stop waiting for it (they waited out the
    store timeout, and the job failed after 85 s with "did not switch")."""
    from types import SimpleNamespace

    from felactl.agents.worker.elastic import ElasticMembership, Superseded

    member = SimpleNamespace(
        reader=Reader(Seal(SECRET, JOB), _Store(), "p/"),
        wid=0,
        cfg=SimpleNamespace(timeout_s=30),
        probe=SimpleNamespace(address="127.0.0.1:1"),
        heartbeat=SimpleNamespace(generation=1),  # the heartbeat thread saw generation 1's document
    )
    with pytest.raises(Superseded) as raised:
        ElasticMembership._arrive(member, 0, 0, 2)
    assert raised.value.generation == 1


def test_an_agreement_someone_keeps_spoiling_fails_with_one_line_naming_the_key():
    from felactl.errors import ControlPlaneError

    class Spoiled(_Store):
        def compare_set(self, name, expected, desired):
            self.values[name] = f"forgery {len(self.values.get(name, b''))}".encode()  # always a new one
            return self.values[name]

    reader = Reader(Seal(SECRET, JOB), Spoiled(), "")
    with pytest.raises(ControlPlaneError, match="drain/last_step: kept being overwritten"):
        reader.agree(keys.LAST_STEP, "last-step", {"step": 3})


def test_forged_scale_requests_to_a_job_that_cannot_scale_do_not_fill_the_events_file(tmp_path):
    """A job that answers every ``felactl scale`` with a refusal (not elastic, or ending) records
    a forged request as any forgery: at most REFUSALS_PER_KEY of them."""
    from felactl.control.events import REFUSALS_PER_KEY
    from felactl.launcher.controlplane import Coordinator
    from felactl.launcher.rundir import read_jsonl
    from felactl.launcher.scale_requests import refuse_requests

    run = RunDir.create("r", tmp_path)
    coordinator = Coordinator(new_secret(), job="r", events=run.events)
    try:
        for i in range(200):
            coordinator.store.queue_push(coordinator.prefix + keys.SCALE_REQUESTS, f"forgery {i}")
        refuse_requests(coordinator, run, "the job is not elastic")
    finally:
        coordinator.close()
    refused = [e for e in read_jsonl(run.events) if e["kind"] == "refused"]
    assert len(refused) == REFUSALS_PER_KEY + 1 and refused[0]["key"] == keys.SCALE_REQUESTS


@pytest.mark.multiprocess
def test_a_worker_that_times_out_is_asked_where_it_was(tmp_path):
    """A hang seen once in CI (an sdpipe pipeline test) left an empty worker log: now the error
    carries the stuck worker's stacks, which workers dump on SIGUSR1."""
    import subprocess
    import sys
    import time

    from felactl.agents.worker import local
    from felactl.errors import WorkerFailed

    stuck = (
        "import faulthandler, signal, sys, time\n"
        "faulthandler.register(signal.SIGUSR1)\n"
        "def waiting_for_a_peer():\n"
        "    time.sleep(60)\n"
        "print('ready', flush=True)\n"
        "waiting_for_a_peer()\n"
    )
    log = open(tmp_path / "worker0.log", "w+b")
    proc = subprocess.Popen([sys.executable, "-c", stuck], stdout=log, stderr=subprocess.STDOUT)
    try:
        while b"ready" not in (tmp_path / "worker0.log").read_bytes():
            time.sleep(0.05)
        with pytest.raises(WorkerFailed, match="worker 0 timed out; where it was: .*waiting_for_a_peer"):
            local._wait_all([proc], [log], deadline=0.0)
    finally:
        proc.kill()
        proc.wait()
        log.close()


def test_a_refusal_without_a_key_is_said_without_a_stray_space(caplog):
    """A refused ``felactl scale`` request names no store key: its console line read
    ``control plane: refused : ...`` (a user's trial)."""
    from felactl.control import EventKind
    from felactl.control.events import record

    with caplog.at_level("WARNING", logger="felactl.control.events"):
        record(None, EventKind.REFUSED, reason="cannot add 100")
        record(None, EventKind.REFUSED, key="stop", reason="forged")
    assert [r.getMessage() for r in caplog.records] == [
        "control plane: refused: cannot add 100",
        "control plane: refused stop: forged",
    ]


def test_status_prints_a_reason_with_brackets_as_it_is():
    """gloo's errors name their C++ source in brackets: a restart's reason printed as rich markup
    failed `felactl status` with "MarkupError: closing tag '[/__w/pytorch/...]'" (a user's trial).
    Every console of felactl prints text as it is."""
    import io

    from rich.console import Console

    from felactl.cli import output
    from felactl.cli.status import history_table

    reason = "Connection closed by peer [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537]"
    table = history_table([{"time": 0, "kind": "restart", "reason": reason}])
    with output.stderr.capture() as captured:
        output.stderr.print(table)
        output.stderr.print(f"[bold]{reason}[/bold]")
    assert "pair.cc:537]" in captured.get() and "[bold]" in captured.get()
    piped = io.StringIO()
    output.wide(Console(file=piped)).print(table)  # a log, not a terminal
    assert "pair.cc:537]" in piped.getvalue()

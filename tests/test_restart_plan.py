"""What a job that cannot rescale live restarts on (pure, no processes): the devices a scale
command leaves, the plan for them without profiles, and which failures are the job's own."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from felactl.errors import InputError
from felactl.launcher.follow import raised_lines
from felactl.launcher.restart_plan import devices_after, plan_for_devices
from felactl.spec import Placement

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import pipeline_plan  # noqa: E402

PIPELINE = pipeline_plan([0, 2, 3])  # cpu0: layers 0-1, cpu1: layer 2
ONE_NODE = {d: "vm" for d in PIPELINE.devices}


def test_adding_two_workers_to_a_pipeline_makes_a_second_pipeline_with_the_same_cuts():
    devices, nodes = devices_after({"op": "add", "count": 2}, PIPELINE, ONE_NODE, {"vm": 4}, None)
    assert devices == ["cpu0", "cpu1", "cpu2", "cpu3"]
    plan, how = plan_for_devices(PIPELINE, devices, nodes, None)
    assert how == "same shape" and plan.pipelines == (("cpu0", "cpu1"), ("cpu2", "cpu3"))
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 2), (2, 3)]
    assert [[w.device for w in s.workers] for s in plan.stages] == [["cpu0", "cpu2"], ["cpu1", "cpu3"]]
    assert all(w.share == 0.5 for s in plan.stages for w in s.workers)


def test_newcomers_are_named_after_their_nodes_devices_and_take_ranks_after_them():
    """A plan whose devices carry their node's name (a profile of this machine: ``vm-cpu0``) gets
    newcomers named the same way (a user's trial saw ``cpu0`` join ``vm-cpu0``); a node's devices
    keep consecutive ranks."""
    names = ("a-cpu0", "a-cpu1", "b-cpu0", "b-cpu1")
    plan = dataclasses.replace(
        pipeline_plan([0, 2, 3], num_replicas=2),
        devices=names,
        stages=tuple(
            dataclasses.replace(
                s, workers=tuple(dataclasses.replace(w, device=names[int(w.device[3:])]) for w in s.workers)
            )
            for s in pipeline_plan([0, 2, 3], num_replicas=2).stages
        ),
        pipelines=((names[0], names[1]), (names[2], names[3])),
        placement=tuple(Placement(device=d, node=d[0], local_index=int(d[-1])) for d in names),
    )
    nodes = {d: d[0] for d in names}
    devices, where = devices_after({"op": "add", "count": 2, "node": "a"}, plan, nodes, {"a": 4, "b": 2}, None)
    assert devices == ["a-cpu0", "a-cpu1", "a-cpu2", "a-cpu3", "b-cpu0", "b-cpu1"]
    assert where["a-cpu3"] == "a"


@pytest.mark.parametrize(
    "command, why",
    [
        ({"op": "add", "count": 3}, "node 'vm' has 4 worker slot(s) and 2 in use: cannot add 3"),
        ({"op": "add", "count": 0}, "--add 0: add at least one worker"),
        ({"op": "remove", "ranks": [7]}, "--remove 7: no such worker in the job (workers: 0..1)"),
        ({"op": "remove", "ranks": [0, 1]}, "cannot remove every worker"),
        ({"op": "to", "count": 0}, "--to 0: a job needs at least one worker"),
        ({"op": "add", "count": 1, "node": "elsewhere"}, "--node 'elsewhere': no agent of this job runs there"),
    ],
)
def test_a_scale_command_that_cannot_be_met_is_refused_saying_why(command, why):
    with pytest.raises(InputError, match=why.replace("(", r"\(").replace(")", r"\)")):
        devices_after(command, PIPELINE, ONE_NODE, {"vm": 4}, None)


def _sharded(devices: tuple[str, ...]):
    base = pipeline_plan([0, 3])
    worker = base.stages[0].workers[0]
    stage = dataclasses.replace(
        base.stages[0],
        shard=True,
        workers=tuple(dataclasses.replace(worker, device=d, share=1 / len(devices)) for d in devices),
    )
    return dataclasses.replace(base, devices=devices, stages=(stage,), pipelines=tuple((d,) for d in devices))


def test_a_sharded_stage_grown_shards_over_every_worker_with_equal_shares():
    devices, nodes = devices_after(
        {"op": "to", "count": 4}, _sharded(("cpu0", "cpu1")), {"cpu0": "vm", "cpu1": "vm"}, {"vm": 4}, None
    )
    plan, how = plan_for_devices(_sharded(("cpu0", "cpu1")), devices, nodes, None)
    (stage,) = plan.stages
    assert how == "same shape" and stage.shard and [w.device for w in stage.workers] == ["cpu0", "cpu1", "cpu2", "cpu3"]
    assert {w.share for w in stage.workers} == {0.25} and plan.pipelines == tuple((d,) for d in devices)


def test_without_profiles_a_pipeline_needs_a_multiple_of_its_stages_and_a_sharded_stage_two_workers():
    with pytest.raises(InputError, match="restarts on a multiple of 2 workers"):
        plan_for_devices(PIPELINE, ["cpu0", "cpu1", "cpu2"], {d: "vm" for d in ("cpu0", "cpu1", "cpu2")}, None)
    sharded = _sharded(("cpu0", "cpu1"))
    with pytest.raises(InputError, match="a sharded stage runs on 2 workers or more"):
        plan_for_devices(sharded, ["cpu0"], {"cpu0": "vm"}, None)


def test_a_failure_is_the_jobs_own_only_where_no_worker_was_killed():
    """A worker killed by a signal makes its peers fail on the lost connection, the same line each
    time: that repeats with every kill and is not the job's own failure."""
    raised = {"a": {"failures": {"0": "ValueError: bad label"}, "exit_codes": {"0": 1, "1": -15}}}
    assert raised_lines(raised) == {"ValueError: bad label"}  # rank 1 was stopped by its agent, not failed
    killed = {
        "a": {"failures": {"0": "killed by SIGKILL"}, "exit_codes": {"0": -9}},
        "b": {"failures": {"1": "RuntimeError: Connection closed by peer"}, "exit_codes": {"1": 1}},
    }
    assert raised_lines(killed) == frozenset()


def test_workers_that_fail_alike_are_said_once_with_their_ranks():
    """A hand-written plan every worker refuses the same way was said four times over, one line a
    rank; now once per node and reason, with the ranks."""
    from types import SimpleNamespace

    from felactl.launcher.follow import _failure_line

    state = SimpleNamespace(
        members=[SimpleNamespace(agent_id="a", node_name="vm"), SimpleNamespace(agent_id="b", node_name="other")],
        run=SimpleNamespace(logs="runs/x/logs"),
    )
    failed = {
        "a": {"failures": {"2": "the tied weight ...", "0": "the tied weight ...", "1": "killed by SIGKILL"}},
        "b": {"failures": {"3": "the tied weight ..."}},
    }
    assert _failure_line(failed, state) == (
        "worker failed (node 'other' rank 3: the tied weight ...; node 'vm' ranks 0, 2: the tied weight ...; "
        "node 'vm' rank 1: killed by SIGKILL); logs in runs/x/logs"
    )


def test_a_restarts_pause_is_measured_on_the_records_and_shown_in_the_history():
    """A restart's event is written as it starts the workers again, before its pause is known:
    the pause is the last step recorded before it to the first after, and ``felactl status``'s
    history shows it (a user's trial saw it empty)."""
    from felactl.control.metrics import restarts
    from felactl.launcher.status import _with_restart_pauses

    records = [{"time": t, "step": s} for t, s in ((10.0, 0), (11.0, 1), (12.0, 2), (20.5, 2), (21.0, 3))]
    events = [
        {"time": 13.0, "kind": "restart", "attempt": 1, "from_step": 2, "reason": "killed"},
        {"time": 30.0, "kind": "scale-out", "members_after": [0, 1, 2]},  # a live one: no from_step
    ]
    (change,) = restarts(events, records)
    assert (change["pause_s"], change["redone_steps"], change["from_step"]) == (8.5, 1, 2)
    history = _with_restart_pauses(events, None, events, records)
    assert history[0]["pause_s"] == 8.5 and "pause_s" not in history[1]
    summary = {"restarts": [{**change, "pause_s": 7.0}]}  # a finished run's summary says it
    assert _with_restart_pauses(events, summary, events, [])[0]["pause_s"] == 7.0


def test_a_worker_killed_by_a_signal_is_said_before_its_peers_lost_connections():
    """A user's trial: "rank 0: RuntimeError: [...pair.cc:537] Read error ... GLHF!; rank 1: killed
    by SIGKILL": the consequence read first, as the cause."""
    from types import SimpleNamespace

    from felactl.launcher.follow import _failure_line

    state = SimpleNamespace(members=[SimpleNamespace(agent_id="a", node_name="vm")], run=SimpleNamespace(logs="L"))
    failed = {
        "a": {
            "failures": {"0": "RuntimeError: Read error: Connection reset by peer", "1": "killed by SIGKILL"},
            "exit_codes": {"0": 1, "1": -9},
        }
    }
    assert _failure_line(failed, state) == (
        "worker failed (node 'vm' rank 1: killed by SIGKILL; node 'vm' rank 0: RuntimeError: Read error: "
        "Connection reset by peer); logs in L"
    )

"""The coordinator's membership decision alone: a table of states and sightings, and the actions
each calls for (no store, no process, no clock; torch elastic tests its agent with fake workers
the same way). The controller that looks and does is covered by test_scale.py and test_attacks.py."""

from __future__ import annotations

import dataclasses

import pytest

from felactl.launcher.membership.decide import decide
from felactl.launcher.membership.signs_of_life import reachable_group
from felactl.launcher.membership.state import (
    FAILED_FIRST,
    FINISHED_FIRST,
    AdmitAgent,
    Agent,
    Answer,
    AnswerAgain,
    Drop,
    Exit,
    Fail,
    Finish,
    IgnoreAgent,
    Join,
    Refuse,
    Request,
    Rules,
    Seen,
    Starting,
    StartNewcomers,
    State,
    StopNewcomers,
    Stuck,
    Switch,
    SwitchAbandoned,
    SwitchDone,
    Switching,
    Worker,
)
from felactl.launcher.scale_plan import ScalingPolicy

RULES = Rules(
    heartbeat_timeout_s=5.0,
    ready_timeout_s=60.0,
    switch_timeout_s=60.0,
    agent_gone_s=1.25,
    logs="runs/r/logs",
    run_id="r",
)
ADD_ONE = Request("r1", {"op": "add", "count": 1})
NOW = 10.0
"""The time of every sighting in the table; every worker and agent last beat at 9.0 unless a row says otherwise."""


def job(members=(0, 1), *, newcomers=(), slots=4, other_nodes=(), rules=RULES, **fields) -> State:
    """A job on node ``n`` (agent ``a``; ``other_nodes`` have agents of their own), with
    ``members`` and ``newcomers`` alive (each beat at 9.0)."""
    agents = {node: Agent(f"agent-{node}", slots, beat="1", since=9.0) for node in ("n", *other_nodes)}
    workers = {w: Worker("n", f"cpu{w}", "agent-n", beat="1", since=9.0) for w in (*members, *newcomers)}
    return State(
        rules=rules,
        generation=fields.pop("generation", 0),
        members=tuple(members),
        workers=workers,
        agents=agents,
        next_id=max(workers) + 1,
        **fields,
    )


def adding(newcomers=(2,), members=(0, 1), *, deadline=60.0, ready=(), **fields) -> State:
    """``members`` with newcomers starting for request r1 (--add)."""
    starting = Starting(
        request=ADD_ONE, policy=None, node="n", newcomers=tuple(newcomers), deadline=deadline, ready=frozenset(ready)
    )
    return job(members, newcomers=newcomers, starting=starting, **fields)


def switching_to(
    members, before, *, kind="scale-out", request_id="r1", reported=(), deadline=60.0, if_finished=None, **fields
) -> State:
    """Generation 1 of ``members`` published (the members were ``before``), waiting for reports."""
    switching = Switching(
        generation=1,
        kind=kind,
        members=tuple(members),
        before=tuple(before),
        deadline=deadline,
        if_finished=tuple(before if if_finished is None else if_finished),
        request_id=request_id,
        reported=frozenset(reported),
    )
    everyone = sorted(set(members) | set(before))
    state = job(everyone, generation=1, switching=switching, **fields)
    return dataclasses.replace(state, members=tuple(members))


def seen(**fields) -> Seen:
    return Seen(now=NOW, **fields)


def request(command, request_id="r1") -> Seen:
    return seen(requests=(Request(request_id, command),))


EXITED_1 = "worker 1 exited with code 1: boom"
PARTITIONED_0 = (
    "worker 0: cut off from worker(s) 1, 2 by a network partition (the largest group that reaches itself goes on: 1, 2)"
)
PARTITIONED_2, PARTITIONED_3 = (
    f"worker {w}: cut off from worker(s) 0, 1 by a network partition (the largest group that reaches itself goes on: 0, 1)"
    for w in (2, 3)
)
NO_WORKER_LEFT = (
    "worker failed: no worker is left (worker 0 exited with code 1; worker 1 exited with code 1); "
    "logs in runs/r/logs; a run with checkpoints continues with `felactl launch --resume r`"
)
SLIP = "RuntimeError: The size of tensor a (2) must match the size of tensor b (16) at non-singleton dimension 1"
CLOSED = "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:41234"
SLIP_AGAIN = (
    f"worker 0: step 3 failed again after the job re-formed, the same way: {SLIP} (a failure that repeats on "
    "the same step is the job's own code or data, not a worker's)"
)
SLOTS_FULL = (
    "node 'n' has 2 worker slot(s) and 2 in use: cannot add 1 (a CPU node offers one slot per core; launch "
    "with --max-nproc-per-node to allow more)"
)

# (state, what was seen, the actions expected, the members after)
TABLE = [
    # --- joins and leaves ---
    pytest.param(
        job(),
        request({"op": "add", "count": 1}),
        [StartNewcomers("n", "agent-n", {2: "cpu2"}, (0, 1, 2), None)],
        (0, 1),
        id="add: newcomers start",
    ),
    pytest.param(
        job(rules=dataclasses.replace(RULES, device_prefix="cuda")),
        request({"op": "add", "count": 1}),
        [StartNewcomers("n", "agent-n", {2: "cuda2"}, (0, 1, 2), None)],
        (0, 1),
        id="add to a GPU job without a profile: the newcomer is named as a GPU",
    ),
    pytest.param(
        job(other_nodes=("m",)),
        request({"op": "add", "count": 2, "node": "m", "scaling_policy": "linear-lr"}),
        [StartNewcomers("m", "agent-m", {2: "cpu2", 3: "cpu3"}, (0, 1, 2, 3), ScalingPolicy("linear-lr"))],
        (0, 1),
        id="add on another node with a policy",
    ),
    pytest.param(adding(), seen(), [], (0, 1), id="add: newcomer not ready yet: wait"),
    pytest.param(
        adding(),
        seen(ready=frozenset({2})),
        [Switch(1, (0, 1, 2), (0, 1), "scale-out")],
        (0, 1, 2),
        id="add: newcomer ready: switch",
    ),
    pytest.param(
        switching_to((0, 1, 2), (0, 1), reported=(0,)),
        seen(switched=frozenset({1, 2})),
        [SwitchDone(1, "r1")],
        (0, 1, 2),
        id="add: every member switched: done, answered",
    ),
    pytest.param(
        job(), request({"op": "remove", "ranks": [1]}), [Switch(1, (0,), (0, 1), "scale-in")], (0,), id="remove"
    ),
    pytest.param(
        job(),
        request({"op": "to", "count": 3}),
        [StartNewcomers("n", "agent-n", {2: "cpu2"}, (0, 1, 2), None)],
        (0, 1),
        id="to: up",
    ),
    pytest.param(
        job((0, 1, 2)),
        request({"op": "to", "count": 1}),
        [Switch(1, (0,), (0, 1, 2), "scale-in")],
        (0,),
        id="to: down removes the highest ids",
    ),
    pytest.param(
        job(),
        request({"op": "to", "count": 2}),
        [Answer("r1", {"kind": "unchanged", "members": [0, 1], "generation": 0})],
        (0, 1),
        id="to: as many as there are",
    ),
    pytest.param(
        job(),
        seen(joins=(Join("m", "agent-m", 8),)),
        [AdmitAgent("m", "agent-m", None)],
        (0, 1),
        id="an agent joins for a new node",
    ),
    pytest.param(
        job(),
        seen(joins=(Join("n", "agent-x", 8),)),
        [IgnoreAgent("n", "agent-x")],
        (0, 1),
        id="an agent joins for a node whose agent answers: ignored",
    ),
    pytest.param(
        job(),
        Seen(now=20.0, joins=(Join("n", "agent-x", 8),), heartbeats={0: "2", 1: "2"}),
        [AdmitAgent("n", "agent-x", "agent-n")],
        (0, 1),
        id="an agent replaces a silent one",
    ),
    # --- failures ---
    pytest.param(
        job(),
        seen(exits={1: Exit(1, "boom")}),
        [Drop({1: EXITED_1}), Switch(1, (0,), (0, 1), "failure", EXITED_1)],
        (0,),
        id="a worker exits: dropped, the survivors switch",
    ),
    pytest.param(
        job(),
        Seen(now=15.0, heartbeats={0: "2"}, agent_beats={"agent-n": "2"}),
        [
            Drop({1: "worker 1: no heartbeat for 6.0 s"}),
            Switch(1, (0,), (0, 1), "failure", "worker 1: no heartbeat for 6.0 s"),
        ],
        (0,),
        id="a worker goes silent: dropped",
    ),
    pytest.param(
        job(other_nodes=("m",)),
        Seen(now=15.0, heartbeats={0: "2"}, agent_beats={"agent-m": "2"}),
        [
            Drop({1: "worker 1: no heartbeat for 6.0 s (the agent of node 'n' is gone too)"}),
            Switch(1, (0,), (0, 1), "failure", "worker 1: no heartbeat for 6.0 s (the agent of node 'n' is gone too)"),
        ],
        (0,),
        id="a worker goes silent with its agent: dropped, the agent named",
    ),
    pytest.param(
        job(),
        seen(exits={1: Exit(0)}, done=frozenset({1})),
        [],
        (0, 1),
        id="a worker that finished and exited is not dropped",
    ),
    pytest.param(
        job(stuck_since=4.0),
        seen(stuck={0: Stuck(frozenset())}),
        [Switch(1, (0, 1), (0, 1), "re-form", "a collective failed with every member alive")],
        (0, 1),
        id="a collective failed with everyone alive: re-form",
    ),
    pytest.param(
        job(stuck_since=6.0), seen(stuck={0: Stuck(frozenset())}), [], (0, 1), id="a collective failed just now: wait"
    ),
    pytest.param(
        job(stuck_since=9.5),
        seen(stuck={0: Stuck(frozenset()), 1: Stuck(frozenset())}),
        [Switch(1, (0, 1), (0, 1), "re-form", "a collective failed with every member alive")],
        (0, 1),
        id="every member reported its failed step: none is dead, re-form at once",
    ),
    pytest.param(
        job((0, 1, 2), stuck_since=9.5),
        seen(stuck={0: Stuck(frozenset({1, 2})), 1: Stuck(frozenset({0})), 2: Stuck(frozenset({0}))}),
        [Drop({0: PARTITIONED_0}), Switch(1, (1, 2), (0, 1, 2), "failure", PARTITIONED_0)],
        (1, 2),
        id="a partition, everyone alive: the larger side goes on, the other is dropped",
    ),
    pytest.param(
        job((0, 1, 2), stuck_since=4.0),
        seen(stuck={1: Stuck(frozenset({0})), 2: Stuck(frozenset({0}))}),
        [Drop({0: PARTITIONED_0}), Switch(1, (1, 2), (0, 1, 2), "failure", PARTITIONED_0)],
        (1, 2),
        id="a partition, one side silent past the heartbeat timeout: what the others reported decides",
    ),
    pytest.param(
        job((0, 1, 2, 3), stuck_since=9.5),
        seen(
            stuck={
                0: Stuck(frozenset({2, 3})),
                1: Stuck(frozenset({2, 3})),
                2: Stuck(frozenset({0, 1})),
                3: Stuck(frozenset({0, 1})),
            }
        ),
        [
            Drop({2: PARTITIONED_2, 3: PARTITIONED_3}),
            Switch(1, (0, 1), (0, 1, 2, 3), "failure", f"{PARTITIONED_2}; {PARTITIONED_3}"),
        ],
        (0, 1),
        id="two halves as large: the one of the lowest worker ids goes on",
    ),
    pytest.param(
        job(generation=1, reformed_after=frozenset({(3, SLIP), (3, CLOSED)})),
        seen(stuck={0: Stuck(frozenset(), 3, SLIP)}),
        [Fail(SLIP_AGAIN, worker=0)],
        (0, 1),
        id="the step a re-form was made after fails again the same way: the job fails at once",
    ),
    pytest.param(
        job(generation=1, reformed_after=frozenset({(3, SLIP)}), stuck_since=4.0),
        seen(stuck={0: Stuck(frozenset(), 4, SLIP)}),
        [Switch(2, (0, 1), (0, 1), "re-form", "a collective failed with every member alive")],
        (0, 1),
        id="the same failure on a later step: a worker's, re-form again",
    ),
    pytest.param(
        job(generation=1, reformed_after=frozenset({(3, SLIP)}), stuck_since=4.0),
        seen(stuck={0: Stuck(frozenset(), 3, CLOSED)}),
        [Switch(2, (0, 1), (0, 1), "re-form", "a collective failed with every member alive")],
        (0, 1),
        id="another failure on the same step: a worker's, re-form again",
    ),
    pytest.param(
        job(),
        seen(exits={0: Exit(1), 1: Exit(1)}),
        [Drop({0: "worker 0 exited with code 1", 1: "worker 1 exited with code 1"}), Fail(NO_WORKER_LEFT)],
        (0, 1),
        id="no member left: the job fails",
    ),
    # --- failures during a change ---
    pytest.param(
        switching_to((0, 1, 2), (0, 1), reported=(0,)),
        seen(exits={1: Exit(1, "boom")}),
        [Drop({1: EXITED_1}), SwitchDone(1, "r1"), Switch(2, (0, 2), (0, 1, 2), "failure", EXITED_1)],
        (0, 2),
        id="a stayer dies while a switch is pending: it ends as it stands, the rest switch again",
    ),
    pytest.param(
        switching_to((0, 1, 2), (0, 1), reported=(0, 1)),
        seen(exits={1: Exit(1)}),
        [],
        (0, 1, 2),
        id="a member that switched is not judged until the switch is done",
    ),
    pytest.param(
        switching_to((0, 1, 2), (0, 1), reported=(0,)),
        Seen(now=61.0, heartbeats={1: "2", 2: "2"}),
        [Refuse("r1", FAILED_FIRST), Fail("generation 1: workers [1, 2] did not switch within 60 s; see runs/r/logs")],
        (0, 1, 2),
        id="a switch that never completes fails the job",
    ),
    pytest.param(
        switching_to((0, 1, 2), (0, 1)),
        seen(done=frozenset({0, 1})),
        [
            SwitchAbandoned(1),
            StopNewcomers((2,)),
            Refuse("r1", "the job finished its last step before generation 1 could start; nothing changed"),
            Finish(),
        ],
        (0, 1),
        id="the stayers finish before switching: the scale-out is abandoned",
    ),
    pytest.param(
        switching_to((0,), (0, 1), kind="failure", request_id=None, if_finished=(0,)),
        seen(done=frozenset({0})),
        [SwitchAbandoned(1), Finish()],
        (0,),
        id="the survivors finish before a failure's switch: they are the members, the job is done",
    ),
    pytest.param(
        adding(),
        seen(exits={1: Exit(1, "boom")}),
        [Drop({1: EXITED_1}), Switch(1, (0,), (0, 1), "failure", EXITED_1)],
        (0,),
        id="a member dies while a newcomer starts: the failure switches first",
    ),
    pytest.param(
        dataclasses.replace(
            adding(ready=(2,)),
            generation=1,
            members=(0,),
            switching=Switching(
                generation=1, kind="failure", members=(0,), before=(0, 1), deadline=60.0, if_finished=(0,)
            ),
        ),
        seen(switched=frozenset({0})),
        [SwitchDone(1, None), Switch(2, (0, 2), (0,), "scale-out")],
        (0, 2),
        id="a ready newcomer joins the survivors once the failure's switch is done",
    ),
    pytest.param(
        adding(),
        seen(exits={2: Exit(1)}),
        [
            StopNewcomers((2,)),
            Refuse(
                "r1", "the new worker(s) did not start (worker 2 exited with code 1); see runs/r/logs", ADD_ONE.command
            ),
        ],
        (0, 1),
        id="a newcomer lost: stopped, the request refused",
    ),
    pytest.param(
        dataclasses.replace(
            adding(),
            generation=1,
            members=(0,),
            switching=Switching(
                generation=1, kind="failure", members=(0,), before=(0, 1), deadline=60.0, if_finished=(0,)
            ),
        ),
        seen(exits={2: Exit(1)}),
        [
            StopNewcomers((2,)),
            Refuse(
                "r1", "the new worker(s) did not start (worker 2 exited with code 1); see runs/r/logs", ADD_ONE.command
            ),
        ],
        (0,),
        id="a newcomer lost while the others switch after a failure",
    ),
    pytest.param(
        adding(deadline=50.0),
        Seen(now=51.0, heartbeats={0: "2"}, agent_beats={"agent-n": "2"}),
        [
            Drop({1: "worker 1: no heartbeat for 42.0 s"}),
            Switch(1, (0,), (0, 1), "failure", "worker 1: no heartbeat for 42.0 s"),
            StopNewcomers((2,)),
            Refuse(
                "r1",
                "the new worker(s) did not start (not ready within 60 s, the launch's --join-timeout); see runs/r/logs",
                ADD_ONE.command,
            ),
        ],
        (0,),
        id="a newcomer never ready while a member goes silent",
    ),
    pytest.param(
        adding(),
        seen(done=frozenset({0, 1})),
        [
            StopNewcomers((2,)),
            Refuse(
                "r1",
                "the job finished its last step while the new worker(s) were starting; nothing changed",
                ADD_ONE.command,
            ),
            Finish(),
        ],
        (0, 1),
        id="the job finishes while a newcomer starts",
    ),
    pytest.param(
        adding(),
        seen(planning_failed="the planner found nothing"),
        [StopNewcomers((2,)), Refuse("r1", "the planner found nothing", ADD_ONE.command)],
        (0, 1),
        id="a scale-out the planner refuses: the newcomers stop",
    ),
    pytest.param(
        switching_to((0,), (0, 1), kind="scale-in"),
        seen(planning_failed="no plan"),
        [Refuse("r1", "no plan")],
        (0, 1),
        id="a scale-in the planner refuses: nothing changes",
    ),
    # --- requests refused, deferred, repeated ---
    pytest.param(
        job(),
        request({"op": "remove", "ranks": [0, 1]}),
        [
            Refuse(
                "r1",
                "cannot remove every worker: at least one must stay (stop the job instead)",
                {"op": "remove", "ranks": [0, 1]},
            )
        ],
        (0, 1),
        id="refused: removing every worker",
    ),
    pytest.param(
        job(),
        request({"op": "remove", "ranks": [7]}),
        [Refuse("r1", "--remove 7: no such worker in the job (workers: 0, 1)", {"op": "remove", "ranks": [7]})],
        (0, 1),
        id="refused: removing an unknown worker",
    ),
    pytest.param(
        job(),
        request({"op": "add", "count": 1, "node": "x"}),
        [
            Refuse(
                "r1", "--node 'x': no agent of this job runs there (nodes: n)", {"op": "add", "count": 1, "node": "x"}
            )
        ],
        (0, 1),
        id="refused: adding on an unknown node",
    ),
    pytest.param(
        job(slots=2),
        request({"op": "add", "count": 1}),
        [Refuse("r1", SLOTS_FULL, {"op": "add", "count": 1})],
        (0, 1),
        id="refused: no free slot",
    ),
    pytest.param(
        job(slots=2, rules=dataclasses.replace(RULES, device_prefix="cuda")),
        request({"op": "add", "count": 1}),
        [
            Refuse(
                "r1",
                "node 'n' has 2 worker slot(s) and 2 in use: cannot add 1 (one worker per GPU, as NCCL runs "
                "one rank per GPU: add on another node with --node)",
                {"op": "add", "count": 1},
            )
        ],
        (0, 1),
        id="refused: every GPU of the node in use",
    ),
    pytest.param(
        job(rules=dataclasses.replace(RULES, profile={"n": ("cpu0", "cpu1", "gpu0")})),
        request({"op": "add", "count": 1}),
        [StartNewcomers("n", "agent-n", {2: "gpu0"}, (0, 1, 2), None)],
        (0, 1),
        id="with a profile, a newcomer gets a free profiled device",
    ),
    pytest.param(
        job(rules=dataclasses.replace(RULES, profile={"n": ("cpu0", "cpu1", "gpu0")}), other_nodes=("m",)),
        request({"op": "add", "count": 1, "node": "m"}),
        [
            Refuse(
                "r1",
                "node 'm' is not in the run's cluster profile: the planner cannot place workers there",
                {"op": "add", "count": 1, "node": "m"},
            )
        ],
        (0, 1),
        id="refused: a node not profiled",
    ),
    pytest.param(
        job(),
        Seen(now=20.0, heartbeats={0: "2", 1: "2"}, requests=(ADD_ONE,)),
        [
            Refuse(
                "r1",
                "--node 'n': its agent has not answered for 11.0 s (killed or unreachable); add "
                "workers on another node or restart `felactl agent` there",
                ADD_ONE.command,
            )
        ],
        (0, 1),
        id="refused: adding where the agent is silent",
    ),
    pytest.param(
        job(),
        request({"op": "add", "count": "x"}),
        [Refuse("r1", "invalid literal for int() with base 10: 'x'", {"op": "add", "count": "x"})],
        (0, 1),
        id="refused: a malformed count",
    ),
    pytest.param(
        job(),
        request({"op": "shuffle"}),
        [Refuse("r1", "unknown scale operation 'shuffle'", {"op": "shuffle"})],
        (0, 1),
        id="refused: an unknown operation",
    ),
    pytest.param(
        job(),
        seen(requests=(Request("r9", None, "scale request: not signed"),)),
        [Refuse("r9", "scale request: not signed", forged=True)],
        (0, 1),
        id="refused unsigned: a forged request",
    ),
    pytest.param(
        job(answered=frozenset({"r9"})),
        seen(requests=(Request("r9", None, "scale request: not signed"),)),
        [Refuse("", "scale request: not signed", forged=True)],
        (0, 1),
        id="a forgery never answers over a genuine answer",
    ),
    pytest.param(
        job(answered=frozenset({"r1"})),
        seen(requests=(ADD_ONE,)),
        [AnswerAgain("r1")],
        (0, 1),
        id="a request sent again: the same answer, nothing redone",
    ),
    pytest.param(adding(), seen(requests=(ADD_ONE,)), [], (0, 1), id="a request sent again while under way: ignored"),
    pytest.param(
        switching_to((0, 1, 2), (0, 1)),
        request({"op": "add", "count": 1}, "r2"),
        [],
        (0, 1, 2),
        id="adding while a switch is in progress waits its turn",
    ),
    pytest.param(
        switching_to((0, 1, 2), (0, 1), deferred=(Request("r2", {"op": "add", "count": 1}),)),
        seen(switched=frozenset({0, 1, 2})),
        [SwitchDone(1, "r1"), StartNewcomers("n", "agent-n", {3: "cpu3"}, (0, 1, 2, 3), None)],
        (0, 1, 2),
        id="a waiting request is served once the switch is done",
    ),
    # --- the end ---
    pytest.param(job(), seen(done=frozenset({0, 1})), [Finish()], (0, 1), id="every member finished"),
    pytest.param(job(), seen(done=frozenset({0})), [], (0, 1), id="one member still trains"),
    pytest.param(
        job(),
        seen(done=frozenset({0, 1}), requests=(ADD_ONE,)),
        [Refuse("r1", FINISHED_FIRST, ADD_ONE.command), Finish()],
        (0, 1),
        id="a request to a finished job is refused",
    ),
    pytest.param(
        adding(deferred=(Request("r2", {"op": "to", "count": 1}),)),
        seen(exits={0: Exit(1), 1: Exit(1)}),
        [
            Drop({0: "worker 0 exited with code 1", 1: "worker 1 exited with code 1"}),
            Refuse("r1", FAILED_FIRST, ADD_ONE.command),
            Refuse("r2", FAILED_FIRST, {"op": "to", "count": 1}),
            Fail(NO_WORKER_LEFT),
        ],
        (0, 1),
        id="a job that fails answers the requests it will not serve",
    ),
]


@pytest.mark.parametrize("state, sighting, actions, members_after", TABLE)
def test_decide(state, sighting, actions, members_after):
    after, decided = decide(state, sighting)
    assert decided == actions
    assert after.members == members_after


def test_a_request_is_answered_once_however_often_it_comes():
    """The first look refuses it and remembers the id; the second only answers again."""
    state, actions = decide(job(slots=2), request(ADD_ONE.command))
    assert actions == [Refuse("r1", SLOTS_FULL, ADD_ONE.command)]
    assert decide(state, request(ADD_ONE.command))[1] == [AnswerAgain("r1")]


def test_a_member_lost_while_a_newcomer_starts_is_planned_out_of_the_scale_out():
    """Worker 1 dies while newcomer 2 starts: the survivors switch to [0], then [0, 2] scale out
    (the sequence test_scale.py drives through a real store)."""
    state, actions = decide(job(), request(ADD_ONE.command))
    assert actions == [StartNewcomers("n", "agent-n", {2: "cpu2"}, (0, 1, 2), None)]
    state, actions = decide(state, seen(exits={1: Exit(1)}))
    assert actions == [
        Drop({1: "worker 1 exited with code 1"}),
        Switch(1, (0,), (0, 1), "failure", "worker 1 exited with code 1"),
    ]
    state, actions = decide(state, seen(ready=frozenset({2})))  # ready, but the failure's switch goes first
    assert actions == []
    state, actions = decide(state, seen(switched=frozenset({0})))
    assert actions == [SwitchDone(1, None), Switch(2, (0, 2), (0,), "scale-out")]
    state, actions = decide(state, seen(switched=frozenset({0, 2})))
    assert actions == [SwitchDone(2, "r1")]
    assert state.members == (0, 2) and not state.busy and state.answered == {"r1"}


@pytest.mark.parametrize(
    "members, unreachable, group",
    [
        ((0, 1, 2), {}, (0, 1, 2)),
        ((0, 1, 2), {0: {1, 2}}, (1, 2)),
        ((0, 1), {1: {0}}, (0,)),
        ((0, 1, 2, 3, 4), {0: {3, 4}, 1: {3, 4}, 2: {3, 4}}, (0, 1, 2)),
        ((0, 1, 2, 3), {0: {1}, 2: {3}}, (0, 2)),
        ((0, 1, 2), {0: {7}, 5: {1}}, (0, 1, 2)),
        ((0, 1, 2), {0: {1, 2}, 1: {0, 2}, 2: {0, 1}}, (0,)),
    ],
    ids=["nobody apart", "one cut off", "two apart", "three and two", "two cuts", "strangers ignored", "all apart"],
)
def test_the_group_that_goes_on_is_the_largest_that_reaches_itself(members, unreachable, group):
    reports = {w: frozenset(lost) for w, lost in unreachable.items()}
    assert reachable_group(members, reports) == group


def test_silence_is_timed_from_the_last_new_heartbeat():
    """A beat that changed restarts the clock; the same beat again does not."""
    state, _ = decide(job(), Seen(now=12.0, heartbeats={0: "2", 1: "1"}, agent_beats={"agent-n": "2"}))
    assert state.workers[0].since == 12.0 and state.workers[1].since == 9.0
    _, actions = decide(state, Seen(now=14.5, heartbeats={0: "2", 1: "1"}, agent_beats={"agent-n": "3"}))
    assert actions == [
        Drop({1: "worker 1: no heartbeat for 5.5 s"}),
        Switch(1, (0,), (0, 1), "failure", "worker 1: no heartbeat for 5.5 s"),
    ]


def test_a_newcomer_without_a_heartbeat_gets_the_start_up_time():
    """Before its first beat a worker is silent for the ready timeout, not the heartbeat timeout."""
    state = job()
    state = dataclasses.replace(state, workers={**state.workers, 1: Worker("n", "cpu1", "agent-n", since=9.0)})
    assert decide(state, Seen(now=30.0, heartbeats={0: "2"}, agent_beats={"agent-n": "2"}))[1] == []


def test_a_failure_that_repeats_on_the_same_step_after_a_re_form_ends_the_job():
    """A loss with a shape slip raises torch's RuntimeError on every try, as a collective whose peer
    died does: the first time the members re-form (it may have been a worker's); when the re-formed
    generation fails on the same step the same way, the job fails, not re-forms again (it re-formed
    forever, 335 times in a user's run)."""
    first = seen(stuck={0: Stuck(frozenset(), 0, SLIP), 1: Stuck(frozenset(), 0, CLOSED)})
    state, actions = decide(job(), first)
    assert actions == [Switch(1, (0, 1), (0, 1), "re-form", "a collective failed with every member alive")]
    state, actions = decide(state, seen(switched=frozenset({0, 1})))
    assert actions == [SwitchDone(1, None)]
    again = seen(stuck={0: Stuck(frozenset(), 0, SLIP)})  # worker 1 has not reported yet: no need to wait
    _, actions = decide(state, again)
    assert actions == [Fail(SLIP_AGAIN.replace("step 3", "step 0"), worker=0)]


def test_a_re_form_after_a_lost_worker_does_not_carry_the_failure_over():
    """Only the generation a re-form made is judged by it: after the next change (a worker dies and
    the survivors switch), a failure on that step is a worker's again."""
    state = job((0, 1, 2), generation=1, reformed_after=frozenset({(0, SLIP)}))
    state, actions = decide(state, seen(exits={2: Exit(-9)}))
    assert [type(a) for a in actions] == [Drop, Switch] and state.reformed_after == frozenset()


IMPORT_FAILED = "worker 1 exited with code 2: felactl worker: model 'job:make': cannot import: No module named 'job'"


def launching(**rules) -> State:
    """A job just launched on nodes ``n`` (worker 0) and ``m`` (worker 1), none started yet."""
    state = job(other_nodes=("m",), launching=True, rules=dataclasses.replace(RULES, **rules))
    workers = {**state.workers, 1: Worker("m", "cpu1", "agent-m", beat="1", since=9.0)}
    return dataclasses.replace(state, workers=workers)


def test_a_node_that_cannot_start_fails_the_job_at_once_naming_it():
    """One node's worker cannot import the job's module: the job fails at once with the node and
    its worker's line (it failed after 85 s with "generation 1: workers [0] did not switch")."""
    _, actions = decide(launching(min_nodes=2), seen(exits={1: Exit(2, IMPORT_FAILED.split(": ", 1)[1])}))
    assert actions == [
        Fail(
            f"node 'm' could not start: {IMPORT_FAILED}; the job needs 2 of its 2 nodes and 1 is left (with "
            "--nnodes 1:2 it goes on without a node that cannot start)",
            worker=1,
            bad_input=True,  # the job's module is not importable there: the user's to fix
        )
    ]


def test_with_fewer_nodes_allowed_the_job_goes_on_without_the_node_that_cannot_start():
    """--nnodes 1:2: the node is left out whole (its other workers too) and the others start without it."""
    state = launching(min_nodes=1)
    state = dataclasses.replace(
        state, members=(0, 1, 2), workers={**state.workers, 2: Worker("m", "cpu2", "agent-m", beat="1", since=9.0)}
    )
    state, actions = decide(state, seen(exits={1: Exit(2, IMPORT_FAILED.split(": ", 1)[1])}))
    left_out = "worker 2: left out with node 'm', which could not start"
    assert actions == [
        Drop({1: IMPORT_FAILED, 2: left_out}),
        Switch(1, (0,), (0, 1, 2), "failure", f"{IMPORT_FAILED}; {left_out}"),
    ]
    assert state.launching  # until worker 0 says it started


def test_a_worker_lost_once_the_job_started_is_a_workers_failure_again():
    """Once a member has started (its heartbeat counts steps), a loss is survived as ever."""
    state, actions = decide(launching(min_nodes=2), seen(started=frozenset({0})))
    assert actions == [] and not state.launching
    _, actions = decide(state, seen(exits={1: Exit(-9)}))
    assert actions == [
        Drop({1: "worker 1 exited with code -9"}),
        Switch(1, (0,), (0, 1), "failure", "worker 1 exited with code -9"),
    ]


def test_on_one_node_a_worker_that_cannot_start_fails_the_job_at_once():
    """The user's optimizer factory raises while the workers start: nothing can go on."""
    state = job(launching=True)
    _, actions = decide(state, seen(exits={0: Exit(1, SLIP)}))
    assert actions == [Fail(f"node 'n' could not start: worker 0 exited with code 1: {SLIP}", worker=0)]


SHORT = "felactl worker: model 'job:make': its dataset has 10 sample(s), fewer than the global batch of 64"


def test_workers_that_all_refuse_their_input_at_start_fail_the_job_as_bad_input_said_once():
    """Issue 30 item 6a: a plan whose global batch its dataset cannot fill is refused by every
    worker (exit 2) before it starts: the launch says so once, as bad input (exit 2), not as
    "worker 0 exited ...: X; worker 1 exited ...: X", exit 1."""
    state = dataclasses.replace(job(launching=True), members=(0, 1))
    state = dataclasses.replace(
        state, workers={**state.workers, 1: Worker("n", "cpu1", "agent-n", beat="1", since=9.0)}
    )
    _, actions = decide(state, seen(exits={0: Exit(2, SHORT), 1: Exit(2, SHORT)}))
    assert actions == [Fail(f"node 'n' could not start: workers 0, 1 exited with code 2: {SHORT}", 0, bad_input=True)]
    _, actions = decide(state, seen(exits={0: Exit(2, SHORT), 1: Exit(1, SLIP)}))
    assert [a.bad_input for a in actions] == [False]  # one of them failed otherwise


def test_a_re_plan_by_measured_speeds_gives_every_member_a_sample():
    """A member measured 25x slower than its peers (it had trained paced samples) got 0.0156 of a
    32-sample batch: no sample at all. A member at its own pace then left the loop as if the data
    were handed out (the job hung at its next switch); a lockstep one would skip the step's
    collectives. Every member now gets at least one sample, the others' shares still by speed."""
    from felactl.launcher.scale_plan import replan
    from felactl.spec.stages import split_by_shares
    from tests.test_scale import gpt_plan

    devices = ["cpu0", "cpu1", "cpu2", "cpu3", "cpu4"]
    speeds = {"cpu0": 100.0, "cpu1": 96.0, "cpu2": 4.0, "cpu3": 4.0, "cpu4": 51.0}
    for batch in (5, 6, 8, 32, 33, 1000):
        plan = replan(gpt_plan(5), devices, speeds, {}, global_batch=batch, lr=1e-3)
        sizes = [len(r) for r in split_by_shares(batch, [w.share for w in plan.stages[0].workers])]
        assert sum(sizes) == batch and min(sizes) >= 1, (batch, sizes)
        if batch == 1000:  # far from the floor: by speed as before
            assert sizes[0] > sizes[4] > sizes[2] >= 1

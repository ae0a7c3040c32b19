"""The coordinator's membership decision, apart from its doing.

:func:`~felactl.launcher.membership.decide.decide` takes what the coordinator knows (:class:`State`: the generation, its members, the
workers' and agents' last signs of life, newcomers being started, a switch in progress, requests
waiting for it) and what it saw since (:class:`Seen`: the clock, heartbeats, exit codes, ``done``
and ``ready`` marks, ``switched`` reports, agents that joined, ``felactl scale`` requests), and
returns the next state and the actions to take: drop workers, switch to a new generation, start
newcomers or give them up, admit an agent, answer or refuse a request, finish, fail.

It reads no store, starts no process, reads no clock (the time is ``Seen.now``) and plans nothing,
so every rule of membership can be tested with a table of made-up states and sightings, as torch
elastic tests its agent with fake workers (``tests/test_membership.py``).

The executor, :class:`felactl.launcher.elastic.ElasticController`, does the rest: each poll it
gathers a :class:`Seen` from the store and the agents' reports, calls ``decide``, and applies the
actions (signed commands to agents, plans, generation documents, events, answers). Only what it
cannot know in advance comes back as a sighting: a change whose plan the planner refused
(``Seen.planning_failed``) is undone by ``decide`` like any other.

The coordinator is never blocked on a change: while newcomers start or a switch waits for its
reports, failures are still noticed, and scale requests wait their turn (``State.deferred``).

Where each part lives:

* :mod:`~felactl.launcher.membership.state`: the vocabulary: :class:`State`, :class:`Seen`, the actions.
* :mod:`~felactl.launcher.membership.decide`: the decision and its rules for signs of life,
  switches, failures, newcomers.
* :mod:`~felactl.launcher.membership.requests`: serving ``felactl scale`` requests.
* :mod:`~felactl.launcher.membership.signs_of_life`: who is dead, which agent is silent, who still
  reaches whom.
* :mod:`~felactl.launcher.membership.transitions`: the moves both of the last two make (begin a
  switch, mark a request answered).
"""

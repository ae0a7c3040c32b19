"""The defaults of ``felactl launch``'s timeouts, stated once: the CLI's options
(:class:`felactl.cli.launch.LaunchCommandOptions`), :class:`~felactl.launcher.prepare.LaunchOptions`,
:class:`~felactl.launcher.script.ScriptOptions` and :class:`~felactl.launcher.elastic.ElasticSettings`
read them. Stdlib only, so ``felactl launch --help`` reads them without importing the launcher
(and torch). The launch's other defaults have their owners: where runs go,
:data:`felactl.launcher.rundir.DEFAULT_RUNS_ROOT`; the scaling policy,
:class:`felactl.launcher.scale_plan.ScalingPolicy`."""

HEARTBEAT_TIMEOUT_S = 5.0
"""Seconds without a heartbeat before an elastic job's worker is dropped (``--heartbeat-timeout``)."""
COLLECTIVE_TIMEOUT_S = 10.0
"""Elastic jobs: seconds before a collective blocked on a dead peer fails (``--collective-timeout``)."""
JOIN_TIMEOUT_S = 60.0
"""Seconds for the nodes' agents to join, and for a newcomer to be ready (``--join-timeout``)."""
PLAN_MAX_RESTARTS = 3
"""A job that cannot rescale live starts again from its newest checkpoint after a failed worker,
this many times at most (``--max-restarts``; a ``--script`` restarts 0 times, as torchrun)."""
SWITCH_TIMEOUT_S = 60.0
"""Elastic jobs: seconds the members get to reach the step they agreed to switch at (no flag)."""

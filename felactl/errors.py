"""The one error family of felactl, and the exit code each member maps to.

The CLI maps these to exit codes in exactly one place (``felactl.cli.main``): 0 ok, 1 the work
failed, 2 bad input. Library code raises the most specific member; it never prints or exits.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class FelactlError(Exception):
    """Base of every error felactl raises on purpose. Its message is one line for the user."""

    exit_code = EXIT_FAILED


EXIT_AFTER_ANOTHER = 75
"""A worker that stopped because another worker of its attempt failed, after leaving its state for
the restart (:mod:`felactl.agents.worker.survivors`): its agent counts it as stopped, not failed,
so that the failure reported is the first one's (only in such a job: a user's script may exit so).
75 is sysexits' EX_TEMPFAIL: the attempt, not this worker, failed."""


class AnotherWorkerFailed(FelactlError):
    """Another worker of this attempt failed: this one stopped waiting for it (exit 75)."""

    exit_code = EXIT_AFTER_ANOTHER


EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C or SIGTERM (the shell's 128 + SIGINT)."""


class Stopped(KeyboardInterrupt):
    """A run stopped on request after checkpointing (Ctrl-C, SIGTERM): its message says where it
    stands and how to go on. Still a KeyboardInterrupt, so whatever cleans up on one does."""


class InputError(FelactlError):
    """The user gave something wrong: a flag value, a file, a name. Exit 2."""

    exit_code = EXIT_BAD_INPUT


class NodeNameTaken(InputError):
    """A gathering job refused an agent: another agent of the job joined under its node name."""


class SpecError(InputError):
    """A cluster, model or plan file (or dict) is malformed. The message names file and key path."""

    def __init__(self, where: str, key_path: str, problem: str):
        self.where = where
        self.key_path = key_path
        self.problem = problem
        location = f"{where}: {key_path}" if key_path else where
        super().__init__(f"{location}: {problem}")


class WriteError(InputError, OSError):
    """A file felactl was asked to write could not be written (a read-only or full filesystem,
    ``/proc``, no permission). Exit 2 from a command given that path; also an OSError, so the
    runtime's handling of storage trouble (a checkpoint that cannot be written) catches it."""

    def __init__(self, path, cause: OSError):
        self.path = path
        self.cause = cause
        super().__init__(f"cannot write {path}: {cause.strerror or cause}")

    def __str__(self) -> str:
        return self.args[0]


class PlanInfeasible(InputError):
    """No plan meets the constraints (memory, batch split, devices). Names the constraint class."""


class PlanDoesNotFit(PlanInfeasible):
    """No plan fits the devices' memory (the planner may try one holding less)."""


class ProfilingError(FelactlError):
    """A measurement could not be taken (a worker died, a transfer timed out)."""


class ControlPlaneError(FelactlError):
    """The coordinator or store could not be reached, or refused us."""


class AuthError(ControlPlaneError):
    """A wrong or missing job secret. Bad input: exit 2."""

    exit_code = EXIT_BAD_INPUT


class StorageError(FelactlError):
    """The run directory cannot take what the job cannot go on without (a re-formed job's plan).
    Exit 1; the message names the checkpoint to resume from."""


class WorkerFailed(FelactlError):
    """A worker process died or hung and the job could not go on. ``failures``: the lines of the
    failed workers that raised, where the launch knows them (a restart compares them)."""

    def __init__(self, message: str, failures: frozenset[str] = frozenset()):
        super().__init__(message)
        self.failures = failures

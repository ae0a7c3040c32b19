"""The worker runtime: what runs inside each worker process (``python -m felactl.agents.worker``).

It reads the torchrun environment plus ``FELACTL_*`` (see :mod:`.config`) and runs one sequence,
``membership.start() -> train(trainer, strategy, membership) -> membership.finish()``
(:func:`.main.run_worker`):

- :mod:`.membership`: who is in the job, as one interface; :mod:`.fixed` (members never change)
  and :mod:`.elastic` (generations: joins, leaves, failures; :mod:`.generations` follows them,
  :mod:`.replicate` hands the state to those behind, :mod:`.reach` answers partitions).
- :mod:`.runtime`: the store connection and the process groups (:func:`.runtime.form_group`, the
  one place they are formed); :mod:`.engine`: the :class:`~.engine.Trainer` (its stage of the
  plan's model, optimizer, compute, checkpoints), which asks its membership what a step needs
  through :class:`~.membership_view.MembershipView`.
- :mod:`.loop`: the one training loop; :mod:`.strategy`: the interface a sync mode implements;
  :mod:`.strategies`: the one table of them (:mod:`.sync`, :mod:`.pipeline`, :mod:`.flexible`).

The plan file is the worker's one source for the sync mode, the batch and the stages.
"""

from felactl.agents.worker.config import WorkerConfig, from_env
from felactl.agents.worker.main import run_worker

__all__ = ["WorkerConfig", "from_env", "run_worker"]

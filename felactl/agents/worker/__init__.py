"""The worker runtime: what runs inside each worker process (``python -m felactl.agents.worker``).

It reads the torchrun environment plus ``FELACTL_*`` (see :mod:`.config`), joins the job's
process group, builds its stage of the plan's model, and trains with the plan's sync mode.
"""

from felactl.agents.worker.config import WorkerConfig, from_env
from felactl.agents.worker.main import run_worker

__all__ = ["WorkerConfig", "from_env", "run_worker"]

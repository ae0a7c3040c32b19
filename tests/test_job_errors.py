"""A job that cannot go on ends, at once and saying why: an exception in the user's own code."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import Job  # noqa: E402

pytestmark = pytest.mark.multiprocess
TESTS = Path(__file__).parent
SLIP = "RuntimeError: The size of tensor a (2) must match the size of tensor b (16) at non-singleton dimension 1"


def _user_job(tmp_path: Path, *config: str) -> Job:
    env_path = f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"
    options = [item for pair in (("--config", c) for c in config) for item in pair]
    return Job(
        tmp_path,
        "--job",
        "_user_models:shape_slip",
        *options,
        "--nproc-per-node",
        "2",
        "--global-batch",
        "8",
        "--run-id",
        "slip",
        "--steps",
        "5",
        env={"PYTHONPATH": env_path},
    )


@pytest.mark.parametrize(
    ("config", "line"),
    [
        (("where=loss_fn",), SLIP),
        (("where=forward", "error=label"), "LabelError: label 7 is not one of the 2 classes"),
    ],
    ids=["loss_fn-RuntimeError", "forward-own-type"],
)
def test_an_exception_in_the_users_code_ends_an_elastic_launch(config, line, tmp_path, no_leftovers):
    """torch's own RuntimeError from a loss with a shape slip looks like a collective's failure:
    the elastic job re-formed on it forever (335 re-forms, no exit). It ends with exit 1 and the
    user's exception line, whatever the exception's type and wherever the user's code raised it
    (a step's forward or loss)."""
    job = _user_job(tmp_path, *config)
    try:
        _, err = job.proc.communicate(timeout=60)
    finally:
        job.stop()
    err = err.decode()
    assert job.proc.returncode == 1, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("felactl: error:")]
    assert len(errors) == 1 and line in errors[0], err[-3000:]
    assert str(tmp_path / "runs" / "slip" / "logs" / "worker-") in errors[0], errors[0]

"""A worker's exit code is what it decided, not what the interpreter's teardown makes of it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parent.parent)
"""felactl importable by a script of a test also where it is not installed."""


@pytest.mark.multiprocess
def test_a_worker_refusing_its_input_exits_2_while_a_store_thread_is_busy(tmp_path):
    # The elastic worker's heartbeat thread talks to the store (which worker 0 hosts) when the
    # main thread refuses the model: at interpreter teardown the store's C++ thread was still
    # joinable and the process aborted ("terminate called without an active exception", -6),
    # so the launch reported the abort instead of the worker's one-line reason.
    script = tmp_path / "refuse.py"
    script.write_text(
        textwrap.dedent("""
        import datetime, threading, time
        import torch.distributed as dist
        from felactl.agents.worker import __main__ as worker_main
        from felactl.errors import InputError

        def run_worker(cfg):
            server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
            client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=30))
            def beat():
                while True:
                    client.set("hb", "1")
                    client.get("hb")
            threading.Thread(target=beat, daemon=True).start()
            time.sleep(0.3)
            raise InputError("model 'x' builds nothing")

        worker_main.run_worker = run_worker
        worker_main.from_env = lambda: None
        worker_main.run()
    """)
    )
    for _ in range(3):  # the abort came most times, not every time
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])},
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == "felactl worker: model 'x' builds nothing"

"""A module the zygote tests fork (``tests/test_zygote.py``): what its environment asks, then exit.

``ZYGOTE_CHILD``: ``env`` prints its FELACTL_WORKER_ID, session and parent (twice: the pid and
the one it watches); ``threads`` its torch threads and cores; ``random`` prints a
draw of numpy's global generator; ``sleep`` waits to be signalled or for its parent to go, as a
worker does (``exit_with_parent``); ``exit:N`` exits with N; ``raise`` raises.
"""

import os
import sys
import time

import numpy

from felactl.agents.worker.__main__ import exit_with_parent

what = os.environ.get("ZYGOTE_CHILD", "")
if what == "env":
    print(os.environ["FELACTL_WORKER_ID"], os.getsid(0) == os.getpid(), os.getppid(), os.environ["FELACTL_PARENT_PID"])
elif what == "threads":
    import torch

    print(torch.get_num_threads(), len(os.sched_getaffinity(0)))
elif what == "random":
    print(numpy.random.randint(1 << 30))
elif what == "sleep":
    exit_with_parent()
    print("sleeping", flush=True)
    time.sleep(60)
elif what.startswith("exit:"):
    sys.exit(int(what.split(":")[1]))
elif what == "raise":
    raise ValueError("the child's own error")

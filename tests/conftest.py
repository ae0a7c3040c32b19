import os

# Multi-process tests share 2 cores: one thread per process keeps them fast and predictable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

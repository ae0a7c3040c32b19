"""Per-node agents and the worker runtime that runs inside each worker process."""

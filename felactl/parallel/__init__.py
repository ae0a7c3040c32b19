"""Parallelism applied to a plain ``nn.Module``: small functions over the user's model, none of
them a class the user must inherit (as torchtitan's ``apply_fsdp`` and ``pipeline_module_split``).

* :mod:`felactl.parallel.ddp`: how felactl wraps a data-parallel replica in
  ``DistributedDataParallel``, for the worker runtime and for the profiler that times a
  data-parallel step as the runtime runs it.

It sits below both (it imports only torch and ``spec/``): the profiler measures with the
runtime's parts without importing the runtime.
"""

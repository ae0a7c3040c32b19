"""Models felactl can plan and train: the built-ins, or ``package.module:function`` of the user's.

:func:`build` returns a :class:`ModelBundle`: the layers as an ``nn.Sequential`` (each child is
one layer of the profile and of the plan), the data it trains on, and its loss.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from felactl.errors import InputError
from felactl.models import builtin
from felactl.models.data import CharCorpus, PrototypeImages, SampleSource, TeacherDataset


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


@dataclass
class ModelBundle:
    name: str
    source: str
    config: dict[str, Any]
    layers: nn.Sequential
    data: SampleSource
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    extra: dict[str, Any] = field(default_factory=dict)

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.batch(range(batch_size))


def _gpt_mini(config: dict[str, Any]) -> ModelBundle:
    seq_len = int(config.get("seq_len", 64))
    data = CharCorpus(seq_len)
    full = {"depth": 4, "width": 256, "num_heads": 4, **config, "seq_len": seq_len, "vocab_size": len(data.vocab)}
    return ModelBundle("gpt-mini", "gpt-mini", full, builtin.gpt_mini(**full), data, lm_loss)


def _vgg_mini(config: dict[str, Any]) -> ModelBundle:
    full = {"num_classes": 10, "image_size": 32, "width": 32, "fc_width": 1024, **config}
    data = PrototypeImages((3, full["image_size"], full["image_size"]), full["num_classes"])
    return ModelBundle("vgg-mini", "vgg-mini", full, builtin.vgg_mini(**full), data, classification_loss)


def _mlp(config: dict[str, Any]) -> ModelBundle:
    full = {"input_dim": 256, "hidden": 512, "depth": 4, "num_classes": 10, **config}
    data = TeacherDataset((full["input_dim"],), full["num_classes"])
    return ModelBundle("mlp", "mlp", full, builtin.mlp(**full), data, classification_loss)


class Builtin(NamedTuple):
    bundle: Callable[[dict[str, Any]], ModelBundle]
    """Config -> the model with its data and loss."""
    layers: Callable[..., nn.Sequential]
    """The layer factory in felactl.models.builtin: its parameters are the config keys."""


BUILTINS: dict[str, Builtin] = {
    "gpt-mini": Builtin(_gpt_mini, builtin.gpt_mini),
    "vgg-mini": Builtin(_vgg_mini, builtin.vgg_mini),
    "mlp": Builtin(_mlp, builtin.mlp),
}


def _check_builtin_config(source: str, config: dict[str, Any]) -> None:
    """Every knob of a built-in model is a count (layers, widths, heads, classes, pixels):
    a known key with an integer >= 1, said in one line naming the key otherwise."""
    known = list(inspect.signature(BUILTINS[source].layers).parameters)
    for key, value in config.items():
        if key not in known:
            shown = [k for k in known if k != "vocab_size"]  # gpt-mini's comes from its corpus
            raise InputError(f"model {source!r}: unknown config key {key!r}; it takes {', '.join(shown)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"model {source!r}: config {key}={value!r}: must be an integer >= 1")


def _import_user_module(module_name: str):
    """Import the user's module, also from the working directory as ``python -m`` would (the
    ``felactl`` script's own directory, not the user's, is first on ``sys.path``)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != module_name.split(".")[0] or cwd in sys.path:
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(module_name)


def _user_model(source: str, config: dict[str, Any]) -> ModelBundle:
    """``package.module:function`` returning an ``nn.Sequential`` or a list of layers.

    The function may also return ``(layers, data)`` where ``data`` has ``batch(indices)``; without
    data felactl can profile the model (given an input shape) but not train it.
    """
    module_name, _, func_name = source.partition(":")
    try:
        func = getattr(_import_user_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"model {source!r}: cannot import: {exc}") from None
    try:
        accepted = inspect.signature(func).parameters
        built = func(**{k: v for k, v in config.items() if k in accepted})
    except Exception as exc:
        raise InputError(f"model {source!r}: calling it failed: {type(exc).__name__}: {exc}") from None
    data = None
    if isinstance(built, tuple) and len(built) == 2:
        built, data = built
    if isinstance(built, (list, tuple)):
        built = nn.Sequential(*built)
    if not isinstance(built, nn.Sequential):
        raise InputError(f"model {source!r}: must return an nn.Sequential or a list of layers, "
                         f"got {type(built).__name__}")
    return ModelBundle(func_name, source, dict(config), built, data, classification_loss)


def build(source: str, config: dict[str, Any] | None = None, seed: int = 0) -> ModelBundle:
    """Build a model by built-in name or ``package.module:function``; weights from ``seed``."""
    config = dict(config or {})
    if source in BUILTINS:
        _check_builtin_config(source, config)
        try:
            bundle = BUILTINS[source].bundle(config)
        except (TypeError, ValueError, ZeroDivisionError, RuntimeError) as exc:
            raise InputError(f"model {source!r}: bad config {config}: {exc}") from None
    elif ":" in source:
        bundle = _user_model(source, config)
    else:
        raise InputError(f"unknown model {source!r}: use one of {', '.join(BUILTINS)} or package.module:function")
    builtin.init_weights(bundle.layers, seed)
    return bundle


def local_data_parallel_plan(source: str, config: dict[str, Any], num_workers: int, *, global_batch: int,
                             micro_batch: int, sync=None, training=None, shares=None):
    """A data-parallel plan of model ``source`` on ``num_workers`` local CPU slots ``cpu0, cpu1, ...``
    (:func:`felactl.spec.data_parallel_plan`, the layers counted by building the model): what tests
    and benchmarks train without profiling and planning."""
    from felactl.spec import ModelRef, data_parallel_plan

    return data_parallel_plan(model=ModelRef(name=source, source=source, config=config),
                              num_layers=len(build(source, config).layers),
                              devices=[f"cpu{i}" for i in range(num_workers)], global_batch=global_batch,
                              micro_batch=micro_batch, sync=sync, training=training, shares=shares)


__all__ = ["BUILTINS", "Builtin", "ModelBundle", "build", "classification_loss", "lm_loss",
           "local_data_parallel_plan"]

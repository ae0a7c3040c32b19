"""Models felactl can plan and train: the built-ins, or ``package.module:function`` of the user's.

:func:`build` returns a :class:`ModelBundle`: the :class:`felactl.TrainJob` (the model, its data,
loss and optimizer), and the model's layers as an ``nn.Sequential`` (each child is one layer of the
profile and of the plan: the children of an ``nn.Sequential``, or the pieces of a model cut at its
split points, :mod:`felactl.models.split`; any other model is one layer, and cannot be split).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from felactl import limits, machine
from felactl.errors import InputError
from felactl.job import TrainJob
from felactl.models import builtin, split
from felactl.models.data import CharCorpus, PrototypeImages, TeacherDataset
from felactl.spec.model import TiedWeight


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


@dataclass
class ModelBundle:
    name: str
    source: str
    config: dict[str, Any]
    job: TrainJob | None
    """None for a function that returns only layers: felactl can profile it (given an input
    shape) but not train it."""
    given_layers: nn.Sequential | None = None
    """The layers such a function returned (None with a job)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> nn.Module:
        """The module the user's function returned: what an export's ``state_dict`` loads into."""
        return self.job.model if self.job is not None else self.given_layers

    @cached_property
    def split_points(self) -> list[str]:
        """Where stages of a model that is no ``nn.Sequential`` may begin: the job's own, or every
        block of its one block list (:mod:`felactl.models.split`); empty: it is one layer."""
        if isinstance(self.model, nn.Sequential):
            return []
        given = self.job.split_points if self.job is not None else None
        return list(given) if given is not None else split.default_split_points(self.model)

    @property
    def splittable(self) -> bool:
        return isinstance(self.model, nn.Sequential) or bool(self.split_points)

    @cached_property
    def split_graph(self) -> split.SplitGraph:
        """The model traced and cut at its split points (seconds: done once, where stages are needed)."""
        inputs, _targets = self.job.batch(range(2))
        head = self.job.split_points is None  # the head after the last block is a layer of its own
        try:
            return split.SplitGraph(self.model, inputs, self.split_points, head=head)
        except InputError as exc:
            raise InputError(f"model {self.source!r}: {exc}") from None

    @cached_property
    def layers(self) -> nn.Sequential:
        """The model's layers, each one of the profile and the plan: the model itself if it is an
        ``nn.Sequential``; its traced pieces (each from the values live at one split point to those
        live at the next) where it has split points; else ``nn.Sequential(model)``."""
        if isinstance(self.model, nn.Sequential):
            return self.model
        if not self.split_points:
            return nn.Sequential(self.model)
        graph = self.split_graph
        return nn.Sequential(*(split.SplitStage(graph, self.model, i, i + 1) for i in range(len(graph.layers))))

    @cached_property
    def boundary_kinds(self) -> list[list[str]] | None:
        """A split model's :func:`~felactl.models.split.value_kinds` at each cut between layers
        (index ``c - 1`` for cut ``c``); None where one tensor crosses (an ``nn.Sequential``)."""
        if not self.split_points:
            return None
        return split.value_kinds(self.split_graph, self.model, lambda n: self.job.batch(range(n))[0])

    def tied_weights(self) -> tuple[TiedWeight, ...]:
        """The weights several layers read, each with those layers and its size (none unless split)."""
        if not self.split_points:
            return ()
        one_each = [(i, i + 1) for i in range(len(self.split_graph.layers))]
        found = split.tied_weights(self.split_graph, self.model, one_each)
        return tuple(TiedWeight(layers=layers, params=self.model.get_parameter(name).numel()) for name, layers in found)

    @property
    def layer_names(self) -> list[str]:
        """The profile's names of the layers: module paths for a split model (``embedding``,
        ``model.layers.3``, ``head``), else the ``nn.Sequential``'s child names."""
        if self.split_points:
            return list(self.split_graph.names)
        return [name for name, _ in self.layers.named_children()]

    @property
    def data(self) -> TrainJob | None:
        """What ``batch(indices) -> (inputs, targets)`` is called on (the job), or None."""
        return self.job

    @property
    def loss(self) -> Callable[[Any, Any], torch.Tensor]:
        return self.job.loss_fn if self.job is not None else classification_loss

    def stage_module(self, layer_start: int, layer_end: int, *, whole: bool = False) -> nn.Module:
        """The module of a stage over ``[layer_start, layer_end)``: a slice of the layers (it keeps
        the whole model's child names), a :class:`~felactl.models.split.SplitStage` of a split
        model (holding the weights it reads under the model's own names), or, for the one stage of
        a plan (``whole``) or a model that is one layer, the model itself."""
        if isinstance(self.model, nn.Sequential):
            return self.layers[layer_start:layer_end]
        if whole or not self.split_points:
            return self.model
        return split.SplitStage(self.split_graph, self.model, layer_start, layer_end)

    def check_global_batch(self, global_batch: int) -> None:
        """Refuse (InputError) a global batch larger than the job's dataset: a step's sample
        indices wrap around the data (:meth:`TrainJob.batch`), so every step would see each sample
        several times over, and train on the repeats without a word."""
        if self.job is None:
            return
        size = len(self.job.dataset)
        if global_batch > size:
            raise InputError(
                f"model {self.source!r}: its dataset has {size} sample(s), fewer than the global batch of "
                f"{global_batch}: every step would see each sample about {global_batch / size:.3g} times; "
                f"use a global batch of at most {size}, or more data"
            )

    def layer_params(self) -> tuple[int, ...]:
        """Trainable parameters of each layer, as its profile counts them: what
        :func:`felactl.spec.executable.check_executable` checks a plan's stages against."""
        return tuple(sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in self.layers)


def _bundle(name: str, source: str, config: dict[str, Any], job: TrainJob) -> ModelBundle:
    return ModelBundle(name, source, config, job)


def _gpt_mini(config: dict[str, Any]) -> TrainJob:
    seq_len = int(config.get("seq_len", 64))
    data = CharCorpus(seq_len)
    full = {"depth": 4, "width": 256, "num_heads": 4, **config, "seq_len": seq_len, "vocab_size": len(data.vocab)}
    config.update(full)
    return TrainJob(model=builtin.gpt_mini(**full), dataset=data, loss_fn=lm_loss)


def _vgg_mini(config: dict[str, Any]) -> TrainJob:
    full = {"num_classes": 10, "image_size": 32, "width": 32, "fc_width": 1024, **config}
    config.update(full)
    data = PrototypeImages((3, full["image_size"], full["image_size"]), full["num_classes"])
    return TrainJob(model=builtin.vgg_mini(**full), dataset=data, loss_fn=classification_loss)


def _mlp(config: dict[str, Any]) -> TrainJob:
    full = {"input_dim": 256, "hidden": 512, "depth": 4, "num_classes": 10, **config}
    config.update(full)
    data = TeacherDataset((full["input_dim"],), full["num_classes"])
    return TrainJob(model=builtin.mlp(**full), dataset=data, loss_fn=classification_loss)


class Builtin(NamedTuple):
    job: Callable[[dict[str, Any]], TrainJob]
    """Config -> the built-in's TrainJob (no optimizer factory: the plan's ``training`` picks it).
    It completes ``config`` in place with the defaults it used."""
    layers: Callable[..., nn.Sequential]
    """The layer factory in felactl.models.builtin: its parameters are the config keys."""
    data_bytes: Callable[[dict[str, Any]], int]
    """Full config -> bytes its generated data takes, without generating it."""


BUILTINS: dict[str, Builtin] = {
    "gpt-mini": Builtin(_gpt_mini, builtin.gpt_mini, lambda c: CharCorpus.nbytes()),
    "vgg-mini": Builtin(
        _vgg_mini,
        builtin.vgg_mini,
        lambda c: PrototypeImages.nbytes((3, c["image_size"], c["image_size"]), c["num_classes"]),
    ),
    "mlp": Builtin(_mlp, builtin.mlp, lambda c: TeacherDataset.nbytes((c["input_dim"],))),
}
BUILTIN_BOUNDS = {"depth": limits.LAYERS}
"""The built-ins' config keys bounded on their own: making a block takes time even on the meta
device, so a depth no memory check could see (tiny blocks) would still build for hours."""
TRAIN_BYTES_PER_PARAM = 8
"""fp32 weights and their gradients: the least a model needs to train or be profiled (an
optimizer's state comes on top)."""


def _with_defaults(source: str, config: dict[str, Any]) -> dict[str, Any]:
    defaults = {k: p.default for k, p in inspect.signature(BUILTINS[source].layers).parameters.items()}
    return {**defaults, **config}


def builtin_params(source: str, config: dict[str, Any]) -> int:
    """Parameters of built-in ``source`` at ``config`` (its defaults where not given), counted on
    the meta device: nothing is allocated. Its blocks are alike, so the count is linear in
    ``depth``: builds at depth 1 and 2 give it at any depth without making depth-many modules
    (making 10,000 gpt-mini blocks took 40 s on a busy machine, even on the meta device)."""
    full = _with_defaults(source, config)

    def count(**override: int) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in BUILTINS[source].layers(**{**full, **override}).parameters())

    if "depth" not in full:
        return count()
    one, two = count(depth=1), count(depth=2)
    return one + (full["depth"] - 1) * (two - one)


def builtin_bytes(source: str, config: dict[str, Any]) -> int:
    """The least memory built-in ``source`` at ``config`` needs: its weights and their gradients
    (:data:`TRAIN_BYTES_PER_PARAM`), and the data it generates."""
    params = builtin_params(source, config)
    return TRAIN_BYTES_PER_PARAM * params + BUILTINS[source].data_bytes(_with_defaults(source, config))


def _check_fits(source: str, config: dict[str, Any]) -> None:
    """Refuse (InputError) a built-in this machine's memory cannot hold, before any of it is
    allocated: ``--config width=10000000`` otherwise allocates until the machine swaps or the
    allocator gives up, and says bytes, not why."""
    need, have = builtin_bytes(source, config), machine.memory_bytes()
    if need <= have:
        return
    given = ", ".join(f"{k}={v}" for k, v in config.items())
    raise InputError(
        f"model {source!r}{' with ' + given if given else ''} has {builtin_params(source, config):,} parameters: "
        f"its weights, their gradients and its data need {need / machine.GB:.3g} GB, more than this "
        f"machine's {have / machine.GB:.3g} GB of memory"
    )


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
        if key in BUILTIN_BOUNDS and value > BUILTIN_BOUNDS[key].most:
            bound = BUILTIN_BOUNDS[key]
            raise InputError(f"model {source!r}: config {key}={value}: must be at most {bound.most:g} ({bound.why})")


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


def _user_function(source: str) -> Callable[..., Any]:
    """The function ``package.module:function`` names, imported (not called)."""
    module_name, _, func_name = source.partition(":")
    module = None  # an AttributeError may come from the module's own code, while it imports
    try:
        with contextlib.redirect_stdout(sys.stderr):  # what it prints as it imports, as its function's
            module = _import_user_module(module_name)
        return getattr(module, func_name)
    except (ImportError, AttributeError) as exc:
        where = ""
        if module_name.endswith(".py") and isinstance(exc, ModuleNotFoundError):  # a file's name, as for python
            dotted = module_name.removesuffix(".py").replace("/", ".")
            where = f" (name the module, not its file: {dotted}:{func_name})"
        elif isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]:
            where = f" (felactl looks in the current directory, {os.getcwd()}, and on PYTHONPATH)"
        elif module is not None:
            where = _shadowed(module, module_name)
        raise InputError(f"model {source!r}: cannot import: {exc}{where}") from None
    except Exception as exc:
        raise InputError(f"model {source!r}: importing it failed: {type(exc).__name__}: {exc}") from None


def _shadowed(module, module_name: str) -> str:
    """Where the working directory has a file of the module's name that is not the module imported
    (a user's wave.py behind Python's own ``wave``): say so, it is not a typo in the function."""
    mine = os.path.join(os.getcwd(), *module_name.split(".")) + ".py"
    imported = getattr(module, "__file__", None)
    if not os.path.exists(mine) or (imported and os.path.samefile(imported, mine)):
        return ""
    return f" (imported {imported or 'a built-in module'}, not {mine}, which has the same name: rename your file)"


def check_source(source: str, config: dict[str, Any] | None = None) -> None:
    """Refuse (InputError) a model source that names no built-in and no importable function (or
    a built-in's config it does not take), without building the model: what ``felactl launch``
    checks before any worker starts."""
    if source in BUILTINS:
        _check_builtin_config(source, dict(config or {}))
        return
    if ":" not in source:
        raise InputError(f"unknown model {source!r}: use one of {', '.join(BUILTINS)} or package.module:function")
    _check_user_config(source, _user_function(source), dict(config or {}))


PROFILE_KEYS = ("input_shape",)
"""Config keys felactl itself records (``felactl profile --model --input-shape``), never typos."""


def _user_kwargs(func: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(func).parameters
    return {k: v for k, v in config.items() if k not in PROFILE_KEYS or k in params}


def _check_user_config(source: str, func: Callable[..., Any], config: dict[str, Any]) -> None:
    """A config key the user's function does not take is a typo, refused as for built-ins
    (a function with ``**kwargs`` takes any); a value must be a finite number where the function
    takes a number (annotated ``int``/``float``, or with such a default): ``--config lr=nan``
    arrives as the string 'nan', which would fail in the workers, deep in torch."""
    try:
        params = inspect.signature(func, eval_str=True).parameters
    except Exception:  # an annotation that does not evaluate: go by the defaults only
        params = inspect.signature(func).parameters
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"model {source!r}: config {key}={value} is not a finite number")
        number = _number_type(params.get(key))
        if number is not None and not _is_a(number, value):
            raise InputError(f"model {source!r}: config {key} takes {number.__name__}, got {value!r}")
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in _user_kwargs(func, config):
        if key not in params:
            raise InputError(f"model {source!r}: unknown config key {key!r}; it takes {', '.join(params) or 'none'}")


def _number_type(param: inspect.Parameter | None) -> type | None:
    """int or float where the parameter takes one (its annotation, else its default's type)."""
    if param is None:
        return None
    if param.annotation in (int, float):
        return param.annotation
    return type(param.default) if type(param.default) in (int, float) else None


def _is_a(number: type, value: Any) -> bool:
    """Whether ``value`` passes for ``number``: an int for an int (not a bool), an int or a float
    for a float."""
    allowed = (int,) if number is int else (int, float)
    return isinstance(value, allowed) and not isinstance(value, bool)


def _user_model(source: str, config: dict[str, Any]) -> ModelBundle:
    """``package.module:function`` returning a :class:`felactl.TrainJob` (to train it), or an
    ``nn.Sequential`` / a list of layers (to profile it only, given an input shape)."""
    func_name = source.partition(":")[2]
    func = _user_function(source)
    _check_user_config(source, func, config)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # a command's --json output is its stdout alone
            built = func(**_user_kwargs(func, config))
    except InputError as exc:
        raise InputError(f"model {source!r}: {exc}") from None
    except Exception as exc:
        raise InputError(f"model {source!r}: calling it failed: {type(exc).__name__}: {exc}") from None
    if isinstance(built, TrainJob):
        return _bundle(func_name, source, dict(config), built)
    if isinstance(built, (list, tuple)):
        built = nn.Sequential(*built)
    if not isinstance(built, nn.Sequential):
        raise InputError(
            f"model {source!r}: must return a felactl.TrainJob (or, to profile only, an "
            f"nn.Sequential or a list of layers), got {type(built).__name__}"
        )
    return ModelBundle(func_name, source, dict(config), None, built)


def build(source: str, config: dict[str, Any] | None = None, seed: int = 0) -> ModelBundle:
    """Build a model by built-in name or ``package.module:function``, with torch's random state
    seeded by ``seed`` while it is built (the caller's is left as it was, as are Python's and
    numpy's global generators, whatever the function does to them), on one thread, so every
    process builds the same weights (a sum over many threads rounds as their count has it: an
    init that centres or normalises would differ between slots of different sizes), and a
    worker's zygote can build it without starting OpenMP's threads, which a fork does not copy. A user's model keeps the weights its function gave it (its own
    initialisation, or pretrained ones it loaded): felactl never re-initialises it. A built-in
    this machine's memory cannot hold is refused before any of it is allocated."""
    config = dict(config or {})
    check_source(source, config)
    with torch.random.fork_rng(devices=[]), _global_rngs_kept(), _one_thread():
        torch.manual_seed(seed)
        if source in BUILTINS:
            given = dict(config)
            try:
                _check_fits(source, config)
                job = BUILTINS[source].job(config)
            except (TypeError, ValueError, ZeroDivisionError, RuntimeError) as exc:
                # torch's own messages (a size that overflows) run on for pages of C++ frames
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise InputError(f"model {source!r}: bad config {given}: {first_line}") from None
            builtin.init_weights(job.model, seed)
            bundle = _bundle(source, source, config, job)
        else:
            bundle = _user_model(source, config)
    return bundle


@contextlib.contextmanager
def _global_rngs_kept():
    """Python's and numpy's global generators as they were before: a build in a node's zygote,
    whose forks reseed them, and one in a worker then leave the same state (a fresh one where
    numpy was first imported by the build)."""
    state = random.getstate()
    numpy_state = sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None
    try:
        yield
    finally:
        random.setstate(state)
        if numpy_state is not None:
            sys.modules["numpy"].random.set_state(numpy_state)
        elif "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def local_data_parallel_plan(
    source: str,
    config: dict[str, Any],
    num_workers: int,
    *,
    global_batch: int,
    micro_batch: int,
    sync=None,
    training=None,
    shares=None,
):
    """A data-parallel plan of model ``source`` on ``num_workers`` local CPU slots ``cpu0, cpu1, ...``
    (:func:`felactl.spec.data_parallel_plan`, the layers counted by building the model): what tests
    and benchmarks train without profiling and planning."""
    from felactl.spec import ModelRef, data_parallel_plan

    bundle = build(source, config)
    bundle.check_global_batch(global_batch)
    return data_parallel_plan(
        model=ModelRef(name=source, source=source, config=config),
        num_layers=len(bundle.layers) if isinstance(bundle.model, nn.Sequential) else 1,  # the model whole
        devices=[f"cpu{i}" for i in range(num_workers)],
        global_batch=global_batch,
        micro_batch=micro_batch,
        sync=sync,
        training=training,
        shares=shares,
    )


__all__ = [
    "BUILTINS",
    "Builtin",
    "ModelBundle",
    "TrainJob",
    "build",
    "builtin_bytes",
    "builtin_params",
    "check_source",
    "classification_loss",
    "lm_loss",
    "local_data_parallel_plan",
]

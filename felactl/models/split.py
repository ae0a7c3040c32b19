"""Split points for any model: the user's own ``nn.Module`` cut into layers felactl profiles,
plans and runs as pipeline stages, without rewriting it.

The model is traced once with ``torch.export`` (non-strict, the batch axis dynamic), and the
graph's nodes are grouped by the module they run in (``nn_module_stack``): everything before the
first split point is layer 0 (the embedding), each split point begins a layer (a block of
``model.layers``), and what follows the last block is the last layer (final norm and head).
``torch.fx``'s ``split_module`` turns the groups into one graph module per layer. A layer maps the
values live where it begins (hidden states, and whatever else later layers read: position
embeddings, masks, sizes) to the values live where it ends, so a chain of layers computes the
model, and any contiguous run of them is a pipeline stage. What crosses a stage boundary is
whatever the model passes, tuple and all.

Why not ``torch.distributed.pipelining.pipeline()``: it traces with static shapes (every micro-
batch size its own trace) and copies weights used by two stages; here one trace serves every
micro-batch, the weights stay the user's own tensors, and a stage's ``state_dict`` keys are the
user's names, so checkpoints merge into the user's unsplit ``state_dict``. Weights used by two
stages (GPT-2's ``lm_head`` = ``wte``) are held by both; :func:`tied_parameters` names them so the
runtime sums their gradients across the stages (as Megatron does for embeddings).
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils import _pytree as pytree

from felactl.errors import InputError
from felactl.models.values import BATCHED, SHARED, SIZE

PRE, POST = "embedding", "head"
"""The names of the layers before the first and after the last split point."""


@dataclass(frozen=True, slots=True)
class Ref:
    """A value of the traced model: an input leaf (``kind="input"``), a weight or buffer
    (``"attr"``, ``name`` its dotted path) or output ``item`` of layer ``index`` (``"layer"``;
    ``item`` None when the layer returns one value)."""

    kind: str
    index: int = 0
    item: int | None = None
    name: str = ""


def find_blocks(model: nn.Module) -> str | None:
    """The path of the model's one list of blocks: a ``ModuleList`` or ``ModuleDict`` of at least
    two children all of one class (HF's ``model.layers`` and ``transformer.h``, torchtitan's
    ``layers``), not nested in another such list; the one with the most parameters where there
    are several. None where there is none."""
    found: list[tuple[int, str]] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) < 2:
            continue
        children = list(module.children())
        if len({type(c) for c in children}) == 1:
            found.append((sum(p.numel() for p in module.parameters()), path))
    # A list inside a block of another list (the experts of each MoE block) is not the model's blocks.
    outer = [f for f in found if not any(f[1].startswith(o[1] + ".") for o in found if o is not f)]
    return max(outer)[1] if outer else None


def default_split_points(model: nn.Module) -> list[str]:
    """Every block of the model's block list, each a place a stage may begin."""
    path = find_blocks(model)
    if path is None:
        return []
    blocks = model.get_submodule(path)
    names = blocks.keys() if isinstance(blocks, nn.ModuleDict) else (str(i) for i in range(len(blocks)))
    return [f"{path}.{name}" for name in names]


class SplitGraph:
    """The model traced and cut: layer ``i`` is ``self.layers[i]``, called with the values
    ``self.args[i]`` names; ``self.live[c]`` are the values that cross cut ``c`` (between layers
    ``c - 1`` and ``c``)."""

    def __init__(self, model: nn.Module, example_inputs: Any, split_points: Sequence[str], *, head: bool):
        """``head``: what runs after the last split point's module is a layer of its own (the
        final norm and head after the last block); else it belongs to the last split point's."""
        self.split_points = list(split_points)
        self.names = [PRE, *self.split_points]
        exported = _export(model, example_inputs)
        self.in_spec, self.out_spec = exported.call_spec.in_spec, exported.call_spec.out_spec
        traced = exported.module()
        groups = _group_nodes(traced, self.split_points, head=head)
        if max(groups.values()) == len(self.split_points) + 1:
            self.names.append(POST)
        split = split_module(traced, traced, lambda node: groups[node.name], keep_original_order=True)
        self.layers: list[fx.GraphModule] = []
        self.args: list[list[Ref]] = []
        self.output: list[Ref] = []
        self._wire(split)
        if len(self.layers) != len(self.names):
            raise InputError(
                f"the split points {', '.join(self.split_points)} leave a layer without any computation: "
                f"name the modules where stages begin, in the order the model runs them"
            )
        self.live = self._live_values()

    def _wire(self, split: fx.GraphModule) -> None:
        """Read the top-level graph ``split_module`` made: each layer's arguments as :class:`Ref`s."""
        refs: dict[fx.Node, Ref] = {}
        inputs = 0
        for node in split.graph.nodes:
            if node.op == "placeholder":
                refs[node] = Ref("input", inputs)
                inputs += 1
            elif node.op == "get_attr":
                refs[node] = Ref("attr", name=node.target)
            elif node.op == "call_module":
                index = len(self.layers)
                self.layers.append(getattr(split, node.target))
                self.args.append([refs[a] for a in node.args])
                refs[node] = Ref("layer", index)
            elif node.op == "call_function" and node.target is operator.getitem:
                source = refs[node.args[0]]
                refs[node] = Ref("layer", source.index, node.args[1])
            elif node.op == "output":
                self.output = [refs[a] for a in pytree.tree_leaves(node.args[0])]
        self.num_inputs = inputs

    def _live_values(self) -> list[list[Ref]]:
        """For each cut 0..L, the layer values made before it and read at or after it (by a layer
        or the model's output), in a fixed order; cut 0 is the model's inputs."""
        live = [[Ref("input", i) for i in range(self.num_inputs)]]
        for cut in range(1, len(self.layers) + 1):
            later = [r for args in self.args[cut:] for r in args] + (self.output if cut < len(self.layers) else [])
            wanted = []
            for ref in later:
                if ref.kind == "attr" or ref in wanted:
                    continue
                made_before = ref.kind == "input" or ref.index < cut
                if made_before:
                    wanted.append(ref)
            live.append(wanted)
        return live

    def attrs(self, start: int, end: int) -> list[str]:
        """The weights and buffers layers ``start..end-1`` read, by the names the trace uses."""
        return list(dict.fromkeys(r.name for args in self.args[start:end] for r in args if r.kind == "attr"))

    def flatten_inputs(self, inputs: Any) -> list[Any]:
        """The model's input (what ``model(inputs)`` is called with) as the traced input leaves."""
        leaves, spec = pytree.tree_flatten(((inputs,), {}))
        if spec != self.in_spec:
            raise InputError(
                f"the model's input has another structure than the one it was traced with: {spec} vs {self.in_spec}"
            )
        return leaves


def _export(model: nn.Module, example_inputs: Any):
    """``torch.export`` of ``model(example_inputs)``, every input tensor's first axis (the batch)
    dynamic, so that one trace serves micro-batches of any size."""
    leaves = pytree.tree_leaves(example_inputs)
    dims = pytree.tree_map(
        lambda x: {0: torch.export.Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() > 0 else None,
        (example_inputs,),
    )
    if not leaves:
        raise InputError("the model's input holds no tensor to trace it with")
    try:
        # a failing trace prints the graph so far and logs warnings: the one line below says what failed
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), _quiet("torch"):
            return torch.export.export(model, (example_inputs,), dynamic_shapes=dims, strict=False)
    except Exception as exc:
        raise InputError(f"torch.export cannot trace the model to split it into stages: {_why(exc)}") from None


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


WHY_LIMIT = 200
"""Characters of torch's own reason shown (its messages run on for pages)."""


def _why(exc: Exception) -> str:
    """What failed, in one line a user can act on: the user code the trace stopped at where torch
    says it, and what to do."""
    text = str(exc)
    if "Cache" in text and "in output" in text:  # transformers' DynamicCache: a model built to generate
        return "its output holds a key/value cache: build the model with use_cache=False (in its config)"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    code = [line for line in lines if "code:" in line]
    where = ("at " + code[-1].split("code:", 1)[1].strip()) if code else (lines[0] if lines else "no reason given")
    if len(where) > WHY_LIMIT:
        where = where[: WHY_LIMIT - 3] + "..."
    return (
        f"{type(exc).__name__}: {where}; a forward whose control flow depends on the data cannot be cut: "
        "name no split points (TrainJob(split_points=[])) to train it data-parallel"
    )


def _module_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [path.removeprefix("L['self'].").removeprefix("L__self__.") for path, _ in stack.values()]


def _group_nodes(traced: fx.GraphModule, split_points: Sequence[str], *, head: bool) -> dict[str, int]:
    """Each computing node's layer: 0 before the first split point's module runs, ``k + 1`` from
    the first node of split point ``k``'s module on, and (with ``head``) ``len(split_points) + 1``
    from the first node after the last split point's module that runs in none of them."""
    nodes = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    inside = [_split_point_of(n, split_points) for n in nodes]
    seen = {k for k in inside if k is not None}
    missing = [p for k, p in enumerate(split_points) if k not in seen]
    if missing:
        raise InputError(
            f"split point(s) {', '.join(missing)}: no computation runs in them (name modules the forward calls)"
        )
    groups: dict[str, int] = {}
    current, last_seen = 0, {}
    for i, k in enumerate(inside):
        if k is not None:
            last_seen[k] = i
    last_block_end = max(last_seen.values())
    for i, (node, k) in enumerate(zip(nodes, inside)):
        if k is not None:
            if k + 1 < current:
                raise InputError(
                    f"split point {split_points[k]} runs again after {split_points[current - 1]}: "
                    f"a model that calls a block twice, or out of order, cannot be cut there"
                )
            current = k + 1
        elif head and i > last_block_end:
            current = len(split_points) + 1
        groups[node.name] = current
    return groups


def _split_point_of(node: fx.Node, split_points: Sequence[str]) -> int | None:
    for path in _module_paths(node):
        for k, point in enumerate(split_points):
            if path == point or path.startswith(point + "."):
                return k
    return None


class SplitStage(nn.Module):
    """Layers ``start..end-1`` of a :class:`SplitGraph` as one module, holding exactly the weights
    and buffers they read under the user's own names (its ``state_dict`` is a part of the user
    model's). Called with the values live at cut ``start`` (the model's input for the first
    stage), it returns those live at cut ``end`` as a tuple, or the model's output for the last."""

    def __init__(self, graph: SplitGraph, model: nn.Module, start: int, end: int):
        super().__init__()
        self.graph, self.start, self.end = graph, start, end
        self.is_last = end == len(graph.layers)
        _adopt(self, model, graph.attrs(start, end))
        self.kind = _kind(graph, model, start, end)
        """What the stage holds, as a profile names a layer's kind: the block's class, or the
        classes of the modules whose weights the embedding or head layer reads."""
        self._device: torch.device | None = None

    def forward(self, values: Any) -> Any:
        if self.start == 0:
            values = self.graph.flatten_inputs(values)
        elif not isinstance(values, tuple):
            values = (values,)
        g = self.graph
        env: dict[Ref, Any] = dict(zip(g.live[self.start], values))
        for k in range(self.start, self.end):
            env[Ref("layer", k)] = self._layer(k)(*[self._value(r, env) for r in g.args[k]])
        if self.is_last:
            return pytree.tree_unflatten([self._value(r, env) for r in g.output], g.out_spec)
        return tuple(self._value(r, env) for r in g.live[self.end])

    def _layer(self, k: int) -> fx.GraphModule:
        layer = self.graph.layers[k]
        device = next((t.device for t in self._tensors()), None)
        if device is not None and self._device != device:
            _move_graph_constants(self.graph, device)
            self._device = device
        return layer

    def _tensors(self):
        yield from self.parameters()
        yield from self.buffers()

    def _value(self, ref: Ref, env: dict[Ref, Any]) -> Any:
        if ref in env:
            return env[ref]
        if ref.kind == "attr":
            return _get_attr(self, ref.name)
        return env[Ref("layer", ref.index)][ref.item]


def _kind(graph: SplitGraph, model: nn.Module, start: int, end: int) -> str:
    """A block's class; else the classes of the modules with weights whose code runs in the
    layers (``Embedding``; ``RMSNorm+Linear`` for a head, tied to the embedding or not)."""
    if end - start == 1 and 0 < start <= len(graph.split_points):
        return type(model.get_submodule(graph.split_points[start - 1])).__name__
    owners = []
    for layer in graph.layers[start:end]:
        for node in layer.graph.nodes:
            paths = _module_paths(node) if node.op == "call_function" else []
            module = _submodule(model, paths[-1]) if paths else None
            if module is not None and any(True for _ in module.parameters(recurse=False)):
                owners.append(type(module).__name__)
    return "+".join(dict.fromkeys(owners)) or "SplitStage"


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None


def _get_attr(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


def _adopt(stage: nn.Module, model: nn.Module, names: Sequence[str]) -> None:
    """Register under ``stage`` the model's tensors that ``names`` read, under every name the
    model gives each (a tied weight under both), with the model's own persistence for buffers: the
    stage's ``state_dict`` keys are then the model's, for the tensors it holds."""
    wanted = {id(_get_attr(model, n)) for n in names}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in wanted:
            owner, leaf = _owner(stage, name)
            owner.register_parameter(leaf, param)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if id(buffer) in wanted:
            owner_path, _, leaf = name.rpartition(".")
            source = model.get_submodule(owner_path) if owner_path else model
            owner, leaf = _owner(stage, name)
            owner.register_buffer(leaf, buffer, persistent=leaf not in source._non_persistent_buffers_set)


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module under ``root`` that ``name``'s last part belongs to, made (empty) where missing."""
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        if not hasattr(owner, part) or not isinstance(getattr(owner, part), nn.Module):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    return owner, leaf


def _move_graph_constants(graph: SplitGraph, device: torch.device) -> None:
    """A trace burns the device of tensors its ops create (``arange(..., device="cpu")``) into the
    graph: point them at the device the stage runs on."""
    for layer in graph.layers:
        changed = False
        for node in layer.graph.nodes:
            if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"] != device:
                node.update_kwarg("device", device)
                changed = True
        if changed:
            layer.recompile()


__all__ = [
    "POST",
    "PRE",
    "SplitGraph",
    "SplitStage",
    "default_split_points",
    "find_blocks",
    "tied_weights",
    "value_kinds",
]


def tied_weights(
    graph: SplitGraph, model: nn.Module, ranges: Sequence[tuple[int, int]]
) -> list[tuple[str, tuple[int, ...]]]:
    """The trainable weights that several of these stages (layer ranges) read, each as its name in
    the trace and the stages that read it (GPT-2's ``lm_head.weight`` = ``wte.weight``: the first
    and the last stage). Each such stage holds its own copy: their gradients must be summed."""
    readers: dict[int, tuple[str, list[int]]] = {}
    for s, (start, end) in enumerate(ranges):
        for name in graph.attrs(start, end):
            tensor = _get_attr(model, name)
            if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                readers.setdefault(id(tensor), (name, []))[1].append(s)
    return [(name, tuple(stages)) for name, stages in readers.values() if len(stages) > 1]


def value_kinds(graph: SplitGraph, model: nn.Module, batch: Callable[[int], Any]) -> list[list[str]]:
    """For each cut 1..L-1, the kind of each live value there, told apart by running the pieces on
    micro-batches of 2 and of 3 samples (``batch(n)``: the model's input for ``n`` samples)."""
    runs = []
    with torch.no_grad():
        for n in (2, 3):
            value, per_cut = batch(n), []
            for k in range(len(graph.layers) - 1):
                value = SplitStage(graph, model, k, k + 1)(value)
                per_cut.append(value)
            runs.append(per_cut)
    return [[_kind_of(a, b) for a, b in zip(two, three)] for two, three in zip(*runs)]


def _kind_of(two: Any, three: Any) -> str:
    if isinstance(two, torch.Tensor):
        return BATCHED if two.dim() > 0 and (two.shape[0], three.shape[0]) == (2, 3) else SHARED
    return SIZE if (two, three) == (2, 3) else SHARED

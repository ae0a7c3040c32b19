"""The search space the ILP and the exhaustive oracle share: blocks, slots, groups, stage options.

* **Blocks**: consecutive layers the planner never cuts inside. Models up to ``max_blocks`` layers
  are planned layer by layer; deeper ones are coarsened into blocks of about equal FLOPs.
* **Device classes and slots**: devices with the same model, throughput and memory form a class;
  each class is split (in rank order) into at most ``max_slots_per_class`` slots of consecutive
  devices, so the variables scale with slots, not devices. A slot always acts as a whole.
* **Groups** (who runs a stage): unions of slots of two shapes. *Prefix groups* take none, the
  first, or all slots of each class (any mix of classes), so groups nest like Fela's
  conditional token distribution (conv layers on everyone, FC on a subset). *Aligned groups* take
  one class's slots ``[k*m, (k+1)*m)`` for a power of two ``m``: disjoint, so stages can form
  pipelines (SDPipe). A device may serve several stages (tokens) or, with ``exclusive``, one.
* **Stage options**: (layer range, micro-batch, group) with, per device profile, the seconds the
  option costs it (compute + exchange + sync, :func:`evaluate.stage_device_cost`), its memory, and
  its pipeline fill. Options that cannot fit a member's memory, or in which a member would get no
  whole token (:func:`evaluate.token_samples`), are left out, and so are layer ranges without a
  trainable parameter (the runtime cannot run them as a stage: :mod:`felactl.spec.executable`);
  with ``prune``, options dominated by the same range and group at another micro-batch (no
  better on any device's time, memory, fill, latency or in-flight terms) are dropped too, except
  where a stage the in-flight limit may hold back ends at their start (their micro-batch sets its
  pace). Each option also carries its latency and, per profile and next stage's micro-batch, the
  terms of its in-flight limit's pace (:func:`evaluate.held_terms`).
* **Twin blocks** (:meth:`SearchSpace.twin_blocks`): sibling slot blocks of one class whose swap
  maps every option onto an equal one; the ILP orders their loads to break the symmetry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product

from felactl.optimizer.cost import CostModel, micro_batch_options, stage_memory_bytes
from felactl.optimizer.evaluate import (
    StageChoice,
    chain_follows,
    held_terms,
    in_flight,
    stage_device_cost,
    stage_fill_s,
    stage_latency_s,
    token_samples,
)
from felactl.spec.executable import stage_trainable


@dataclass(frozen=True)
class Slot:
    device_class: int
    devices: tuple[str, ...]
    memory_bytes: float


@dataclass(frozen=True)
class Profile:
    """Devices of one slot whose costs are identical: one load constraint stands for them all."""

    slot: int
    devices: tuple[str, ...]


@dataclass(frozen=True)
class StageOption:
    choice: StageChoice
    group: int
    slots: tuple[int, ...]
    cost_s: dict[int, float]
    """Profile index -> seconds one device of that profile spends on this stage per iteration."""
    memory_bytes: dict[int, float]
    """Slot index -> bytes one device of that slot holds for this stage."""
    fill_s: float
    latency_s: float = 0.0
    """One micro-batch through the stage (:func:`evaluate.stage_latency_s`)."""
    held: dict[int, dict[int, tuple[int, float]]] = field(default_factory=dict)
    """Profile index -> micro-batch of a next stage -> ``(rounds, base_s)`` of ``held``
    (:func:`evaluate.held_terms`), where the option's in-flight limit binds the profile's first
    device; absent where it does not."""


@dataclass
class SearchSpace:
    cost: CostModel
    global_batch: int
    max_stages: int
    boundaries: tuple[int, ...]
    """Layer indices where a cut may fall: 0, ..., num_layers."""
    slots: tuple[Slot, ...]
    profiles: tuple[Profile, ...]
    groups: tuple[tuple[int, ...], ...]
    options: list[StageOption]
    num_prefix_groups: int = 0
    micro_batches: tuple[int, ...] = ()
    """The micro-batches searched."""
    """``groups[:num_prefix_groups]`` are the prefix groups (nested, free of symmetric twins)."""

    def twin_blocks(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Sibling blocks of one class's slots that the program cannot tell apart, as (profiles of
        the left block, profiles of the right block), larger blocks first.

        The siblings are ``[a, a+m)`` and ``[a+m, a+2m)`` of a class's slots (``m`` a power of two,
        ``a`` a multiple of ``2m``): the blocks of the aligned groups. They are twins when swapping
        them maps every option onto an option of the same range and micro-batch whose costs,
        memory and fill are the same (relative ``TWIN_TOLERANCE``): then any plan has a mirror
        image with the same iteration time. Prefix groups holding one block's first slot but not
        the other's have no image, so only blocks that no such group tells apart are twins."""
        by_class: dict[int, list[int]] = {}
        for u, slot in enumerate(self.slots):
            by_class.setdefault(slot.device_class, []).append(u)
        index = {(o.choice.start, o.choice.end, o.choice.micro_batch, o.group): o for o in self.options}
        group_index = {g: k for k, g in enumerate(self.groups)}
        twins = []
        for members in by_class.values():
            for m in reversed(_powers_upto(len(members))[:-1] if len(members) > 1 else []):
                for a in range(0, len(members) - 2 * m + 1, 2 * m):
                    left, right = members[a : a + m], members[a + m : a + 2 * m]
                    swap = self._swap_map(left, right)
                    if swap and self._is_symmetry(swap, index, group_index):
                        twins.append(
                            (tuple(p for u in left for p in swap[2][u]), tuple(p for u in right for p in swap[2][u]))
                        )
        return twins

    def _swap_map(self, left: list[int], right: list[int]):
        """(slot map, profile map, profiles of each slot) of swapping ``left`` and ``right``."""
        of_slot: dict[int, list[int]] = {}
        for p, prof in enumerate(self.profiles):
            of_slot.setdefault(prof.slot, []).append(p)
        slot_map = {u: u for u in range(len(self.slots))}
        profile_map = {p: p for p in range(len(self.profiles))}
        for a, b in zip(left, right):
            if len(of_slot.get(a, [])) != len(of_slot.get(b, [])):
                return None
            slot_map[a], slot_map[b] = b, a
            for pa, pb in zip(of_slot.get(a, []), of_slot.get(b, [])):
                profile_map[pa], profile_map[pb] = pb, pa
        return slot_map, profile_map, of_slot

    def _is_symmetry(self, swap, index: dict, group_index: dict) -> bool:
        slot_map, profile_map, _ = swap
        for (start, end, micro_batch, g), opt in index.items():
            image_group = group_index.get(tuple(sorted(slot_map[u] for u in self.groups[g])))
            image = index.get((start, end, micro_batch, image_group))
            if image is None or not _close(opt.fill_s, image.fill_s):
                return False
            if any(not _close(c, image.cost_s.get(profile_map[p], math.inf)) for p, c in opt.cost_s.items()):
                return False
            if any(not _close(b, image.memory_bytes.get(slot_map[u], math.inf)) for u, b in opt.memory_bytes.items()):
                return False
            if not _close(opt.latency_s, image.latency_s) or not _same_held(opt, image, profile_map):
                return False
        return True


TWIN_TOLERANCE = 1e-9
"""Costs this close (relative) count as equal for twins: sums over different devices may differ in
the last bits; a plan's time moves by at most this fraction when its mirror image is used."""


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TWIN_TOLERANCE * max(abs(a), abs(b), 1e-30)


def _same_held(opt: StageOption, image: StageOption, profile_map: dict[int, int]) -> bool:
    """Whether ``image`` holds back the images of ``opt``'s profiles as ``opt`` holds them back."""
    if {profile_map[p] for p in opt.held} != set(image.held):
        return False
    for p, by_next in opt.held.items():
        other = image.held[profile_map[p]]
        if by_next.keys() != other.keys():
            return False
        if any(r != other[m][0] or not _close(t, other[m][1]) for m, (r, t) in by_next.items()):
            return False
    return True


def block_boundaries(cost: CostModel, max_blocks: int) -> tuple[int, ...]:
    """Cut points: every layer when the model is small, else about equal-FLOP blocks."""
    layers = cost.model.layers
    if len(layers) <= max_blocks:
        return tuple(range(len(layers) + 1))
    weights = [l.fwd_flops_per_sample + l.bwd_flops_per_sample + 1.0 for l in layers]
    total, cuts, acc = sum(weights), [0], 0.0
    for i, w in enumerate(weights[:-1]):
        acc += w
        if acc >= total * len(cuts) / max_blocks and len(cuts) < max_blocks:
            cuts.append(i + 1)
    return tuple(cuts) + (len(layers),)


def make_slots(cost: CostModel, max_slots_per_class: int) -> tuple[tuple[Slot, ...], tuple[Profile, ...]]:
    classes: dict[tuple, list[str]] = {}
    for dev in cost.cluster.devices:
        classes.setdefault((dev.model, dev.tflops, dev.memory_gb, dev.kind), []).append(dev.name)
    slots, profiles = [], []
    for c, names in enumerate(classes.values()):
        usable_bytes = cost.usable_memory_bytes(names[0])
        num_slots = min(len(names), max_slots_per_class)
        for k in range(num_slots):
            part = tuple(names[k * len(names) // num_slots : (k + 1) * len(names) // num_slots])
            by_signature: dict[tuple, list[str]] = {}
            for name in part:
                sig = tuple(round(x, 15) for x in cost.exchange_signature(name))
                by_signature.setdefault(sig, []).append(name)
            profiles += [Profile(slot=len(slots), devices=tuple(p)) for p in by_signature.values()]
            slots.append(Slot(device_class=c, devices=part, memory_bytes=usable_bytes))
    return tuple(slots), tuple(profiles)


def _powers_upto(n: int) -> list[int]:
    sizes, m = [], 1
    while m < n:
        sizes.append(m)
        m *= 2
    return sizes + [n]


def make_groups(slots: tuple[Slot, ...]) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The groups (prefix groups first) and how many of them are prefix groups."""
    by_class: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        by_class.setdefault(slot.device_class, []).append(i)
    groups: dict[tuple[int, ...], None] = {}
    counts = [sorted({0, 1, len(members)}) for members in by_class.values()]
    for choice in product(*counts):
        members = tuple(sorted(s for m, cls in zip(choice, by_class.values()) for s in cls[:m]))
        if members:
            groups[members] = None
    num_prefix = len(groups)
    for cls in by_class.values():
        for size in _powers_upto(len(cls)):
            for start in range(0, len(cls) - size + 1, size):
                groups[tuple(cls[start : start + size])] = None
    return tuple(groups), num_prefix


def _option(space: SearchSpace, start: int, end: int, micro_batch: int, group: int) -> StageOption | None:
    cost, slots = space.cost, space.slots
    members = space.groups[group]
    devices = tuple(d for s in members for d in slots[s].devices)
    if math.ceil(space.global_batch / micro_batch) < len(devices):
        return None  # fewer micro-batches than workers: someone would idle
    limit = in_flight(space.max_stages, space.global_batch, micro_batch, whole_model=cost.whole_model(start, end))
    held = stage_memory_bytes(cost.model, start, end, micro_batch, limit)
    if any(held > slots[s].memory_bytes for s in members):
        return None
    rate = {s: 1.0 / max(cost.per_sample_s(start, end, slots[s].devices[0], micro_batch), 1e-15) for s in members}
    total = sum(rate[s] * len(slots[s].devices) for s in members)
    choice = StageChoice(
        start, end, micro_batch, tuple((d, rate[s] / total) for s in members for d in slots[s].devices)
    )
    samples = token_samples(choice.shares, space.global_batch, micro_batch)
    if min(samples.values()) == 0:
        return None  # a member would get no token: that is a smaller group, listed on its own
    # A profile's first device gets the most tokens of the profile (ties go to earlier workers).
    cost_s = {
        p: stage_device_cost(cost, choice, prof.devices[0], samples[prof.devices[0]])
        for p, prof in enumerate(space.profiles)
        if prof.slot in members
    }
    if not all(math.isfinite(c) for c in cost_s.values()):
        return None  # the group cannot sync (no trees, no ring even over routes): left out
    return StageOption(
        choice=choice,
        group=group,
        slots=members,
        cost_s=cost_s,
        memory_bytes={s: held for s in members},
        fill_s=stage_fill_s(cost, choice),
        latency_s=stage_latency_s(cost, choice),
        held=_held(space, choice, samples, limit),
    )


def _held(space: SearchSpace, choice: StageChoice, samples: dict[str, int], limit: int) -> dict:
    """:attr:`StageOption.held` of ``choice``, for each micro-batch a next stage may have."""
    if choice.end >= space.cost.model.num_layers:
        return {}
    after = [
        m
        for m in space.micro_batches
        if chain_follows(choice.micro_batch, m, space.max_stages, space.global_batch, static=False)
    ]
    held = {}
    for p, prof in enumerate(space.profiles):
        device = prof.devices[0]
        if device not in samples:
            continue
        by_next = {m: held_terms(space.cost, choice, device, samples[device], limit, m) for m in after}
        if any(terms is not None for terms in by_next.values()):
            held[p] = {m: terms for m, terms in by_next.items() if terms is not None}
    return held


def _dominates(a: StageOption, b: StageOption) -> bool:
    return (
        a.fill_s <= b.fill_s
        and all(a.cost_s[p] <= b.cost_s[p] for p in a.cost_s)
        and all(a.memory_bytes[s] <= b.memory_bytes[s] for s in a.memory_bytes)
        and a.latency_s <= b.latency_s
        and all(_held_below(by_next, b.held.get(p, {})) for p, by_next in a.held.items())
    )


def _held_below(a: dict[int, tuple[int, float]], b: dict[int, tuple[int, float]]) -> bool:
    """Whether ``held`` terms ``a`` are no larger than ``b`` whatever the next stage."""
    return all(m in b and r <= b[m][0] and t <= b[m][1] for m, (r, t) in a.items())


def _pareto(options: list[StageOption]) -> list[StageOption]:
    kept: list[StageOption] = []
    for opt in sorted(options, key=lambda o: (sum(o.cost_s.values()), o.fill_s)):
        if not any(_dominates(k, opt) for k in kept):
            kept.append(opt)
    return kept


def build_space(
    cost: CostModel,
    global_batch: int,
    *,
    max_stages: int = 4,
    max_blocks: int = 8,
    max_slots_per_class: int = 4,
    max_micro_batches: int = 4,
    prune: bool = True,
    extra_micro_batches: tuple[int, ...] = (),
    groups: tuple | None = None,
) -> SearchSpace:
    """Every stage option of the model on the cost model's cluster (see module doc)."""
    slots, profiles = make_slots(cost, max_slots_per_class)
    groups, num_prefix = (groups, len(groups)) if groups is not None else make_groups(slots)
    space = SearchSpace(
        cost=cost,
        global_batch=global_batch,
        max_stages=max_stages,
        boundaries=block_boundaries(cost, max_blocks),
        slots=slots,
        profiles=profiles,
        groups=groups,
        options=[],
        num_prefix_groups=num_prefix,
    )
    cuts = space.boundaries
    space.micro_batches = tuple(
        sorted(set(micro_batch_options(global_batch, max_options=max_micro_batches)) | set(extra_micro_batches))
    )
    layer_params = [layer.params for layer in cost.model.layers]
    found: dict[tuple[int, int, int], list[StageOption]] = {}
    for i, start in enumerate(cuts):
        for end in cuts[i + 1 :]:
            if not stage_trainable(layer_params, start, end):
                continue  # the runtime cannot train a stage without parameters (spec.executable, rule 1)
            for g in range(len(space.groups)):
                options = [o for b in space.micro_batches if (o := _option(space, start, end, b, g)) is not None]
                found[start, end, g] = options
    # A stage's micro-batch sets the pace of an earlier stage its in-flight limit holds back: where
    # one ends at its start, options of other micro-batches are not compared.
    held_ends = {o.choice.end for options in found.values() for o in options if o.held}
    for (start, _, _), options in found.items():
        space.options += _pareto(options) if prune and start not in held_ends else options
    return space

"""What the worker runtime can execute: the one definition the planner's search space, ``felactl
check``, ``felactl launch`` and the worker at its start all use.

A plan that loads is well formed (``Plan.__post_init__``); this says whether the runtime can run
it. A plan runs one of three ways (:func:`execution`): data parallel (one stage), Fela's flexible
hybrid (several stages, ``schedule: tokens``, :mod:`felactl.agents.worker.flexible`) or static
pipelines (several stages, ``1f1b``/``gpipe``, :mod:`felactl.agents.worker.pipeline`). Rules:

1. **params**: every stage holds a trainable parameter. A stage of parameter-free layers only
   (``Flatten``, ``ReLU``) has nothing to train or synchronise, and the runtime's optimizer, sync
   and checkpoint code all assume a stage owns parameters; a first such stage cannot even run
   backward (its output needs no gradient). Such layers cost the planner nothing to leave in a
   neighbouring stage, so it never cuts them out alone (needs the model's per-layer counts).
2. **layers**: the stages cover exactly the model's layers (needs the model's layer count).
3. **micro-batch chain** (:func:`micro_batch_follows`): flexible, each stage's micro-batch is a
   multiple of the one before (a token of stage s joins ``b_s / b_{s-1}`` tokens of stage s-1);
   pipelines, one micro-batch size along the pipeline.
4. **tokens hold samples** (:func:`tokens_hold_samples`): flexible, the first-level tokens, rounded
   up to whole last-level tokens, are at most the global batch: an empty token trains on NaN.
5. **sync**: the sync mode runs the plan's execution (its row's ``executions`` in
   :mod:`felactl.spec.sync_modes`): flexible synchronises each stage by allreduce (sync bsp or
   tokens); pipelines synchronise each stage's replicas with bsp (tokens runs as bsp) or sdpipe,
   not wbsp; and it runs on the placement's backend (its row's ``runs_on_gpus``).
6. **pipeline slots**: with static pipelines, every device holds exactly one pipeline slot.
7. **one backend**: the placement puts every worker on a GPU (NCCL) or every one on a CPU slot
   (gloo). A job's process group has one backend, and on gloo the workers train on the CPU: a
   GPU in a mixed plan, priced at its own speed, would run at a core's. That backend is the
   plan's (:func:`plan_backend`), the one source the launcher and every worker read.

:func:`problems` lists every broken rule; :func:`check_executable` raises the first as a
:class:`~felactl.errors.SpecError` (exit 2). Pure: stdlib only, so the optimizer imports it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from felactl.errors import InputError, SpecError
from felactl.spec.cluster import DeviceKind
from felactl.spec.plan import Plan, Schedule, SyncMode
from felactl.spec.stages import micro_batch_counts
from felactl.spec.sync_modes import Execution, mode_names, modes_where, rescalable_mode_names, sync_support


@dataclass(frozen=True, slots=True)
class Problem:
    key: str
    """The plan's key path the problem is at (``stages[2].micro_batch``)."""
    reason: str


def execution(plan: Plan) -> Execution:
    if len(plan.stages) == 1:
        return Execution.SHARDED if plan.stages[0].shard else Execution.DATA_PARALLEL
    return Execution.FLEXIBLE if plan.schedule is Schedule.TOKENS else Execution.PIPELINE


def plan_backend(plan: Plan) -> str:
    """Rule 7's backend: ``nccl`` where the placement puts every worker on a GPU, else ``gloo`` (a
    CPU plan, or one that places nothing, stays on the CPU on a machine with a GPU). Every worker
    reads it from the plan it loads, so one started by hand trains where a launched one would."""
    on_gpus = bool(plan.placement) and all(p.kind is DeviceKind.CUDA for p in plan.placement)
    return "nccl" if on_gpus else "gloo"


def check_scaled_batch(sync: SyncMode, launched_batch: int, batch: int) -> None:
    """Refuse (InputError) a membership change that would change the global batch of a mode whose
    steps are counted in samples (its workers go at their own pace)."""
    if sync_support(sync).at_own_pace and batch != launched_batch:
        raise InputError(
            f"sync {sync.value} rescales with a fixed global batch ({launched_batch}); use --scaling-policy fixed-batch"
        )


def why_not_rescalable(plan: Plan) -> str | None:
    """Why a job of ``plan`` cannot change its members while it trains (None: it can): the one
    sentence the launch, ``--nnodes MIN:MAX`` and an elastic worker say."""
    if execution(plan) is Execution.DATA_PARALLEL and sync_support(plan.sync.mode).rescales_live:
        return None
    sharded = " sharded" if any(stage.shard for stage in plan.stages) else ""
    return (
        f"live rescaling covers data-parallel plans (one replicated stage) with sync {rescalable_mode_names()}; "
        f"this plan runs {len(plan.stages)}{sharded} stage(s) with sync {plan.sync.mode.value}"
    )


def survivors_keep_state(plan: Plan) -> bool:
    """Whether the workers that survive a failure in a job of ``plan`` hold every stage's state of
    one step, to leave for its restart (:mod:`felactl.agents.worker.survivors`): stages in lockstep
    (static pipelines, the flexible hybrid) each of which has replicas holding it whole. (A sharded
    stage's state is lost with any of its workers; a stage of one worker, with it. Data parallel
    rescales live, its peers' memory kept without a restart.)"""
    return (
        execution(plan) in (Execution.PIPELINE, Execution.FLEXIBLE)
        and not sync_support(plan.sync.mode).at_own_pace
        and all(len(stage.workers) >= 2 and not stage.shard for stage in plan.stages)
    )


def stage_trainable(layer_params: Sequence[int], start: int, end: int) -> bool:
    """Rule 1: layers ``[start, end)`` hold at least one trainable parameter."""
    return sum(layer_params[start:end]) > 0


def micro_batch_follows(before: int, after: int, *, static: bool) -> bool:
    """Rule 3: a stage with micro-batch ``after`` may follow one with ``before``."""
    return after == before if static else after % before == 0


def num_first_level_tokens(global_batch: int, micro_batch: int, num_workers: int) -> int:
    """Fela's ``n1 = max(global_batch / b1, N)``: at least one token per worker."""
    return max(math.ceil(global_batch / micro_batch), num_workers)


def num_first_tokens(global_batch: int, first_micro_batch: int, num_first_workers: int, last_micro_batch: int) -> int:
    """First-level tokens of a flexible plan: ``n1`` rounded up so the last level's tokens are whole."""
    weight = last_micro_batch // first_micro_batch
    return -(-num_first_level_tokens(global_batch, first_micro_batch, num_first_workers) // weight) * weight


def tokens_hold_samples(
    global_batch: int, first_micro_batch: int, num_first_workers: int, last_micro_batch: int
) -> bool:
    """Rule 4: every first-level token gets at least one sample of the global batch (False where
    the last micro-batch is not a multiple of the first: rule 3 refuses that already)."""
    if last_micro_batch % first_micro_batch:
        return False
    return num_first_tokens(global_batch, first_micro_batch, num_first_workers, last_micro_batch) <= global_batch


def problems(plan: Plan, layer_params: Sequence[int] | None = None) -> list[Problem]:
    """Every rule the plan breaks; ``layer_params``: the model's trainable parameters per layer
    (from its profile or the built model), without which rules 1 and 2 are not checked."""
    found = [] if layer_params is None else _model_problems(plan, layer_params)
    if len({p.kind for p in plan.placement}) > 1:
        found.append(
            Problem(
                "placement",
                "the plan puts workers on GPUs and on CPU slots, but a job runs on one backend (NCCL on "
                "GPUs, gloo on CPU slots, where its GPU workers would train on the CPU): plan for one "
                "kind (felactl plan --devices)",
            )
        )
    elif plan_backend(plan) == "nccl" and not sync_support(plan.sync.mode).runs_on_gpus:
        found.append(
            Problem(
                "sync.mode",
                f"sync {plan.sync.mode.value} runs on CPU slots (gloo) only, but the plan puts its workers on "
                f"GPUs: on GPUs sync {mode_names(modes_where(lambda row: row.runs_on_gpus))} runs",
            )
        )
    how = execution(plan)
    if how is Execution.FLEXIBLE:
        found += _flexible_problems(plan)
    elif how is Execution.PIPELINE:
        found += _pipeline_problems(plan)
    elif how is Execution.SHARDED:
        found += _sharded_problems(plan)
    else:
        found += _mode_problems(plan, how)
    return found


def check_executable(plan: Plan, layer_params: Sequence[int] | None = None, where: str = "plan") -> None:
    """Raise the first of :func:`problems` as a SpecError naming ``where`` and the key."""
    found = problems(plan, layer_params)
    if found:
        raise SpecError(where, found[0].key, found[0].reason)


def _model_problems(plan: Plan, layer_params: Sequence[int]) -> list[Problem]:
    if plan.num_layers != len(layer_params):
        return [
            Problem(
                f"stages[{len(plan.stages) - 1}].layer_end",
                f"the stages cover {plan.num_layers} layers but model {plan.model.name!r} has {len(layer_params)}",
            )
        ]
    return [
        Problem(
            f"stages[{s}]",
            f"layers {st.layer_start}..{st.layer_end - 1} hold no trainable parameter: "
            "a stage needs one (put them in a neighbouring stage)",
        )
        for s, st in enumerate(plan.stages)
        if not stage_trainable(layer_params, st.layer_start, st.layer_end)
    ]


_SHAPES = {
    Execution.DATA_PARALLEL: "data-parallel plans (one stage)",
    Execution.FLEXIBLE: "flexible plans (schedule tokens, several stages)",
    Execution.PIPELINE: "static pipelines (schedule 1f1b or gpipe, several stages)",
    Execution.SHARDED: "sharded stages (shard: true)",
}


def _mode_problems(plan: Plan, how: Execution) -> list[Problem]:
    """Rule 5: the plan's sync mode runs its execution."""
    mode = plan.sync.mode
    runs = sync_support(mode).executions
    if how in runs:
        return []
    others = mode_names(modes_where(lambda row: how in row.executions))
    its_own = " and ".join(shape for e, shape in _SHAPES.items() if e in runs)
    return [
        Problem(
            "sync.mode",
            f"sync {mode.value} cannot run {_SHAPES[how]}, which synchronise with sync {others}; "
            f"sync {mode.value} runs {its_own}",
        )
    ]


def _flexible_problems(plan: Plan) -> list[Problem]:
    found = _mode_problems(plan, Execution.FLEXIBLE)
    found += [
        Problem(
            f"stages[{s}].shard",
            "token scheduling gives workers unequal micro-batch counts, which a sharded stage's "
            "workers cannot run (each gathers every block with the others): use schedule 1f1b or gpipe",
        )
        for s, stage in enumerate(plan.stages)
        if stage.shard
    ]
    stages = plan.stages
    for s in range(1, len(stages)):
        if not micro_batch_follows(stages[s - 1].micro_batch, stages[s].micro_batch, static=False):
            found.append(
                Problem(
                    f"stages[{s}].micro_batch",
                    f"must be a multiple of stages[{s - 1}].micro_batch ({stages[s - 1].micro_batch}) "
                    f"for token scheduling, got {stages[s].micro_batch}",
                )
            )
    if found:
        return found
    first, last = stages[0], stages[-1]
    if not tokens_hold_samples(plan.global_batch, first.micro_batch, len(first.workers), last.micro_batch):
        n1 = num_first_tokens(plan.global_batch, first.micro_batch, len(first.workers), last.micro_batch)
        found.append(
            Problem(
                "global_batch",
                f"{plan.global_batch} samples cannot fill {n1} first-level tokens "
                f"(micro-batches {first.micro_batch}..{last.micro_batch} on "
                f"{len(first.workers)} first-stage workers): some would be empty",
            )
        )
    return found


def _sharded_problems(plan: Plan) -> list[Problem]:
    return _mode_problems(plan, Execution.SHARDED) + _shard_problems(plan, 0)


def _shard_problems(plan: Plan, s: int) -> list[Problem]:
    """A sharded stage's workers gather each block's weights together, in every micro-batch's
    forward and backward: two or more of them, each running as many micro-batches per step."""
    stage = plan.stages[s]
    if len(stage.workers) < 2:
        return [Problem(f"stages[{s}].shard", "a stage of one worker has nothing to shard over: replicate it")]
    shares = [w.share for w in stage.workers]
    counts = dict(zip(stage.devices, micro_batch_counts(plan.global_batch, shares, stage.micro_batch)))
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{d} {n}" for d, n in counts.items())
        return [
            Problem(
                f"stages[{s}].workers",
                f"the workers of a sharded stage run as many micro-batches per step as each other "
                f"(each gathers every block's weights with the others), but these shares give {shown}: "
                "give them shares of equal micro-batch counts",
            )
        ]
    return []


def _pipeline_problems(plan: Plan) -> list[Problem]:
    found = _mode_problems(plan, Execution.PIPELINE)
    for s, stage in enumerate(plan.stages):
        if stage.shard and sync_support(plan.sync.mode).at_own_pace:
            found.append(
                Problem(
                    f"stages[{s}].shard",
                    f"sync {plan.sync.mode.value} averages whole replicas at each worker's own pace; "
                    "a sharded stage's workers step together: use sync bsp or tokens",
                )
            )
        elif stage.shard:
            found += _shard_problems(plan, s)
    first = plan.stages[0].micro_batch
    for s, stage in enumerate(plan.stages[1:], start=1):
        if not micro_batch_follows(first, stage.micro_batch, static=True):
            found.append(
                Problem(
                    f"stages[{s}].micro_batch",
                    f"must equal stages[0].micro_batch ({first}): a static "
                    f"pipeline runs one micro-batch size, got {stage.micro_batch}",
                )
            )
    slots = Counter(d for pipe in plan.pipelines for d in pipe)
    for d, device in enumerate(plan.devices):
        if slots[device] != 1:
            found.append(
                Problem(
                    f"devices[{d}]", f"device {device!r} must hold exactly one pipeline slot, holds {slots[device]}"
                )
            )
    return found

"""``felactl export RUN``: a run's checkpoint as one plain ``state_dict`` of the whole model.

Each stage's checkpoint holds the ``state_dict`` of its slice of the model's ``nn.Sequential``,
which keeps the whole model's child names (``"3.weight"``), so the stages' dicts merge into the
whole model's. The merged keys and shapes are checked against the model the plan names, built
afresh, so the file loads with ``load_state_dict(strict=True)`` on what the user's function returns.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from felactl import models
from felactl.errors import InputError
from felactl.fsutil import atomic_write, check_output_file
from felactl.launcher.resume import load_stage, pick_checkpoint
from felactl.launcher.rundir import RunDir
from felactl.spec import Plan

DEFAULT_OUTPUT_NAME = "model.pt"
"""Where an export goes without ``-o``: ``runs/<id>/model.pt`` (each export replaces it)."""
NAMES_SHOWN = 5
"""How many missing or unexpected keys an error names before it says how many more there are."""


@dataclass(frozen=True)
class ExportResult:
    run: str
    step: int
    data_position: int
    checkpoint: Path
    output: Path
    num_stages: int
    num_tensors: int
    num_params: int

    def to_dict(self) -> dict:
        return {**asdict(self), "checkpoint": str(self.checkpoint), "output": str(self.output)}


def export_model(run: str, runs_root: Path, output: Path | None = None, step: int | None = None) -> ExportResult:
    """Merge the stages of the run's newest complete checkpoint (or of ``step``) and write the
    whole model's ``state_dict`` to ``output`` (default ``runs/<id>/model.pt``) atomically."""
    if output is not None:
        check_output_file(output)  # before reading checkpoints that may take long
    rundir = RunDir.find(run, root=runs_root)
    chosen = pick_checkpoint(rundir, step)
    state = merge_stages(chosen.directory, chosen.plan)
    reference = models.build(chosen.plan.model.source, chosen.plan.model.config).model
    check_state_dict(state, reference.state_dict(), where=str(chosen.directory))
    target = atomic_write(
        output if output is not None else rundir.path / DEFAULT_OUTPUT_NAME, lambda f: torch.save(state, f)
    )
    return ExportResult(
        run=rundir.run_id,
        step=chosen.step,
        data_position=int(chosen.stage0["data_position"]),
        checkpoint=chosen.directory,
        output=target,
        num_stages=len(chosen.plan.stages),
        num_tensors=len(state),
        num_params=sum(p.numel() for p in reference.parameters()),  # a tied weight once, as the model has it
    )


def merge_stages(directory: Path, plan: Plan) -> OrderedDict[str, torch.Tensor]:
    """Every stage's ``model`` dict in one, stage after stage (with torch's ``_metadata``, the
    modules' state versions, so a load treats the tensors as the stages' modules wrote them).
    A key two stages hold is a weight they share (a tied embedding and head, each stage holding a
    copy): kept once where the copies are equal, refused where they differ."""
    merged: OrderedDict[str, torch.Tensor] = OrderedDict()
    metadata: OrderedDict[str, dict] = OrderedDict()
    for s in range(len(plan.stages)):
        stage = load_stage(directory / f"stage{s}.pt", tensors=("model",))["model"]
        differ = [key for key in stage if key in merged and not torch.equal(stage[key], merged[key])]
        if differ:
            raise InputError(
                f"{directory / f'stage{s}.pt'}: {_names(differ)} also in an earlier stage, with other values"
            )
        merged.update(stage)
        metadata.update(getattr(stage, "_metadata", {}))
    if metadata:
        merged._metadata = metadata  # type: ignore[attr-defined]
    return merged


def check_state_dict(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], where: str) -> None:
    """``state`` has exactly ``reference``'s keys, each with its shape; else an InputError that
    names the missing, unexpected and misshapen keys."""
    missing = [key for key in reference if key not in state]
    unexpected = [key for key in state if key not in reference]
    misshapen = [
        f"{key} {tuple(state[key].shape)} (model: {tuple(reference[key].shape)})"
        for key in reference
        if key in state and state[key].shape != reference[key].shape
    ]
    problems = [
        f"{label} {_names(keys)}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen))
        if keys
    ]
    if problems:
        raise InputError(f"{where}: the checkpoint does not fit the plan's model: {'; '.join(problems)}")


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:NAMES_SHOWN])
    return shown + (f" and {len(keys) - NAMES_SHOWN} more" if len(keys) > NAMES_SHOWN else "")

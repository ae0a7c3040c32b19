"""Checks that need two files at once: a plan against the cluster and the model it was made for."""

from __future__ import annotations

from felactl.errors import SpecError
from felactl.spec.cluster import ClusterSpec
from felactl.spec.model import ModelSpec
from felactl.spec.plan import Plan


def check_plan_against_cluster(plan: Plan, cluster: ClusterSpec, where: str = "plan") -> None:
    known = cluster.device_names
    for i, dev in enumerate(plan.devices):
        if not cluster.has_device(dev):
            sample = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
            raise SpecError(where, f"devices[{i}]",
                            f"device {dev!r} is not in cluster {cluster.name!r} (it has: {sample})")


def check_plan_against_model(plan: Plan, model: ModelSpec, where: str = "plan") -> None:
    if plan.num_layers != model.num_layers:
        raise SpecError(where, f"stages[{len(plan.stages) - 1}].layer_end",
                        f"the stages cover {plan.num_layers} layers but model {model.name!r} has {model.num_layers}")

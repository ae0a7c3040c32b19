"""The three file formats of felactl (Cluster, Model, Plan) as frozen dataclasses, with YAML I/O."""

from felactl.spec.checks import check_plan_against_cluster, check_plan_against_model
from felactl.spec.cluster import ClusterSpec, Device, DeviceKind, Link, LinkDefault, LinkType, Node
from felactl.spec.io import dump_yaml, from_dict, load, load_cluster, load_model, load_plan, save, to_dict
from felactl.spec.model import Layer, LayerTiming, ModelSpec, SyncTiming
from felactl.spec.plan import (Collective, ModelRef, Placement, Plan, Prediction, Schedule, SolverInfo, Stage,
                               StageWorker, SyncMode, SyncSpec, Training, Tree, data_parallel_plan,
                               placements_from)

__all__ = [
    "ClusterSpec", "Collective", "Device", "DeviceKind", "Layer", "LayerTiming", "Link", "LinkDefault", "LinkType",
    "ModelRef", "ModelSpec", "Node", "Plan", "Prediction", "Schedule", "SolverInfo", "Stage",
    "StageWorker", "SyncMode", "Placement", "placements_from", "SyncSpec", "SyncTiming", "Training", "Tree", "check_plan_against_cluster",
    "check_plan_against_model", "data_parallel_plan", "dump_yaml", "from_dict", "load", "load_cluster", "load_model",
    "load_plan", "save", "to_dict",
]

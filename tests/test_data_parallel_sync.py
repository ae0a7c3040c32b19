"""The measured gradient sync of a data-parallel step (felactl.profiling.data_parallel): real
processes, one per slot, DDP over gloo."""

import dataclasses

import psutil
import pytest

from felactl.errors import ProfilingError
from felactl.profiling.data_parallel import Slot, measure_data_parallel_sync
from felactl.spec import SyncTiming
from felactl.spec.codec import decode, encode
from tests.planner_fixtures import calibrated_exposed_sync_s, two_cpu_slot_cluster

pytestmark = pytest.mark.multiprocess

SLOTS = [Slot("vm-cpu0", (0,)), Slot("vm-cpu1", (1,))]
QUICK = {"min_pairs": 2, "max_pairs": 6, "per_block": 6, "warmup": 1, "cluster": "here"}


def _no_children_left() -> bool:
    """No slot process left (multiprocessing's own resource tracker may stay: it is shared)."""
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                left.append(child)
        except psutil.Error:  # exiting right now
            pass
    return not left


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """``felactl profile --model mlp --config hidden=1024 --cluster`` of two CPU slots: mlp
    {hidden 1024, depth 4} has 13 MB of gradients, whose sync the profile times at 16 samples a
    slot. The CLI's result, the cluster file, the model profile's path."""
    from typer.testing import CliRunner

    from felactl.cli.main import app

    tmp_path = tmp_path_factory.mktemp("profiled")
    cluster = two_cpu_slot_cluster(tmp_path)
    args = [
        "profile",
        "--model",
        "mlp",
        "--config",
        "hidden=1024",
        "--batch-sizes",
        "8,16",
        "--repetitions",
        "2",
        "--device",
        "cpu",
        "--cluster",
        str(cluster),
        "-o",
        str(tmp_path / "model.yaml"),
        "--json",
    ]
    return CliRunner().invoke(app, args), cluster, tmp_path / "model.yaml"


def test_sync_grows_with_the_gradients_and_no_process_is_left(profiled):
    """A sync of 8 KB of gradients, timed here, against the 13 MB of ``profiled`` (the same
    model, 16 samples a slot): the larger takes more than 1 ms longer where both were measured."""
    from felactl.spec import load_model

    result, _, model_path = profiled
    assert result.exit_code == 0, result.output
    (big,) = load_model(model_path).data_parallel_sync
    small = measure_data_parallel_sync("mlp", {"hidden": 8, "depth": 1}, 16, SLOTS, **QUICK)  # 8 KB
    assert small.devices == ("vm-cpu0", "vm-cpu1") and small.backend == "gloo" and small.micro_batch == 16
    assert small.cluster == "here"
    assert big.backend == "gloo" and big.micro_batch == 16
    assert_measured_or_hidden_in_noise(big, more_than_ms=1.0)  # gloo moves 13 MB in no less than a few ms here
    if big.measured and small.measured:
        assert big.sync_ms > small.sync_ms + 1.0, (big, small)
    assert _no_children_left()


def assert_measured_or_hidden_in_noise(timing: SyncTiming, more_than_ms: float) -> None:
    """A sync of more than ``more_than_ms`` was measured, or, on a machine too busy to tell it
    apart, is recorded as not measured with noise of that size (never as 0)."""
    assert timing.sync_ms != 0.0, timing
    if timing.measured:
        assert timing.sync_ms > more_than_ms and timing.noise_ms < timing.sync_ms, timing
    else:  # its noise is recorded instead (how large depends on the load of the moment)
        assert timing.sync_ms is None and timing.noise_ms > 0, timing


def test_a_slot_that_fails_is_named_and_the_others_are_stopped():
    with pytest.raises(ProfilingError, match="slot [01] failed: .*no-such-model"):
        measure_data_parallel_sync("no-such-model", {}, 4, SLOTS, **QUICK)
    assert _no_children_left()
    # only slot 1 fails (a core this machine lacks), while slot 0 waits for it at the rendezvous
    with pytest.raises(ProfilingError, match="slot 1 failed: OSError"):
        measure_data_parallel_sync("mlp", {}, 4, [SLOTS[0], Slot("vm-cpu9", (4096,))], **QUICK)
    assert _no_children_left()


def test_a_slot_frees_its_ddp_before_it_destroys_the_group(tmp_path, monkeypatch):
    """A slot's DDP must be gone before its gloo group is destroyed: else the DDP's dealloc frees
    the group's last reference holding the GIL, while the group's destructor joins a thread that
    may need the GIL to free the last collective's tensors (torch issue 56297). That hung 1 slot
    process in 15 right after its last barrier, and the profile waited 360 s for it (CI, stop 40).
    Checked in this process, on a group of one: the order, not the race."""
    import weakref

    import torch.distributed as dist

    from felactl.parallel import ddp as ddp_module
    from felactl.profiling import data_parallel

    replicas, alive_at_destroy = [], []
    wrap, destroy = ddp_module.wrap_replica, dist.destroy_process_group

    def wrap_and_watch(*args, **kwargs):
        replica = wrap(*args, **kwargs)
        replicas.append(weakref.ref(replica))
        return replica

    def watched_destroy(*args, **kwargs):
        alive_at_destroy.append([r() is not None for r in replicas])
        destroy(*args, **kwargs)

    monkeypatch.setattr(ddp_module, "wrap_replica", wrap_and_watch)
    monkeypatch.setattr(dist, "destroy_process_group", watched_destroy)
    monkeypatch.setattr(data_parallel, "pin_to_cores", lambda cores, strict: None)  # this process's threads stay
    pairs = data_parallel._time_steps(
        0, 1, str(tmp_path / "store"), "gloo", "mlp", {"hidden": 8, "depth": 1}, 4, [], (1, 1), 2, 1
    )
    assert len(pairs) == 1 and not dist.is_initialized()
    assert alive_at_destroy == [[False]], "the DDP is freed while its group is still registered"


def test_reap_passes_over_a_process_that_never_started():
    """A slot whose start failed (the one before it started) is passed over, so that the start's
    own error is what the caller sees, not multiprocessing's 'can only join a started process'."""
    import multiprocessing

    from felactl.profiling.data_parallel import reap

    ctx = multiprocessing.get_context("spawn")
    started, never = ctx.Process(target=int, daemon=True), ctx.Process(target=int, daemon=True)
    started.start()
    reap([started, never], grace_s=10.0)
    assert started.exitcode == 0 and never.exitcode is None


def test_a_sync_timing_round_trips_and_needs_a_group():
    timing = SyncTiming(cluster="c", devices=("a", "b"), backend="gloo", micro_batch=16, sync_ms=6.2)
    assert decode(SyncTiming, encode(timing), "test") == timing
    with pytest.raises(Exception, match="two or more distinct devices"):
        SyncTiming(cluster="c", devices=("a",), backend="gloo", micro_batch=16, sync_ms=1.0)


def test_profile_model_with_cluster_measures_the_slots_sync_and_plan_charges_it(profiled):
    from felactl.optimizer.cost import CostModel
    from felactl.spec import load_cluster, load_model

    result, cluster, model_path = profiled
    assert result.exit_code == 0, result.output
    model = load_model(model_path)
    (sync,) = model.data_parallel_sync
    assert sync.devices == ("cpu0", "cpu1") and sync.micro_batch == 16 and sync.cluster == "here"
    assert_measured_or_hidden_in_noise(sync, more_than_ms=1.0)
    cost = CostModel(load_cluster(cluster), model)
    charged, expected = calibrated_exposed_sync_s(cost, sync)
    assert charged == pytest.approx(expected)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--node-name", "elsewhere"], "has no node named 'elsewhere'"),
        (["--device", "cuda"], "--cluster profiles on this machine's CPU slots"),
        (["--cores-of-cpu1", "4096"], "slot cpu1 is pinned to core(s) 4096, which this machine does not have"),
        (["--worker-batch", "4", "--no-cluster"], "--worker-batch is for --cluster"),
    ],
)
def test_profile_model_with_a_cluster_it_cannot_use_is_refused(tmp_path, extra, message):
    from typer.testing import CliRunner

    from felactl.cli.main import app

    cores = (0, 4096) if "--cores-of-cpu1" in extra else (0, 1)
    cluster = ["--cluster", str(two_cpu_slot_cluster(tmp_path, cores))] if "--no-cluster" not in extra else []
    extra = [a for a in extra if a not in ("--cores-of-cpu1", "4096", "--no-cluster")]
    args = ["profile", "--model", "mlp", *cluster, "-o", str(tmp_path / "m.yaml"), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "m.yaml").exists()


def test_profile_with_cluster_refuses_a_user_model_that_brings_no_data(tmp_path):
    """Its companions have nothing to train on (they used to die, and the profile with them)."""
    from typer.testing import CliRunner

    from felactl.cli.main import app

    args = [
        "profile",
        "--model",
        "tests.test_model_profile:user_net",
        "--input-shape",
        "2,3,3",
        "--cluster",
        str(two_cpu_slot_cluster(tmp_path)),
        "-o",
        str(tmp_path / "m.yaml"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "brings no data" in result.output, result.output
    assert not (tmp_path / "m.yaml").exists()


def test_a_cluster_profiled_on_another_machine_is_used_with_a_warning(tmp_path, caplog):
    from felactl.profiling.in_situ import local_cpu_slots
    from felactl.spec import load_cluster

    cluster = load_cluster(two_cpu_slot_cluster(tmp_path))
    assert [d.name for d in local_cpu_slots(cluster)] == ["cpu0", "cpu1"] and not caplog.records
    elsewhere = dataclasses.replace(cluster, nodes=(dataclasses.replace(cluster.nodes[0], hostname="far.example"),))
    assert [d.name for d in local_cpu_slots(elsewhere)] == ["cpu0", "cpu1"]
    assert "profiled on far.example, not on this machine" in caplog.text

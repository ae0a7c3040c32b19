"""A sharded stage's checkpoint: each worker writes its own shards (torch.distributed.checkpoint),
none gathers the whole stage (a stage is sharded because no device holds it whole); the stage
file names the shards; a restore takes each worker's shards back, and an export or a plan that
cuts the model elsewhere reads them whole. Two real gloo processes."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from felactl.agents.worker.checkpoint import drop_other_shards, restore_stage, save_checkpoint, save_shards
from felactl.launcher.resume import load_stage
from felactl.parallel import fsdp
from felactl.parallel.fsdp import SHARDS
from felactl.profiling.data_parallel import reap

pytestmark = pytest.mark.multiprocess

LAYERS = (0, 3)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _sharded(group) -> tuple[nn.Module, torch.optim.Optimizer]:
    from felactl.parallel.fsdp import shard

    module = shard(_model(), group, torch.device("cpu"), units=["0"])
    return module, torch.optim.AdamW(module.parameters(), lr=0.01)


def _trained(group, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    module, optimizer = _sharded(group)
    for step in range(steps):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        module(inputs).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def _local_state(module, optimizer) -> dict[str, torch.Tensor]:
    """This worker's shards of the parameters and of AdamW's moments, by name."""
    from felactl.parallel.fsdp import local

    names = {id(p): n for n, p in module.named_parameters()}
    state = {n: local(p).detach().clone() for n, p in module.named_parameters()}
    for param, moments in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{names[id(param)]}.{key}"] = local(moments[key]).clone()
    return state


def _worker(rank: int, port: int, run_dir: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        group = dist.new_group([0, 1])
        module, optimizer = _trained(group)
        stage_file = Path(run_dir) / "step000002" / "stage0.pt"
        if rank == 0:  # a crashed attempt's leftovers
            (stage_file.parent / "stage0.deadbeef.shards").mkdir(parents=True)
            (stage_file.parent / "stage0.deadbeef.shards" / "__7_0.distcp").write_bytes(b"junk")
        named = []
        for _ in range(2):  # the same step written twice, as a restart that redoes it writes it
            shards = save_shards(stage_file, module, optimizer)
            named.append(shards)
            if shards is not None:  # the stage's first worker names them, as the trainer does
                save_checkpoint(stage_file, state=None, step=2, data_position=8, layers=LAYERS, extra={SHARDS: shards})
                drop_other_shards(stage_file, keep=shards)
            dist.barrier()
        whole = {n: p.full_tensor() for n, p in module.named_parameters()}
        whole_optimizer = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))

        fresh, fresh_optimizer = _sharded(group)  # other weights than the trained ones: reads must change them
        with mock.patch.object(fsdp, "read_whole", side_effect=AssertionError("read whole")):
            restore_stage(stage_file.parent, 0, LAYERS, fresh, fresh_optimizer, {})  # each its shards, no more
        restored = _local_state(fresh, fresh_optimizer)
        saved = _local_state(module, optimizer)
        same = all(torch.equal(restored[k], saved[k]) for k in saved) and restored.keys() == saved.keys()

        unwritable = Path(run_dir) / "a-file"
        if rank == 0:
            unwritable.write_text("not a directory")
        dist.barrier()
        try:
            save_shards(unwritable / "step000004" / "stage0.pt", module, optimizer)
            failure = None
        except OSError as exc:
            failure = str(exc)
        import torch.distributed.checkpoint as dcp

        other = dcp.CheckpointException("save", {0: (ValueError("not the disk"), traceback.StackSummary())})
        with mock.patch.object(dcp, "save", side_effect=other):
            try:
                save_shards(stage_file, module, optimizer)
                other_failure = None
            except Exception as exc:  # noqa: BLE001 - DCP's own is a BaseException: the worker would miss it
                other_failure = f"{type(exc).__name__}: {exc}"
        found = io.BytesIO()  # tensors as bytes: a queue shares a tensor's memory, gone with this process
        found_state = {"same": same, "failure": failure, "whole": whole, "optimizer": whole_optimizer, "named": named}
        found_state["other_failure"] = other_failure
        torch.save(found_state, found)
        results.put((rank, found.getvalue()))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Two workers train a sharded stage 2 steps, checkpoint it (twice, over a stale partial
    write), restore it into a fresh sharded stage and try a checkpoint where none can be written."""
    run_dir = tmp_path_factory.mktemp("sharded")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, str(run_dir), results)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = {rank: torch.load(io.BytesIO(found)) for rank, found in (results.get(timeout=60) for _ in range(2))}
    finally:
        reap(procs, grace_s=10.0)
    return run_dir / "step000002", got


def test_each_worker_writes_its_own_shards_and_the_stage_file_names_them(written):
    directory, got = written
    stage = torch.load(directory / "stage0.pt", weights_only=False)
    assert "model" not in stage and "optimizer" not in stage  # nobody gathered the stage to write it
    assert stage["step"] == 2 and stage["layers"] == list(LAYERS)
    # each write a directory of its own, named by the stage's first worker alone (it writes the file)
    assert got[1]["named"] == [None, None] and len(set(got[0]["named"])) == 2
    assert stage[SHARDS] == got[0]["named"][-1]
    # the first write's and the crashed one's directories are gone
    assert [p.name for p in directory.glob("stage0.*.shards")] == [stage[SHARDS]]
    shards = sorted((directory / stage[SHARDS]).glob("*.distcp"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
    sizes = [p.stat().st_size for p in shards]
    assert max(sizes) < 0.7 * sum(sizes), f"each worker writes about half the stage: {sizes}"


def test_a_restore_gives_each_worker_its_shards_of_the_weights_and_the_optimizer_back(written):
    _, got = written
    assert got[0]["same"] and got[1]["same"]


def test_an_export_reads_the_shards_whole(written):
    directory, got = written
    whole = load_stage(directory / "stage0.pt")
    assert whole["model"].keys() == got[0]["whole"].keys()
    assert all(torch.equal(whole["model"][k], v) for k, v in got[0]["whole"].items())
    assert load_stage(directory / "stage0.pt", tensors=()).keys() == torch.load(directory / "stage0.pt").keys()
    weights_only = load_stage(directory / "stage0.pt", tensors=("model",))  # an export's read
    assert "optimizer" not in weights_only and weights_only["model"].keys() == whole["model"].keys()
    moments = got[0]["optimizer"]["state"]["0.weight"]
    assert torch.equal(whole["optimizer"]["state"]["0.weight"]["exp_avg"], moments["exp_avg"])


def test_a_replicated_stage_of_another_plan_restores_from_the_shards(written):
    """A re-plan that replicates the stage (or cuts the model elsewhere) reads the shards whole."""
    directory, got = written
    module = _model()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.5)
    restore_stage(directory, 0, LAYERS, module, optimizer, {})
    assert all(torch.equal(p, got[0]["whole"][n]) for n, p in module.named_parameters())
    assert optimizer.param_groups[0]["lr"] == 0.01
    moments = optimizer.state[module[0].weight]
    assert torch.equal(moments["exp_avg_sq"], got[0]["optimizer"]["state"]["0.weight"]["exp_avg_sq"])


def test_shards_the_storage_cannot_take_are_a_storage_error_on_every_worker(written):
    """Every worker of the stage hears it (the trainer then says so and trains on), none hangs."""
    _, got = written
    assert got[0]["failure"] and got[1]["failure"]
    assert "writing the stage's shards failed" in got[0]["failure"]


def test_a_failure_of_dcp_not_the_disks_is_an_exception_the_worker_handles(written):
    """``CheckpointException`` is a BaseException: past the worker's ``except Exception`` it would
    skip the failure's handling (its peers told, its state left). It comes out a RuntimeError."""
    _, got = written
    for rank in (0, 1):
        assert (
            got[rank]["other_failure"] == "RuntimeError: writing the stage's shards failed: ValueError('not the disk')"
        )


def test_unreadable_shards_are_one_line_naming_them(written, tmp_path):
    directory, _ = written
    import shutil

    broken = tmp_path / "step000002"
    shutil.copytree(directory, broken)
    name = torch.load(broken / "stage0.pt", weights_only=False)[SHARDS]
    from felactl.errors import InputError

    shard = broken / name / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])  # DCP said only "failed reading zip archive"
    with pytest.raises(InputError, match=r"a shard is cut short \(1000 of \d+ bytes\): '.*__0_0.distcp'"):
        load_stage(broken / "stage0.pt")
    shutil.copy(directory / name / "__0_0.distcp", shard)
    (broken / name / "__1_0.distcp").unlink()
    missing = rf"{name}: the stage's shards are not readable \(FileNotFoundError: .*a shard is missing: .*__1_0.distcp"
    with pytest.raises(InputError, match=missing):
        load_stage(broken / "stage0.pt")
    with pytest.raises(InputError, match=missing):
        module = _model()
        restore_stage(broken, 0, LAYERS, module, torch.optim.AdamW(module.parameters()), {})
    (broken / name / ".metadata").unlink()  # DCP logged two tracebacks looking for another
    with pytest.raises(InputError, match=r"no \.metadata: the shards were not all written: .*\.metadata"):
        load_stage(broken / "stage0.pt")


def test_a_stage_cut_elsewhere_reads_only_its_own_weights_of_the_shards(written):
    """A plan whose first stage holds layer 0 alone reads layer 0's weights and optimizer state
    of the shards, not the rest (a 7B stage's workers would each read every stage whole)."""
    directory, got = written
    first = nn.Sequential(nn.Linear(8, 16))  # layers [0, 1) of the model: keys 0.weight, 0.bias
    optimizer = torch.optim.AdamW(first.parameters())
    with mock.patch.object(fsdp, "read_whole", wraps=fsdp.read_whole) as read:
        restore_stage(directory, 0, (0, 1), first, optimizer, {})
    (call,) = read.call_args_list
    asked = call.args[1]
    assert "model.0.weight" in asked and "optimizer.state.0.bias" in asked
    assert not any(key.startswith(("model.2", "optimizer.state.2")) for key in asked)
    assert torch.equal(first[0].weight, got[0]["whole"]["0.weight"])
    assert torch.equal(optimizer.state[first[0].bias]["exp_avg"], got[0]["optimizer"]["state"]["0.bias"]["exp_avg"])


def test_a_resume_finds_a_lost_or_cut_shard_before_it_starts_the_workers(written, tmp_path):
    """Every file the shards' .metadata names must be there, as long as what is read of it: a
    resume says which is not before the workers start (each would build the model first)."""
    import shutil

    from felactl.errors import InputError
    from felactl.launcher.resume import Checkpoint, check_stage_shards
    from felactl.spec import ModelRef, data_parallel_plan

    directory, _ = written
    broken = tmp_path / "step000002"
    shutil.copytree(directory, broken)
    plan = data_parallel_plan(
        model=ModelRef(name="m", source="m:job"), num_layers=3, devices=["cpu0", "cpu1"], global_batch=8, micro_batch=4
    )
    stage0 = load_stage(broken / "stage0.pt", tensors=())
    chosen = Checkpoint(step=2, directory=broken, plan=plan, plan_path=tmp_path / "plan.yaml", stage0=stage0)
    check_stage_shards(chosen)  # whole
    shard = broken / stage0[SHARDS] / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(InputError, match=r"a shard is cut short \(100 of \d+ bytes\): '.*__1_0.distcp'"):
        check_stage_shards(chosen)
    shard.unlink()
    with pytest.raises(InputError, match=r"a shard is missing: '.*__1_0.distcp'.*--step K"):
        check_stage_shards(chosen)

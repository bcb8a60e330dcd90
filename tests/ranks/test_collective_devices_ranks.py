"""Every collective of a training step is handed tensors on the step's compute device, under every plan family.

On a GPU the step's collectives run on NCCL, which refuses host (CPU) tensors. On CPU, where every tensor is
a CPU tensor, `tests.helpers.collective_devices` tells them apart by where each tensor was made, and records
every collective handed one made on the host. One rank with `OMNI_ALWAYS_COLLECT=1` runs the collectives a
one-rank world would skip, as the GPU check does on a one-rank NCCL group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from omni_core.common.plan import ParallelPlan
from omni_core.runtime.dist import ALWAYS_COLLECT_ENV, DistInfo
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from tests.helpers.collective_devices import CollectiveRecord, check_collective_devices, is_host_tensor
from tests.helpers.pipeline import micro_batches
from tests.helpers.recipes import build_recipe

# hand-made micro-batches of one length (what a pipeline needs), images, clips and text: no dataset is read
RECIPE = {
    "experiment.name": "devices",
    "data.path": "unused",
    "data.seq_len": 48,
    "data.patch_size": 8,
    "data.n_mels": 32,
    "train.steps": 2,
    "train.warmup_steps": 1,
    "train.dtype": "float32",
}


def _step_worker(rank: int, world: int, plans: list[tuple[str, str]], always_collect: bool) -> dict:
    if always_collect:
        os.environ[ALWAYS_COLLECT_ENV] = "1"
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    out = {}
    for flavor, name in plans:
        plan = ParallelPlan.parse(name)
        batches = micro_batches()[plan.data_rank(rank) :: plan.dp] if rank < plan.llm_world_size else []
        recipe = build_recipe(overrides={**RECIPE, "model.flavor": flavor, "train.grad_accum": 4 // plan.dp})
        replica = build_replica(recipe, plan, info, torch.float32)
        optimizers = Optimizers(replica.parts, recipe)
        with check_collective_devices() as record:
            loss = train_step(replica, optimizers, batches, grad_clip=1.0).metrics["loss"]
        if replica.meshes:
            replica.meshes.release()
        out[f"{flavor} {name}"] = (record, loss)
    return out


def _check(results: list[dict]) -> None:
    """Every plan's step on every rank ran collectives, none handed a host tensor, and trained (a loss)."""
    failures = []
    for rank, per_plan in enumerate(results):
        for name, (record, loss) in per_plan.items():
            assert record.seen, f"{name}, rank {rank}: no collective ran"
            failures += [f"{name}, rank {rank}: {failure}" for failure in record.on_host]
            assert loss > 0, f"{name}, rank {rank}: loss {loss}"
    assert not failures, "\n".join(failures)


def test_one_rank_step_runs_every_collective_on_device_tensors():
    """dp1 on one rank, the world-size shortcuts off: the step's reductions run on a group of one."""
    _check(run_ranks(_step_worker, 1, [("debug", "dp1"), ("debug-moe", "dp1")], True))


def test_two_rank_plans_hand_collectives_device_tensors():
    """FSDP, TP, both CP kinds, a pipeline, EP, and the omni, coupled and disaggregated encoder layouts."""
    plans = [
        ("debug", "dp2"),
        ("debug", "dp1-tp2"),
        ("debug", "dp1-cp2u"),
        ("debug", "dp1-cp2r"),
        ("debug", "dp1-pp2"),
        ("debug-moe", "dp2-ep2"),
        ("debug", "dp2+omni"),
        ("debug", "dp1-pp2+omni"),
        ("debug", "dp1+disagg1"),
    ]
    _check(run_ranks(_step_worker, 2, plans, False))


def _control_worker(rank: int, world: int, folder: str) -> CollectiveRecord:
    """The trainer's collectives beside the step: the loaders' skip counts and the watcher's stop decision."""
    from omni_core.common.control import CONTROL_ENV
    from omni_core.runtime.trainer import Control, skipped_over_shards

    os.environ[CONTROL_ENV] = folder
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    control = Control(Path(folder) if rank == 0 else None, 2, "dp2", 0, info.device)
    with check_collective_devices() as record:
        skipped_over_shards(None, ParallelPlan.parse("dp2"), info)
        assert not control.stop_requested()
    return record


def test_the_trainers_skip_counts_and_stop_decision_reduce_device_tensors(tmp_path):
    for record in run_ranks(_control_worker, 2, str(tmp_path)):
        assert len(record.seen) == 2 and not record.on_host, record


def _record(block) -> CollectiveRecord:
    import torch.distributed as dist

    from omni_core.runtime.ranks import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with check_collective_devices() as record:
            block(dist)
    finally:
        dist.destroy_process_group()
    return record


@pytest.mark.parametrize(
    "make, on_host",
    [
        (lambda device: torch.tensor([1.0, 2.0]), True),
        (lambda device: torch.zeros(2, dtype=torch.float64), True),
        (lambda device: torch.ones(2, device=device).cpu(), True),
        (lambda device: torch.ones(2, device=device).double().to("cpu"), True),
        (lambda device: torch.cat([torch.zeros(1), torch.tensor([3.0])]) * 2, True),
        (lambda device: torch.zeros(2, device=device), False),
        (lambda device: torch.tensor([1.0, 2.0]).to(device), False),
        (lambda device: torch.cat([torch.zeros(1, device=device), torch.tensor([3.0]).to(device)]), False),
        (lambda device: torch.ones(2, device=device) * torch.tensor(2.0), False),  # a host scalar joins a device op
    ],
)
def test_the_check_tells_host_tensors_from_device_tensors(make, on_host):
    """The check's own rules, on the ways the step made (or makes) the tensors it reduces."""
    device = torch.device("cpu")

    def block(dist):
        tensor = make(device)
        assert is_host_tensor(tensor) == on_host
        dist.all_reduce(tensor)

    record = _record(block)
    assert record.seen == ["c10d.allreduce_.default"]
    assert bool(record.on_host) == on_host


def test_a_device_tensor_stays_one_after_cpu_returns_it():
    """On CPU `.cpu()` returns the tensor itself: the check hands back an alias marked host, the original is
    still a device tensor."""
    device_tensor = torch.ones(2)
    with check_collective_devices():
        host = device_tensor.cpu()
        again = torch.ones(2, device=torch.device("cpu"))
        moved = torch.tensor([1.0]).to(again.device)
    assert is_host_tensor(host) and not is_host_tensor(device_tensor)
    assert not is_host_tensor(again) and not is_host_tensor(moved)


def test_object_collectives_are_counted_apart():
    """They pickle host objects, which torch sends over the group's CPU backend (gloo beside NCCL on GPUs)."""

    def block(dist):
        gathered = [None]
        dist.all_gather_object(gathered, {"items": 3})
        assert gathered == [{"items": 3}]

    record = _record(block)
    assert record.object_collectives == ["all_gather_object"] and not record.on_host and not record.seen

"""AdamW's implementation by device (`runtime.optimizer.adamw_implementation`): fused on CUDA, foreach elsewhere."""

from __future__ import annotations

import pytest
import torch

from omni_core.models.omni import build_model
from omni_core.runtime.optimizer import Optimizers, adamw_implementation
from tests.helpers.models import N_MELS, PATCH_SIZE
from tests.helpers.recipes import build_recipe


def _optimizer(device: str) -> torch.optim.Optimizer:
    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0).to(device)
    return Optimizers([model], build_recipe()).optimizers[0]


def test_cpu_parameters_take_foreach():
    optimizer = _optimizer("cpu")
    assert all(group["foreach"] and not group["fused"] for group in optimizer.param_groups)


def test_fused_only_when_every_parameter_is_on_cuda():
    cpu = torch.zeros(2)
    assert adamw_implementation([cpu]) == {"foreach": True}
    assert adamw_implementation([]) == {"foreach": True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused AdamW on CUDA needs a GPU")
def test_cuda_parameters_take_fused_and_step():
    optimizer = _optimizer("cuda")
    assert all(group["fused"] for group in optimizer.param_groups)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    steps = [state["step"] for state in optimizer.state.values()]
    assert steps and all(step.device.type == "cuda" for step in steps)  # no host counter to read


def test_fused_adamw_steps_fsdp_dtensor_parameters_as_foreach_does():
    """The claim `adamw_implementation` rests on, checked on CPU (whose fused kernel DTensor shards the same way):
    fused AdamW over FSDP2's DTensor parameters gives foreach's update."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        updated = {}
        for implementation in ({"fused": True}, {"foreach": True}):
            torch.manual_seed(0)
            model = fully_shard(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)), mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01, **implementation)
            for _ in range(2):
                model(torch.randn(3, 8)).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            assert all(isinstance(p, DTensor) for p in model.parameters())
            updated[next(iter(implementation))] = [p.full_tensor() for p in model.parameters()]
        for fused, foreach in zip(updated["fused"], updated["foreach"], strict=True):
            torch.testing.assert_close(fused, foreach)
    finally:
        dist.destroy_process_group()


def test_each_part_steps_at_its_own_rate_and_decay_and_keeps_them_on_resume():
    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    recipe = build_recipe(None, {"train.lr": 3e-3, "train.weight_decay": 0.01, "train.warmup_steps": 0,
                                 "train.lr_by_part": {"projectors": 1e-3, "llm": 2e-5},
                                 "train.weight_decay_by_part": {"llm": 0.1}})
    optimizers = Optimizers([model], recipe)
    group_of = {id(p): group for group in optimizers.optimizers[0].param_groups for p in group["params"]}
    for name, param in model.named_parameters():
        part, group = name.split(".", 1)[0], group_of[id(param)]
        assert group["lr"] == {"projectors": 1e-3, "llm": 2e-5}.get(part, 3e-3), name
        assert group["weight_decay"] == ({"llm": 0.1}.get(part, 0.01) if param.ndim >= 2 else 0.0), name
    optimizers.step()
    saved = optimizers.scheduler_state()
    again = Optimizers([model], recipe)
    again.load_scheduler_state(saved)
    assert again.schedulers[0].last_epoch == 1
    assert again.schedulers[0].base_lrs == [group["initial_lr"] for group in again.optimizers[0].param_groups]
    assert set(again.schedulers[0].base_lrs) == {1e-3, 2e-5, 3e-3}


def test_the_logged_lr_is_train_lr_as_scheduled_whatever_the_first_group():
    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    recipe = build_recipe(None, {"train.lr": 3e-3, "train.warmup_steps": 4, "model.freeze": ["vision", "audio"],
                                 "train.lr_by_part": {"projectors": 1e-3, "llm": 2e-5}})
    for part in (model.vision, model.audio):
        part.requires_grad_(False)  # as the replica freezes them
    optimizers = Optimizers([model], recipe)
    assert optimizers.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 / 4)
    assert optimizers.lr == pytest.approx(3e-3 / 4)  # the first warmup step; the first group is the projectors'

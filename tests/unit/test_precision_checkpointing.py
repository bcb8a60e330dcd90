"""Precision and activation checkpointing as `parallel.parallelize` applies them on one process: bf16 weights in
forward over fp32 parameters that the optimizer steps (FSDP2 on a 1-rank mesh), fp32 left unsharded, and
selective checkpointing that recomputes half the matmuls and gives the gradients of no checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from omni_core.common.plan import ParallelPlan
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.synthetic import ensure_dataset
from omni_core.models.omni import build_model
from omni_core.parallel.parallelize import apply_activation_checkpointing, transformer_blocks
from omni_core.recipe.train_sections import TrainConfig
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from tests.helpers.models import MIXED_DOCS, N_MELS, PATCH_SIZE, make_batch
from tests.helpers.recipes import build_recipe

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _first_batch(recipe):
    ensure_dataset(recipe)
    return next(iter(PackedLoader(open_dataset(recipe), recipe.data, "train", 0, 1, recipe.experiment.seed)))


def test_bf16_on_one_process_computes_with_bf16_weights_and_steps_fp32_ones(tmp_path):
    recipe = build_recipe(tmp_path, {"train.dtype": "bfloat16"})
    batch = _first_batch(recipe)
    replica = build_replica(recipe, ParallelPlan(), CPU, torch.bfloat16)
    try:
        model = replica.parts[0]
        seen: dict[str, torch.dtype] = {}
        for name, linear in [("llm", model.llm.layers["0"].attention.wq), ("vision", model.vision.layers[0].mlp[0])]:
            linear.register_forward_pre_hook(lambda module, args, name=name: _record(seen, name, module))
        optimizers = Optimizers(replica.parts, recipe)
        train_step(replica, optimizers, [batch], grad_clip=1.0, compute_dtype=torch.bfloat16)
        assert seen == {"llm": torch.bfloat16, "vision": torch.bfloat16}
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
        states = [s for opt in optimizers.optimizers for s in opt.state.values()]
        assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
        assert replica.meshes is not None and replica.meshes.owns_default_group
    finally:
        if replica.meshes is not None:
            replica.meshes.release()
    assert not dist.is_initialized()  # the one-rank group it made is gone


def test_fp32_on_one_process_stays_unsharded(tmp_path):
    """fp32 runs exactly as before bf16 sharded on one process: plain parameters, no process group."""
    replica = build_replica(build_recipe(tmp_path), ParallelPlan(), CPU, torch.float32)
    assert replica.meshes is None and not dist.is_initialized()
    assert not any(isinstance(p, DTensor) for p in replica.parts[0].parameters())


def _record(seen: dict[str, torch.dtype], name: str, module: torch.nn.Module) -> None:
    seen.setdefault(name, module.weight.dtype)


class MatmulCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _gradients_and_matmuls(mode: str) -> tuple[dict[str, torch.Tensor], int, int]:
    """A debug model's gradients on mixed documents with checkpointing `mode`, and the matmuls its forward
    and its backward ran."""
    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    if mode != "none":
        apply_activation_checkpointing(model, mode)
    batch = make_batch(MIXED_DOCS)
    with MatmulCount() as forward:
        loss = torch.nn.functional.cross_entropy(model(batch), batch.labels, ignore_index=-100)
    with MatmulCount() as backward:
        loss.backward()
    unwrapped = (name.replace("._checkpoint_wrapped_module", "") for name, _ in model.named_parameters())
    grads = {name: p.grad for name, p in zip(unwrapped, model.parameters(), strict=True) if p.grad is not None}
    return grads, forward.count, backward.count


def test_selective_checkpointing_recomputes_every_other_matmul_and_keeps_the_gradients():
    plain, forward, backward = _gradients_and_matmuls("none")
    full, full_forward, full_backward = _gradients_and_matmuls("full")
    selective, sac_forward, sac_backward = _gradients_and_matmuls("selective")
    assert forward == full_forward == sac_forward
    recomputed_full, recomputed_sac = full_backward - backward, sac_backward - backward
    assert recomputed_full > 0
    blocks = len(transformer_blocks(build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)))
    # every other matmul of each block: half of them, less a half for each block with an odd count
    assert recomputed_full // 2 - blocks // 2 <= recomputed_sac <= recomputed_full // 2
    assert plain.keys() == selective.keys() == full.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(selective[name], grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(full[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("given", "mode"), [(True, "full"), (False, "none"), ("selective", "selective")])
def test_activation_checkpointing_reads_the_old_bool(given, mode):
    assert TrainConfig(activation_checkpointing=given).activation_checkpointing == mode


def test_an_unknown_checkpointing_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="activation_checkpointing"):
        TrainConfig(activation_checkpointing="sometimes")
    with pytest.raises(ValueError, match="activation_checkpointing='none'"):
        apply_activation_checkpointing(build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0), "none")

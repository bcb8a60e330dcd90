"""This rank's optimizers: AdamW per model part (fused on CUDA, foreach elsewhere), its parameters grouped by kind,
each part of the model at its own learning rate where the recipe says, with the LR schedule
(`runtime.lr_schedule`) each part steps by, held together as torchtitan's container. Under a ZeRO stage a
part's AdamW steps the rank's slices of its parameters (`parallel.zero`), which are all-gathered after it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from omni_core.parallel.zero import zero_shards
from omni_core.recipe.schema import Recipe
from omni_core.runtime.lr_schedule import build_lr_scheduler
from omni_core.runtime.model_init import own_name


def build_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases, or 1-D embeddings of positions), each
    part of the model (its top-level module: vision, audio, projectors, llm) at its own peak learning rate and
    decay where `train.lr_by_part` / `train.weight_decay_by_part` name it.

    The implementation is `adamw_implementation`'s. Either kind runs one group's tensors through batched
    operators, so a group must be homogeneous: parameters are grouped by part, decay and kind, plain tensors
    or DTensors of one mesh (FSDP's, the experts', TP's, ZeRO's). Under a ZeRO stage the model's slices are
    what it steps."""
    from torch.distributed.tensor import DTensor

    train = recipe.train
    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    shards = zero_shards(model)
    for name, param in shards.named_shards() if shards is not None else model.named_parameters():
        if param.requires_grad:
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            groups[(own_name(name).split(".", 1)[0], param.ndim >= 2, mesh)].append(param)
    return torch.optim.AdamW(
        [
            {
                "params": params,
                "lr": train.lr_by_part.get(part, train.lr),
                "weight_decay": train.weight_decay_by_part.get(part, train.weight_decay) if matrix else 0.0,
            }
            for (part, matrix, _), params in groups.items()
        ],
        lr=train.lr,
        betas=train.betas,
        **adamw_implementation([p for params in groups.values() for p in params]),
    )


def adamw_implementation(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """AdamW's keyword choosing its implementation. Fused when every parameter is on CUDA: one kernel per
    group does all of AdamW's arithmetic, and keeps the step counts on the device (no host tensor). DTensors
    take it too: DTensor shards `aten._fused_adamw_` pointwise (read in torch 2.11 to 2.14's
    `distributed/tensor/_ops/_pointwise_ops.py`). Elsewhere foreach (a few batched operators per group
    instead of ~15 per tensor; PyTorch's CPU default is the per-tensor loop, whose operators each pay
    DTensor's dispatch on DTensors)."""
    if params and all(p.device.type == "cuda" for p in params):
        return {"fused": True}
    return {"foreach": True}


class Optimizers:
    """AdamW + LR schedule per model part (torchtitan's container): each part's optimizer state is keyed
    by that part's parameter names, which are the whole model's, so checkpoints reshard across plans."""

    def __init__(self, parts: Sequence[nn.Module], recipe: Recipe):
        cfg = recipe.train
        self.peak_lr = cfg.lr
        self.zero = [zero_shards(part) for part in parts]
        self.optimizers = [build_optimizer(part, recipe) for part in parts]
        self.schedulers = [
            build_lr_scheduler(opt, warmup=cfg.warmup_steps, total=cfg.steps, floor=cfg.min_lr_ratio)
            for opt in self.optimizers
        ]

    def step(self) -> None:
        for opt, sched, shards in zip(self.optimizers, self.schedulers, self.zero, strict=True):
            opt.step()
            sched.step()
            if shards is not None:
                shards.gather_parameters()
                shards.clear_gradients()  # the model's whole gradients too, which the optimizer does not hold
            opt.zero_grad(set_to_none=True)

    def stepped_module(self, index: int, part: nn.Module) -> nn.Module:
        """The module whose parameters part `index`'s optimizer steps, registered under the model's names (what
        DCP keys its state by): the part itself, or under a ZeRO stage a module of its slices."""
        shards = self.zero[index]
        return part if shards is None else shards.state_module()

    @property
    def lr(self) -> float:
        """train.lr as the schedule has it now (the parts with peaks of their own, `train.lr_by_part`, follow
        the same schedule from theirs)."""
        scheduler = self.schedulers[0]
        return float(self.peak_lr * scheduler.get_last_lr()[0] / scheduler.base_lrs[0])

    def scheduler_state(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        """The saved step; each group keeps the peak learning rate this run gives it (`build_optimizer`: per
        part), since how many groups there are depends on the plan. Call it after the optimizers' state is
        loaded: the groups' current lrs are then the saved ones."""
        for opt, sched in zip(self.optimizers, self.schedulers, strict=True):
            sched.load_state_dict(
                {
                    **state,
                    "base_lrs": [group["initial_lr"] for group in opt.param_groups],
                    "_last_lr": [group["lr"] for group in opt.param_groups],
                }
            )

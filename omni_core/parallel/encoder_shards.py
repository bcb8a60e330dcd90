"""Encoder weights FSDP-sharded over the encoders' own group (`EncoderSpec.fsdp`), gathered once per step.

At rest a rank keeps 1/n of a sharded encoder's parameters and of its projector's: the registered parameters
are DTensors sharded on dim 0 over a mesh of the encoder ranks (the world under `omni`, the encoders' own
ranks under `disaggregated`). So the optimizer keeps 1/n of their state, the gradient norm counts each
element once, and DCP checkpoints reshard them across layouts as they do FSDP's.

A step gathers the weights whole with one flat all-gather before its first encoder call (`gather`), installs
the full tensors in the modules for every call of the step (forward, activation recomputation, backward, the
joint schedule's thread), and after the encoders' backward reduce-scatters their gradients into the shards'
with one flat reduce-scatter (a sum, as the replicated encoders' all-reduce) and puts the shards back
(`reduce`).

Per step rather than per call, as FSDP's hooks do it: ranks run different numbers of encoder calls each step
(some none), and per-call collectives would not match across ranks. The price is memory: within a step a rank
holds the encoders' full weights and gradients; between steps, and for the optimizer, only its share. The
estimator prices exactly this (`estimator.encoders`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

PROJECTOR_OF = {"vision": "image", "audio": "audio"}  # each encoder's projector (`OmniModel.projectors`)


@dataclass(frozen=True)
class _Slot:
    """One sharded parameter: where it is registered, and its padded chunk in the flat buffers."""

    module: nn.Module
    name: str
    shard: nn.Parameter  # the registered DTensor
    offset: int  # of its chunk in a rank's flat shard
    chunk_rows: int  # ceil(rows / ranks): every rank's chunk is padded to it


def sharded_modules(model: nn.Module, encoders: list[str]) -> list[nn.Module]:
    """The modules whose weights shard with these encoders: each encoder and its projector, where this part
    holds them (the LLM ranks of `disaggregated` hold none)."""
    modules = []
    for encoder in encoders:
        if getattr(model, encoder, None) is not None:
            modules.append(getattr(model, encoder))
            modules.append(model.projectors[PROJECTOR_OF[encoder]])
    return modules


class EncoderShards:
    """The sharded encoders of one model part over `group` (None: the world); empty where it holds none."""

    def __init__(self, modules: list[nn.Module], group: dist.ProcessGroup | None, device: torch.device):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard, distribute_tensor

        self.group, self.slots, self.full = group, [], []
        self.ranks = dist.get_world_size(group) if modules else 1
        self.mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type) if modules else None
        offset = 0
        for module in modules:
            for owner, name, param in _own_parameters(module):
                if param.ndim == 0:
                    raise ValueError(f"{name}: a 0-d parameter cannot be sharded on dim 0")
                shard = nn.Parameter(distribute_tensor(param.detach(), self.mesh, [Shard(0)], src_data_rank=None),
                                     requires_grad=param.requires_grad)  # every rank built the same weights
                owner.register_parameter(name, shard)
                chunk_rows = math.ceil(param.shape[0] / self.ranks)
                self.slots.append(_Slot(owner, name, shard, offset, chunk_rows))
                offset += chunk_rows * param[0].numel()
        self.flat_numel = offset
        self.grads = self._gradient_buffer()

    def _gradient_buffer(self) -> list:
        """The trainable shards' gradients, as DTensors over views of one flat buffer that each step's
        reduce-scatter writes into (made once: DTensor's wrapping costs more than the collective on small
        encoders)."""
        from torch.distributed.tensor import DTensor, Shard

        trains = [slot for slot in self.slots if slot.shard.requires_grad]
        sizes = [slot.chunk_rows * slot.shard.shape[1:].numel() for slot in trains]
        self.grad_flat = torch.zeros(sum(sizes), device=self.mesh.device_type) if trains else None
        grads = []
        for slot, chunk in zip(trains, self.grad_flat.split(sizes) if trains else [], strict=True):
            rows = slot.shard.to_local().shape[0]
            local = chunk.view(slot.chunk_rows, *slot.shard.shape[1:])[:rows]
            grads.append(DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                            shape=slot.shard.shape, stride=slot.shard.stride()))
        return grads

    @property
    def params(self) -> list[nn.Parameter]:
        return [slot.shard for slot in self.slots]

    def gather(self) -> None:
        """All-gather the full weights (one flat collective) and install them for the step's encoder calls."""
        if not self.slots:
            return
        local = torch.cat([_padded(slot.shard.to_local().detach(), slot.chunk_rows).reshape(-1)
                           for slot in self.slots])
        everyone = local.new_empty(self.ranks * self.flat_numel)
        dist.all_gather_single(everyone, local, group=self.group)
        by_rank = everyone.view(self.ranks, self.flat_numel)
        self.full = []
        for slot in self.slots:
            shape = slot.shard.shape
            size = slot.chunk_rows * shape[1:].numel()
            rows = by_rank[:, slot.offset:slot.offset + size].reshape(self.ranks * slot.chunk_rows, *shape[1:])
            full = rows[:shape[0]].clone().requires_grad_(slot.shard.requires_grad)
            slot.module._parameters[slot.name] = full  # a plain tensor for the step: the module computes with it
            self.full.append(full)

    def reduce(self) -> None:
        """Reduce-scatter the full weights' gradients (summed over the group; zeros for a rank that ran no
        call) into the shards' gradients, and register the shards again."""
        if not self.slots:
            return
        trains = [(slot, full) for slot, full in zip(self.slots, self.full, strict=True) if slot.shard.requires_grad]
        if trains:
            by_rank = torch.cat([
                _padded(full.grad if full.grad is not None else torch.zeros_like(full), self.ranks * slot.chunk_rows)
                .reshape(self.ranks, -1) for slot, full in trains], dim=1)
            dist.reduce_scatter_single(self.grad_flat, by_rank.reshape(-1), group=self.group)
            for (slot, _), grad in zip(trains, self.grads, strict=True):
                slot.shard.grad = grad
        for slot in self.slots:
            slot.module._parameters[slot.name] = slot.shard
        self.full = []


def _own_parameters(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(owner, name, parameter) of every parameter under `module`, by the submodule that registers it."""
    return [(owner, name, param) for owner in module.modules() for name, param in owner.named_parameters(recurse=False)]


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """`rows` with zero rows appended up to `count`."""
    if rows.shape[0] == count:
        return rows
    return torch.cat([rows, rows.new_zeros(count - rows.shape[0], *rows.shape[1:])])

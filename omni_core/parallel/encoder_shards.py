"""Encoder weights FSDP-sharded over the encoders' own group (`EncoderSpec.fsdp`): block by block.

At rest a rank keeps 1/n of a sharded encoder's parameters and of its projector's: the registered parameters
are DTensors sharded on dim 0 over a mesh of the encoder ranks (the world under `omni`, the encoders' own
ranks under `disaggregated`). So the optimizer keeps 1/n of their state, the gradient norm counts each
element once, and DCP checkpoints reshard them across layouts as they do FSDP's.

The transformer blocks are gathered one at a time (`BlockChain`): a round of the encoder (the step under
`phased`, a micro-batch under `joint`) runs block after block over all of the rank's calls, each block's
weights all-gathered before it and freed after it; its backward runs the blocks in reverse, gathering each
again, recomputing its forward from its saved input (block-level activation checkpointing) and
reduce-scattering its gradients before the next. The rest of the encoder (its stem and final norm) and its
projector are small: they are gathered once per step and reduce-scattered after the encoders' backward
(`EncoderShards` used directly).

Per round and per block rather than per call, as FSDP's hooks do it: ranks run different numbers of encoder
calls (some none), and per-call collectives would not match across ranks. Every rank of the group runs each
chain, with no call if it has none; the chain's token, an empty output every rank hands off, makes every
rank's backward reach it; the vision chain's token feeds the audio chain, so all ranks run the chains'
backward in one order. The price: a forward recomputed per block, and a rank holds one block's full weights
and gradients at a time beside its share. The estimator prices exactly this (`estimator.encoders`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from omni_core.common.torch_compat import all_gather_single, reduce_scatter_single
from omni_core.models.audio import AudioEncoder
from omni_core.models.omni import OmniModel
from omni_core.models.vision import VisionEncoder

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

PROJECTOR_OF = {"vision": "image", "audio": "audio"}  # each encoder's projector (`OmniModel.projectors`)
Owned = tuple[nn.Module, str, nn.Parameter]  # a parameter, with the module that registers it and its name


@dataclass(frozen=True)
class _Slot:
    """One sharded parameter: where it is registered, and its padded chunk in the flat buffers."""

    module: nn.Module
    name: str
    shard: nn.Parameter  # the registered DTensor
    offset: int  # of its chunk in a rank's flat shard
    chunk_rows: int  # ceil(rows / ranks): every rank's chunk is padded to it

    @property
    def local(self) -> torch.Tensor:
        """This rank's rows of the parameter (its DTensor's local shard)."""
        return cast("DTensor", self.shard).to_local()


def stem_and_head(model: OmniModel, encoder: str) -> list[Owned]:
    """A sharded encoder's parameters outside its blocks (stem, final norm) and its projector's."""
    blocks = set(getattr(model, encoder).layers.modules())
    return [
        *(o for o in owned(getattr(model, encoder)) if o[0] not in blocks),
        *owned(model.projectors[PROJECTOR_OF[encoder]]),
    ]


def owned(module: nn.Module) -> list[Owned]:
    """Every parameter under `module`, by the submodule that registers it."""
    return [(owner, name, param) for owner in module.modules() for name, param in owner.named_parameters(recurse=False)]


class EncoderShards:
    """Parameters sharded over `group` (None: the world): gathered whole (`gather`), their gradients
    reduce-scattered into the shards' (`reduce`). Empty where this rank holds none of them."""

    def __init__(self, params: list[Owned], group: dist.ProcessGroup | None, device: torch.device):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard, distribute_tensor

        self.group = group
        self.slots: list[_Slot] = []
        self.full: list[torch.Tensor] = []
        self.ranks = dist.get_world_size(group) if params else 1
        self.mesh = DeviceMesh.from_group(group or _world(), device.type) if params else None
        offset = 0
        for owner, name, param in params:
            if param.ndim == 0:
                raise ValueError(f"{name}: a 0-d parameter cannot be sharded on dim 0")
            shard = nn.Parameter(
                distribute_tensor(param.detach(), self.mesh, [Shard(0)], src_data_rank=None),
                requires_grad=param.requires_grad,
            )  # every rank built the same weights
            owner.register_parameter(name, shard)
            chunk_rows = math.ceil(param.shape[0] / self.ranks)
            self.slots.append(_Slot(owner, name, shard, offset, chunk_rows))
            offset += chunk_rows * param[0].numel()
        self.flat_numel = offset
        self.trains = any(slot.shard.requires_grad for slot in self.slots)
        self.grads = self._gradient_buffer()

    def _gradient_buffer(self) -> list[torch.Tensor]:
        """The trainable shards' gradients, as DTensors over views of one flat buffer that each reduce-scatter
        writes into (made once: DTensor's wrapping costs more than the collective on small encoders)."""
        from torch.distributed.tensor import DTensor, Shard

        trains = [slot for slot in self.slots if slot.shard.requires_grad]
        self.grad_flat: torch.Tensor | None = None
        if not trains:
            return []
        assert self.mesh is not None  # built whenever there are parameters
        sizes = [slot.chunk_rows * slot.shard.shape[1:].numel() for slot in trains]
        self.grad_flat = torch.zeros(sum(sizes), device=self.mesh.device_type)
        grads: list[torch.Tensor] = []
        for slot, chunk in zip(trains, self.grad_flat.split(sizes), strict=True):
            rows = slot.local.shape[0]
            local = chunk.view(slot.chunk_rows, *slot.shard.shape[1:])[:rows]
            grads.append(
                DTensor.from_local(
                    local, self.mesh, [Shard(0)], run_check=False, shape=slot.shard.shape, stride=slot.shard.stride()
                )
            )
        return grads

    @property
    def params(self) -> list[nn.Parameter]:
        return [slot.shard for slot in self.slots]

    def gather(self, trainable: bool = True) -> None:
        """All-gather the full weights (one flat collective) and install them in their modules; `trainable`:
        as leaves that collect gradients (where the parameter trains)."""
        if not self.slots:
            return
        local = torch.cat([_padded(slot.local.detach(), slot.chunk_rows).reshape(-1) for slot in self.slots])
        everyone = local.new_empty(self.ranks * self.flat_numel)
        all_gather_single(everyone, local, group=self.group)
        by_rank = everyone.view(self.ranks, self.flat_numel)
        self.full = []
        for slot in self.slots:
            shape = slot.shard.shape
            size = slot.chunk_rows * shape[1:].numel()
            rows = by_rank[:, slot.offset : slot.offset + size].reshape(self.ranks * slot.chunk_rows, *shape[1:])
            full = rows[: shape[0]].clone().requires_grad_(trainable and slot.shard.requires_grad)
            # a plain tensor while installed (the module computes with it), where torch types only Parameters
            slot.module._parameters[slot.name] = full  # type: ignore[assignment]
            self.full.append(full)

    def reduce(self) -> None:
        """Reduce-scatter the full weights' gradients (summed over the group; zeros for a rank that ran no
        call) into the shards' gradients (added to what an earlier round of the step left there), and put the
        shards back."""
        if self.trains and self.full:
            trains = [(s, f) for s, f in zip(self.slots, self.full, strict=True) if s.shard.requires_grad]
            by_rank = torch.cat(
                [
                    _padded(
                        full.grad if full.grad is not None else torch.zeros_like(full), self.ranks * slot.chunk_rows
                    ).reshape(self.ranks, -1)
                    for slot, full in trains
                ],
                dim=1,
            )
            assert self.grad_flat is not None  # made whenever a slot trains
            first = trains[0][0].shard.grad is None  # the optimizer set them to None after the last step
            target = self.grad_flat if first else torch.empty_like(self.grad_flat)
            reduce_scatter_single(target, by_rank.reshape(-1), group=self.group)
            if not first:
                self.grad_flat += target
            for (slot, _), grad in zip(trains, self.grads, strict=True):
                slot.shard.grad = grad
        self.release()

    def release(self) -> None:
        """Put the shards back in their modules and drop the full weights."""
        for slot in self.slots:
            slot.module._parameters[slot.name] = slot.shard
        self.full = []


@dataclass
class BlockChain:
    """One sharded encoder's blocks over `group`, each an `EncoderShards` of its own (module docstring)."""

    layers: list[nn.Module]
    shards: list[EncoderShards]

    @classmethod
    def of(
        cls, encoder: VisionEncoder | AudioEncoder, group: dist.ProcessGroup | None, device: torch.device
    ) -> BlockChain:
        layers = list(encoder.layers)
        return cls(layers, [EncoderShards(owned(layer), group, device) for layer in layers])

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for shards in self.shards for p in shards.params]

    def run(
        self, token: torch.Tensor, calls: list[tuple[torch.Tensor, list[int], Any]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The blocks over this rank's calls ((input, documents' bounds, LSSP shard or None) each): the token
        passed on, and each call's output."""
        token, *outputs = _Blocks.apply(self, [(cu, shard) for _, cu, shard in calls], token, *(x for x, _, _ in calls))
        return token, outputs


class _Blocks(torch.autograd.Function):
    """Block after block over every call, each block's weights gathered for it; backward in reverse, each block
    gathered again, recomputed from its saved inputs and its gradients reduce-scattered."""

    @staticmethod
    def forward(ctx: Any, chain: BlockChain, calls: list, token: torch.Tensor, *xs: torch.Tensor):
        device = token.device.type
        ctx.chain, ctx.calls = chain, calls
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.inputs = []
        for layer, shards in zip(chain.layers, chain.shards, strict=True):
            shards.gather(trainable=False)
            ctx.inputs.append(xs)
            xs = tuple(layer(x, cu, shard) for x, (cu, shard) in zip(xs, calls, strict=True))
            shards.release()
        return (token.clone(), *xs)

    @staticmethod
    def backward(ctx: Any, token_grad: torch.Tensor, *grads: torch.Tensor | None):
        chain, calls = ctx.chain, ctx.calls
        device, enabled, dtype = ctx.autocast
        for index in reversed(range(len(chain.layers))):
            layer, shards, saved = chain.layers[index], chain.shards[index], ctx.inputs[index]
            shards.gather(trainable=True)
            inputs = [x.detach().requires_grad_() for x in saved]
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                outputs = [layer(x, cu, shard) for x, (cu, shard) in zip(inputs, calls, strict=True)]
            pairs = [(out, g) for out, g in zip(outputs, grads, strict=True) if g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads = tuple(x.grad for x in inputs)
            shards.reduce()
        ctx.inputs = None
        return (None, None, token_grad, *grads)


def _world() -> dist.ProcessGroup:
    """The default (world) process group, which exists once torch.distributed is initialised."""
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("sharding encoder weights needs torch.distributed initialised")
    return world


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """`rows` with zero rows appended up to `count`."""
    if rows.shape[0] == count:
        return rows
    return torch.cat([rows, rows.new_zeros(count - rows.shape[0], *rows.shape[1:])])

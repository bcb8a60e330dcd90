"""ZeRO-1, ZeRO-2 and replicated data parallelism over the shard group (`ParallelPlan.sharding`).

Every rank of the shard group (dp_shard x cp, the ranks FSDP would shard over) keeps the model's parameters
whole (TP's shards of them under TP): forward and backward run on them with no gathers, and gradients
accumulate whole over the step's micro-batches. After the last backward (`reduce_gradients`, before the
gradient norm):

    replicate  gradients all-reduced; every rank steps every parameter (plain DDP)
    zero1      gradients all-reduced (kept whole); each rank steps only its slice of every parameter, so
               it holds 1/n of the optimizer states; the updated slices are all-gathered (`gather_parameters`)
    zero2      gradients reduce-scattered: each rank keeps only its slice of them (the whole ones are freed),
               steps it, and the updated slices are all-gathered

then over dp_replicate the reduced gradients are all-reduced. This is ZeRO as DeepSpeed's stage 1 / 2 and
Megatron-LM's distributed optimizer define what is sharded; unlike them the gradients are reduced once after
the backward (one flat collective per part), not in buckets during it: ZeRO-2 frees the whole gradients only
then, so its peak holds them like ZeRO-1's, and none of the reduction hides behind the backward.

A slice is a parameter's rows along one dimension, `ceil(rows / n)` per rank as DTensor's `Shard` cuts them
(a TP-sharded parameter is cut along another dimension than TP's; one with none left, a TP-sharded vector,
keeps its state whole). What the optimizer steps is, per parameter, a DTensor on the (dp_replicate,
dp_shard x cp, tp) mesh's dims of more than one rank, whose local tensor is a view of this rank's rows of the
parameter itself: the step updates the parameter in place, the gradient norm counts each element once
(DTensor reduces over the mesh), and the optimizer's states are DTensors of the parameter's shape, which DCP
saves and reshards across plans like FSDP's (`state_module`: a module registering the slices under the
model's names).

Hand-written rather than `torch.distributed.optim.ZeroRedundancyOptimizer`: that one shards whole parameters
(a rank owns some tensors, unbalanced for a few large matrices), broadcasts them from their owners, has no
ZeRO-2, and its state dict is consolidated on one rank, which DCP cannot save or reshard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from omni_core.common.plan import ParallelPlan
from omni_core.common.torch_compat import all_gather_single, reduce_scatter_single

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

_ATTRIBUTE = "_zero_shards"  # where a model part keeps its ZeroShards
MESH_DIMS = ("dp_replicate", "dp_shard_cp", "tp")  # the ZeRO mesh's dims (`parallelize.build_meshes`)


@dataclass(frozen=True)
class _Slice:
    """One parameter's share: its rows along `dim` over the shard group (`dim` None: kept whole)."""

    name: str  # the parameter's name in the unwrapped model
    param: nn.Parameter  # the model's, whole on every rank of the shard group
    dim: int | None
    chunk: int  # rows per rank along `dim` (the last ranks may have fewer, or none)
    offset: int  # of this parameter's chunk in a rank's flat share (sharded parameters only)
    shard: nn.Parameter  # what the optimizer steps: this rank's rows, a DTensor on the ZeRO mesh

    @property
    def local(self) -> torch.Tensor:
        """The parameter as this rank holds it: TP's local shard, or the parameter itself."""
        return _local(self.param)

    def rows(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s rows of `tensor` (a view; shaped like the parameter's local tensor)."""
        return _rows(tensor, self.dim, self.chunk, rank)

    @property
    def chunk_numel(self) -> int:
        """Elements of one rank's padded chunk in the flat buffers."""
        assert self.dim is not None
        return self.chunk * self.local.numel() // max(self.local.shape[self.dim], 1)


def _rows(tensor: torch.Tensor, dim: int | None, chunk: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of `tensor` along `dim`, `chunk` per rank as DTensor's `Shard` cuts them (a view)."""
    if dim is None:
        return tensor
    size = tensor.shape[dim]
    start = min(rank * chunk, size)
    return tensor.narrow(dim, start, min(chunk, size - start))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ZeroShards:
    """A model part's parameters under a ZeRO stage (module docstring): the slices the optimizer steps, the
    gradients' reduction after the backward and the parameters' gather after the step."""

    def __init__(self, part: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, own_name: Callable[[str], str]):
        """`own_name`: a parameter's name in the unwrapped model (what checkpoints key it by)."""
        self.stage = plan.sharding
        self.mesh = mesh  # (dp_replicate, dp_shard_cp, tp)
        # The slices live on the mesh's dims of more than one rank (the shard group's always): DTensor's
        # sharding propagation for the optimizer's foreach ops grows with the mesh's dims, and the first step
        # of a 3D mesh of two size-1 dims took seconds where FSDP's 1D mesh takes milliseconds.
        self.slice_dims = tuple(d for i, d in enumerate(MESH_DIMS) if d == "dp_shard_cp" or mesh.size(i) > 1)
        self.slice_mesh = mesh[self.slice_dims]
        self.shard_group = mesh.get_group("dp_shard_cp")
        self.replicate_group = mesh.get_group("dp_replicate") if plan.dp_replicate > 1 else None
        self.ranks = mesh.size(1) if self.stage != "replicate" else 1
        self.rank = mesh.get_local_rank("dp_shard_cp") if self.ranks > 1 else 0
        self.slices: list[_Slice] = []
        offset = 0
        for name, param in part.named_parameters():
            if param.requires_grad:
                piece = self._slice(own_name(name), param, offset)
                offset += piece.chunk_numel if piece.dim is not None else 0
                self.slices.append(piece)
        self.share_numel = offset  # of this rank's flat share of the sharded parameters

    def _slice(self, name: str, param: nn.Parameter, offset: int) -> _Slice:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        tp_placement: Placement = param.placements[0] if isinstance(param, DTensor) else Replicate()
        taken = tp_placement.dim if isinstance(tp_placement, Shard) else None
        dims = [d for d in range(param.ndim) if d != taken] if self.ranks > 1 else []
        dim = dims[0] if dims else None
        rows = _local(param).shape[dim] if dim is not None else 1
        chunk = -(-rows // self.ranks)
        by_dim = {"dp_replicate": Replicate(), "dp_shard_cp": Shard(dim) if dim is not None else Replicate()}
        placements = tuple(by_dim.get(d, tp_placement) for d in self.slice_dims)
        with torch.no_grad():
            view = _rows(_local(param).detach(), dim, chunk, self.rank)  # the step updates the parameter itself
            shard = DTensor.from_local(
                view, self.slice_mesh, placements, run_check=False, shape=param.shape, stride=_contiguous(param.shape)
            )
        return _Slice(name, param, dim, chunk, offset, nn.Parameter(shard))

    # --- what the optimizer and the checkpoint see --------------------------------------------------------

    def named_shards(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(the unwrapped model's name, the slice the optimizer steps) of every trainable parameter."""
        return ((piece.name, piece.shard) for piece in self.slices)

    def state_module(self) -> nn.Module:
        """A module registering each slice under its parameter's name: DCP's state-dict helpers key the
        optimizer's state by it, as they key FSDP's by the sharded parameters."""
        root = nn.Module()
        for name, shard in self.named_shards():
            *path, leaf = name.split(".")
            module = root
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, shard)
        return root

    # --- the step ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum the whole gradients over the data ranks (module docstring) and hand each slice its rows."""
        sharded = [p for p in self.slices if p.dim is not None]
        whole = [p for p in self.slices if p.dim is None]
        if self.stage == "zero2":
            own = self._reduce_scatter(sharded)
            self._all_reduce(whole)
            for piece in sharded:
                shape = piece.rows(piece.local, self.rank).shape
                grad = own[piece.offset : piece.offset + shape.numel()].view(shape)
                piece.param.grad = None  # only the slice is kept
                piece.shard.grad = self._as_shard(piece, grad)
        else:
            self._all_reduce(self.slices)
            for piece in self.slices:
                piece.shard.grad = self._as_shard(piece, piece.rows(_local(_grad(piece.param)), self.rank))

    def _as_shard(self, piece: _Slice, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        shard = cast("DTensor", piece.shard)
        return DTensor.from_local(
            local, self.slice_mesh, shard.placements, run_check=False, shape=shard.shape, stride=shard.stride()
        )

    def _all_reduce(self, pieces: list[_Slice]) -> None:
        """One flat all-reduce of the pieces' whole gradients over the shard group (and over dp_replicate)."""
        if not pieces:
            return
        grads = [_local(_grad(p.param)) for p in pieces]
        flat = torch.cat([g.reshape(-1) for g in grads])
        for group in (self.shard_group, self.replicate_group):
            if group is not None:
                dist.all_reduce(flat, group=group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _reduce_scatter(self, pieces: list[_Slice]) -> torch.Tensor:
        """This rank's flat share of the pieces' gradients summed over the data ranks: one reduce-scatter
        over the shard group (each rank's rows packed into its padded chunk), then over dp_replicate."""
        if not pieces:
            return torch.empty(0)
        grads = [_local(_grad(p.param)) for p in pieces]
        full = grads[0].new_zeros(self.ranks, self.share_numel)
        for piece, grad in zip(pieces, grads, strict=True):
            for rank in range(self.ranks):
                rows = piece.rows(grad, rank)
                full[rank, piece.offset : piece.offset + rows.numel()].view(rows.shape).copy_(rows)
        own = full.new_empty(self.share_numel)
        reduce_scatter_single(own, full.view(-1), group=self.shard_group)
        if self.replicate_group is not None:
            dist.all_reduce(own, group=self.replicate_group)
        return own

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """After the step: every rank's updated rows all-gathered into every rank's whole parameters (one
        flat all-gather over the shard group); replicated parameters were stepped whole everywhere."""
        sharded = [p for p in self.slices if p.dim is not None]
        if not sharded:
            return
        own = sharded[0].local.new_zeros(self.share_numel)
        for piece in sharded:
            rows = piece.rows(piece.local, self.rank)
            own[piece.offset : piece.offset + rows.numel()].view(rows.shape).copy_(rows)
        everyone = own.new_empty(self.ranks, self.share_numel)
        all_gather_single(everyone.view(-1), own, group=self.shard_group)
        for piece in sharded:
            for rank in range(self.ranks):
                if rank != self.rank:
                    rows = piece.rows(piece.local, rank)
                    rows.copy_(everyone[rank, piece.offset : piece.offset + rows.numel()].view(rows.shape))

    def clear_gradients(self) -> None:
        for piece in self.slices:
            piece.param.grad = None
            piece.shard.grad = None


def _grad(param: nn.Parameter) -> torch.Tensor:
    if param.grad is None:
        raise ValueError("a trainable parameter has no gradient: fill_missing_grads runs before the reduction")
    return param.grad


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def attach_zero(part: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, own_name: Callable[[str], str]) -> ZeroShards:
    """Put a model part under the plan's ZeRO stage (after its parameters are materialized: the slices
    view them)."""
    shards = ZeroShards(part, plan, mesh, own_name)
    setattr(part, _ATTRIBUTE, shards)
    return shards


def zero_shards(part: nn.Module) -> ZeroShards | None:
    """The part's ZeroShards, or None when the plan's stage is FSDP (or one process holds the model)."""
    return getattr(part, _ATTRIBUTE, None)

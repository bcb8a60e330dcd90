"""What omni needs from torch that differs between the versions it runs on, torch 2.11 to 2.14 (the GPU machines
have 2.11 preinstalled; the CPU wheel is pinned at 2.13), each difference gated here with a named fallback.

Gated here:
- `dist.all_gather_single` / `dist.reduce_scatter_single`: added in 2.13 (which deprecates the older names);
  fallback `all_gather_into_tensor` / `reduce_scatter_tensor`, the same collectives under their 2.11-2.12 names.

Read in the sources of 2.11.0, 2.12.0, 2.13.0 and 2.14.1, and present with the same signature in all four:
- `DeviceMesh._unflatten(dim, sizes, names)`, `._get_root_mesh()`, `._pg_registry` (`ParallelMeshes`).
- DTensor's caches that `ParallelMeshes.release` empties: `tensor.debug._clear_sharding_prop_cache`,
  `ShardingPropagator._propagate_tensor_meta_cached`, `_redistribute._gen_transform_infos`,
  `_redistribute.clear_redistribute_planner_cache`, `_collective_utils.MeshTopoInfo.build_from_mesh`.
- `algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper(module, **checkpoint_kwargs)`, and
  `utils.checkpoint.create_selective_checkpoint_contexts` / `CheckpointPolicy` / `noop_context_fn`
  (activation checkpointing); `aten._grouped_mm` behind `F.grouped_mm` (the MoE's experts).
- `torch.compiler.disable`, `torch._dynamo.maybe_mark_dynamic`, `torch._dynamo.utils.counters` (compile).
- FSDP2: `fully_shard`, `MixedPrecisionPolicy`, `set_gradient_divide_factor`,
  `set_force_sum_reduction_for_comms`, `set_requires_gradient_sync`; a 1-rank mesh unshards by a copy.
  2.11's `fully_shard` refuses every ModuleDict (2.12 takes one with a forward): `feed_forward.Experts` is
  an nn.Module, which every version takes, so no gate.
- DTensor's sharding rules for `aten._fused_adamw_` (fused AdamW on FSDP and TP parameters).
- `distributed._functional_collectives` (models.feed_forward), `pipelining.stage._PipelineStageBase`
  (parallel.pipeline), `utils._python_dispatch.TorchDispatchMode` (measure.sampling).
- `tensor._utils.compute_local_shape_and_global_offset` (private; `local_box`, with the whole tensor as its
  fallback) and `distribute_tensor(..., src_data_rank=None)` (`local_shard`): a rank's shard of a weight.
- `nn.utils.get_total_norm` (public since 2.6), `nn.attention.flex_attention`, and
  `nn.attention.varlen.varlen_attn` (the custom op `torch_attn::_varlen_attn`; CUDA only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def active_fallbacks() -> list[str]:
    """The fallbacks this torch takes, by name (empty on torch 2.13 and later): what a report records."""
    fallbacks = []
    if not hasattr(dist, "all_gather_single"):
        fallbacks.append("all_gather_single -> all_gather_into_tensor")
    if not hasattr(dist, "reduce_scatter_single"):
        fallbacks.append("reduce_scatter_single -> reduce_scatter_tensor")
    return fallbacks


def all_gather_single(
    output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
):
    """Every rank's `local` laid end to end in `output` (looked up at each call, so a patched `dist` is seen)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
):
    """`full` summed over the ranks, this rank's slice of it in `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, full, group=group, async_op=async_op)


def local_box(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The global index ranges of this rank's shard of a DTensor (every index of a plain tensor), or None where
    the shard is not one box or this torch cannot say: the caller then takes the whole tensor to `local_shard`.

    `tensor._utils.compute_local_shape_and_global_offset` is private (read with the same signature in 2.11 to
    2.14); a strided shard (FSDP2 over TP on one dim) interleaves rows, so its first offset is no box."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # fallback: the whole tensor, kept by `local_shard`
        return None
    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def local_shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `full` under the DTensor `like`'s mesh and placements, cut locally (every rank holds
    `full`, so nothing is sent: `src_data_rank=None`, public since torch 2.5)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    assert isinstance(like, DTensor)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()

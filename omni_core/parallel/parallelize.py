"""`parallelize_omni(part, plan, meshes, ...)`: applies a plan to an OmniModel (or one pipeline stage of it) in
one fixed order, as torchtitan does, so every combination composes the same way:

    tensor parallel -> expert parallel -> context parallel -> activation checkpointing -> compile -> FSDP

Precision. Under bf16 FSDP2 holds the fp32 parameters (what the optimizer steps) and gathers bf16 copies for
forward and backward, reducing gradients in fp32: at every world size, on a 1-rank mesh too (where gathering
is a cast), so that one GPU computes with bf16 weights as many do. fp32 runs shard only when dp x cp > 1.
A ZeRO or replicated stage (`ParallelPlan.sharding`) applies no FSDP: `parallel.zero` reduces its gradients
and steps its slices after the backward, and bf16 is autocast's over fp32 parameters.

Gradient convention. Every rank backpropagates its own share of the step's loss (its tokens' summed loss over
the step's global target count), so a parameter's true gradient is the SUM of the ranks' gradients over
the data-parallel and context-parallel ranks; FSDP is set to sum (divide factor 1), not to average.
Tensor parallelism goes through DTensor, whose redistributions give every TP rank the full gradient of
the parameters it replicates (encoders, embeddings, norms, routers). Experts under EP live on one rank of
their EP group; their data-parallel replicas are the ranks with the same EP index (`dp_mod_ep`).

Encoders. Under the `coupled` layout they are replicated over TP and CP ranks (each runs them on its batch;
the LLM is what these degrees split) and FSDP-sharded with the LLM's data-parallel mesh. Under `omni` they
have their own layout (`parallel.encoders`): replicated over the world, outside the LLM's FSDP units.
MoE experts are split by EP, never by TP (under TP every rank of the group runs the experts on the same
tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from omni_core.common.plan import MESH_ORDER, ParallelPlan
from omni_core.models.llm import TransformerBlock
from omni_core.models.omni import OmniModel

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


@dataclass
class ParallelMeshes:
    """This rank's process groups for a plan. `dp_mesh` is FSDP's (dp_replicate, dp_shard x cp) mesh: None
    when dp x cp is 1 and the parameters stay fp32, 1-D (dp_shard x cp) when dp_replicate is 1;
    `expert_dp_mesh` is the experts' (dp_replicate, dp_mod_ep) mesh, 1-D (dp_mod_ep) when dp_replicate is 1.
    `owns_default_group`: the process group is one rank's, made for these meshes in a plain process."""

    plan: ParallelPlan
    world: DeviceMesh
    dp_mesh: DeviceMesh | None
    expert_dp_mesh: DeviceMesh | None
    ep_mesh: DeviceMesh | None  # (pp, dp_replicate, dp_mod_ep, ep, tp) when ep > 1
    zero_mesh: DeviceMesh | None = None
    owns_default_group: bool = False

    def release(self) -> None:
        """Destroy the process groups these meshes created (every rank calls it once training is done).

        Each gloo group keeps threads that poll while idle: a process that trains plan after plan (the
        estimator's validation) would pile them up and slow down with every plan. The groups' threads stop
        only when nothing holds them any more, and DTensor's caches hold meshes (which hold their groups);
        those caches would also hand a later plan's ops a stale mesh, since meshes compare equal whatever
        their groups. So they are emptied too (private to torch, pinned at 2.13)."""
        from torch.distributed.tensor._api import DTensor
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor._redistribute import (
            _gen_transform_infos,
            clear_redistribute_planner_cache,
        )
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        dist.barrier()  # no rank still has a collective in flight on a group about to go
        meshes = (self.world, self.dp_mesh, self.ep_mesh, self.zero_mesh)
        roots = {id(m._get_root_mesh()): m._get_root_mesh() for m in meshes if m}
        for root in roots.values():
            for pg in root._pg_registry.values():
                if pg not in (dist.GroupMember.WORLD, dist.GroupMember.NON_GROUP_MEMBER):
                    dist.destroy_process_group(pg)
        _clear_sharding_prop_cache()
        DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
        _gen_transform_infos.cache_clear()
        clear_redistribute_planner_cache()
        MeshTopoInfo.build_from_mesh.cache_clear()
        if self.owns_default_group:
            dist.destroy_process_group()

    def _local(self, dim: str) -> int:
        return self.world.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.world.get_group(dim)

    @property
    def pp_rank(self) -> int:
        return self._local("pp")

    @property
    def cp_rank(self) -> int:
        return self._local("cp")

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data shard: ranks that differ only in pp, cp or tp load the same batches."""
        return self.plan.data_rank(dist.get_rank())

    @property
    def ep_group(self) -> dist.ProcessGroup:
        if self.ep_mesh is None:
            raise ValueError(f"plan {self.plan.name} has no expert-parallel group: ep=1")
        return self.ep_mesh.get_group("ep")

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.plan.pp - 1


def build_meshes(plan: ParallelPlan, device_type: str = "cpu", *, shard_params: bool = False) -> ParallelMeshes:
    """Meshes over the LLM's ranks, outermost first (MESH_ORDER: PP crosses nodes, TP stays inside one): the
    whole world, or under `disaggregated` its first `llm_world_size` ranks (every rank builds them, so that
    every rank creates the same process groups in the same order; the encoders' ranks are in none).

    EP is folded into dp_shard x cp: the same ranks, viewed as (dp_mod_ep, ep), give the EP groups and the
    experts' data-parallel groups. `shard_params`: FSDP's mesh also when dp x cp is 1 (bf16 parameters). A
    ZeRO or replicated stage gets ZeRO's mesh instead of FSDP's (its parameters stay fp32 under bf16: autocast
    computes in bf16)."""
    if plan.encoders.ranks:

        def flat_view(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
            # a mesh over part of the world cannot be unflattened from a flat one: each view is its own mesh
            return DeviceMesh(device_type, torch.arange(plan.llm_world_size).view(shape), mesh_dim_names=names)
    else:
        flat = init_device_mesh(device_type, (plan.world_size,), mesh_dim_names=("world",))

        def flat_view(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
            return flat._unflatten(0, shape, names)

    world = flat_view(tuple(plan.mesh_shape().values()), MESH_ORDER)
    dp_mesh = expert_dp_mesh = None
    # FSDP's meshes are 2-D (HSDP) only when there is more than one replica: with a replicate dimension of
    # size 1, FSDP2 would still all-reduce every unit's gradients over that one rank (a blocking call each)
    replicas = ("dp_replicate",) if plan.dp_replicate > 1 else ()
    # the same ranks seen as (pp, dp_replicate, dp_shard x cp, tp)
    dp_view = (
        (plan.pp, plan.dp_replicate, plan.dp_shard * plan.cp, plan.tp),
        ("pp", "dp_replicate", "dp_shard_cp", "tp"),
    )
    zero_mesh = None
    if plan.zero:
        zero_mesh = flat_view(*dp_view)[("dp_replicate", "dp_shard_cp", "tp")]
    elif plan.dp * plan.cp > 1 or shard_params:
        dp_mesh = flat_view(*dp_view)[(*replicas, "dp_shard_cp")]
    ep_mesh = None
    if plan.ep > 1:
        ep_shape = (plan.pp, plan.dp_replicate, plan.dp_shard * plan.cp // plan.ep, plan.ep, plan.tp)
        ep_mesh = flat_view(ep_shape, ("pp", "dp_replicate", "dp_mod_ep", "ep", "tp"))
        expert_dp_mesh = ep_mesh[(*replicas, "dp_mod_ep")]
    return ParallelMeshes(plan, world, dp_mesh, expert_dp_mesh, ep_mesh, zero_mesh)


BlockSlot = tuple[nn.Module, str]  # a transformer block's container (a `layers`) and its name in it


def transformer_blocks(model: OmniModel) -> list[BlockSlot]:
    """(container, name) of every transformer block this model part holds: encoders' and the LLM's `layers`."""
    blocks: list[BlockSlot] = []
    for part in (getattr(model, "vision", None), getattr(model, "audio", None), model.llm):
        if part is None:
            continue
        layers = part.layers
        keys = layers.keys() if isinstance(layers, nn.ModuleDict) else range(len(layers))
        blocks.extend((layers, str(key)) for key in keys)
    return blocks


def llm_blocks(model: OmniModel) -> list[TransformerBlock]:
    """The LLM blocks this model part holds, before activation checkpointing or compile wraps them (until
    then `llm.layers` registers nothing but `TransformerBlock`s)."""
    return [cast(TransformerBlock, block) for block in model.llm.layers.values()]


def apply_tensor_parallel(model: OmniModel, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism over the flat packed tokens (dim 0).

    Between blocks the residual stream is this rank's 1/tp slice of the tokens; norms run on the slice;
    attention and the FFN all-gather tokens on entry and reduce-scatter on exit (column-parallel q/k/v and
    w1/w3, row-parallel wo and w2). The stage holding the embeddings slices the full sequence at the first
    block; the last stage gathers it back before the output head, whose logits are replicated."""
    from torch.distributed.tensor.parallel import parallelize_module

    llm = model.llm
    for block in llm_blocks(model):
        parallelize_module(block, tp_mesh, {**_attention_plan(), **_feed_forward_plan(block)})
    if llm.tok_embeddings is not None:
        _slice_tokens_at_first_block(model, tp_mesh)
    if llm.output is not None:
        _gather_tokens_for_head(model, tp_mesh)


def _attention_plan() -> dict[str, ParallelStyle]:
    """A block's attention half: its norm on the token slice, all tokens gathered into column-parallel q/k/v,
    the row-parallel output reduce-scattered back to the slice."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "attention_norm": SequenceParallel(sequence_dim=0),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(0), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(0)),
    }


def _feed_forward_plan(block: TransformerBlock) -> dict[str, ParallelStyle]:
    """A block's FFN half: its norm on the token slice; a dense FFN column- then row-parallel on all tokens;
    a MoE's tokens gathered whole around it (its experts are split by EP, never by TP)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, ParallelStyle] = {"ffn_norm": SequenceParallel(sequence_dim=0)}
    if block.moe_enabled:
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(0),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(0),),
            use_local_output=True,
        )
    else:
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w3"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(0))
    return plan


def _slice_tokens_at_first_block(model: OmniModel, tp_mesh: DeviceMesh) -> None:
    """The stage with the embeddings: the first block takes the full sequence and keeps this rank's slice."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    first = next(iter(model.llm.layers.values()))
    parallelize_module(
        first,
        tp_mesh,
        PrepareModuleInput(
            input_layouts=(Replicate(), None, None, None),
            desired_input_layouts=(Shard(0), None, None, None),
            use_local_output=True,
        ),
    )


def _gather_tokens_for_head(model: OmniModel, tp_mesh: DeviceMesh) -> None:
    """The stage with the head: the final norm on the slice, the output head on all tokens, logits replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    parallelize_module(
        model.llm,
        tp_mesh,
        {
            "norm": SequenceParallel(sequence_dim=0),
            "output": ColwiseParallel(input_layouts=Shard(0), output_layouts=Replicate()),
        },
    )


def apply_context_parallel(model: OmniModel, plan: ParallelPlan, meshes: ParallelMeshes, total_tokens: int) -> None:
    """Every LLM block attends through CP collectives, and MoE balancing statistics cover the whole
    sequence; the stage with the embeddings keeps this rank's tokens (a contiguous chunk for Ulysses,
    zig-zag head and tail chunks for ring)."""
    from omni_core.parallel.context import ContextParallelAttention, cp_token_index

    attend = ContextParallelAttention(plan.cp_kind, meshes.group("cp"), total_tokens)
    for block in llm_blocks(model):
        block.attention.attend = attend
        if block.moe_enabled:
            # MoE's attribute is typed by its initial None (models/llm.py); a process group is what it holds
            block.moe.sequence_group = meshes.group("cp")  # type: ignore[assignment]
    model.token_index = cp_token_index(total_tokens, plan.cp, meshes.cp_rank, plan.cp_kind)


def apply_activation_checkpointing(model: OmniModel, mode: str = "full", skip: Collection[str] = ()) -> None:
    """Recompute activations in backward. `full`: each block's, from its input (memory O(blocks) instead of
    O(blocks x activations)). `selective`: per operator, keeping what `selective_checkpoint_context` keeps
    (torchtitan's policy, which the estimator prices as its "op" option). Checkpoint keys are unchanged (DCP's
    state-dict helpers strip the wrapper's prefix). The encoders in `skip` are left alone: their sharded
    blocks recompute already (`parallel.encoder_shards`)."""
    if mode not in ("full", "selective"):
        raise ValueError(f"train.activation_checkpointing={mode!r}: full or selective here (none applies nothing)")
    from torch.utils.checkpoint import noop_context_fn

    context_fn = selective_checkpoint_context if mode == "selective" else noop_context_fn
    skipped = [getattr(model, name).layers for name in skip if getattr(model, name, None) is not None]
    for container, name in transformer_blocks(model):
        if not any(container is layers for layers in skipped):
            block = container.get_submodule(name)
            container.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn))


@functools.cache
def _kept_operators() -> set:
    """Operators whose outputs selective checkpointing keeps besides every other matmul: the attention kernels
    (SDPA's per backend, the varlen custom op), and TP's reduce-scatter (recomputing it would be a collective)."""
    import torch.nn.attention.varlen  # registers torch.ops.torch_attn

    aten = torch.ops.aten
    sdpa = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    kept = {getattr(aten, name).default for name in sdpa if hasattr(aten, name)}
    kept.add(torch.ops.torch_attn._varlen_attn.default)
    kept.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return kept


@functools.cache
def _matmuls() -> set:
    """The matmuls the policy counts: a linear layer's (with and without bias) and the MoE's grouped GEMM."""
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten._grouped_mm.default}


def selective_checkpoint_context() -> tuple:
    """The context pair of one checkpointed block's forward and recompute (`torch.utils.checkpoint`'s
    `context_fn`): keep the attention kernels' outputs and those of the 1st, 3rd, 5th... matmul of the block,
    recompute the rest (the other matmuls and every element-wise operator) in backward. The matmuls are counted
    apart in the forward and in the recompute, which see them in the same order."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept, matmuls = _kept_operators(), _matmuls()
    seen = {False: 0, True: 0}  # matmuls so far, by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in matmuls:
            seen[ctx.is_recompute] += 1
            keep = seen[ctx.is_recompute] % 2 == 1
        else:
            keep = op in kept
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_compile(model: OmniModel) -> None:
    """Compile block by block (the blocks repeat, so one graph serves them all), once for every packed layout.
    Before each call the token dimension of the block's inputs is marked dynamic, so that a new token count
    recompiles nothing, and host offsets handed as a list (the encoders') are wrapped as `PackedDocuments`,
    whose integers dynamo leaves alone (a list's it would guard, one graph per layout); attention, which reads
    them, runs outside the graph (`models.attention.keep_attention_out_of_graphs`), so that a new document layout
    recompiles nothing either. Only the token dimension is dynamic: the weights' shapes stay static, as the
    kernels like them. `compiled_graphs` counts the graphs compiled, for a benchmark to see none after warm-up."""
    from omni_core.models.attention import keep_attention_out_of_graphs, mark_tokens_dynamic
    from omni_core.models.documents import PackedDocuments

    def mark_inputs(module: nn.Module, args: tuple) -> tuple:
        mark_tokens_dynamic(*args)
        offsets = [isinstance(a, list) and all(isinstance(v, int) for v in a) for a in args]
        return tuple(PackedDocuments.of(a) if is_offsets else a for a, is_offsets in zip(args, offsets))

    keep_attention_out_of_graphs()
    for container, name in transformer_blocks(model):
        compiled = cast(nn.Module, torch.compile(container.get_submodule(name)))
        compiled.register_forward_pre_hook(mark_inputs)
        container.register_module(name, compiled)


def compiled_graphs() -> int | None:
    """Graphs torch.compile has captured in this process so far: a step that adds none recompiled nothing.
    Dynamo's counter (`torch._dynamo.utils.counters`, private, kept from torch 2.0 through 2.13) is read only
    where dynamo is loaded (0 graphs otherwise); None where the counter is missing."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    counters = getattr(utils, "counters", None)
    return None if counters is None else int(counters["stats"]["unique_graphs"])


def encoder_modules(model: OmniModel) -> list[nn.Module]:
    """The encoders and projectors this model part holds."""
    modules = [getattr(model, name, None) for name in ("vision", "audio")]
    if getattr(model, "projectors", None) is not None:
        modules.extend(model.projectors.values())
    return [m for m in modules if m is not None]


def apply_fsdp(model: OmniModel, meshes: ParallelMeshes, param_dtype: torch.dtype) -> None:
    """FSDP2 (HSDP when dp_replicate > 1): each block, each encoder and projector, then the root, so one
    block's parameters are gathered at a time. Experts under EP are sharded over their own replicas first,
    which keeps them out of the dense mesh. Reductions sum (see the module docstring). Under the `omni`
    layout the encoders are left to their own layout, the root ignoring their parameters, except on one rank,
    where `omni` runs as `coupled`."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    mesh = meshes.dp_mesh
    coupled = meshes.plan.encoders.layout == "coupled" or meshes.plan.world_size == 1
    for container, name in transformer_blocks(model):
        block = container.get_submodule(name)
        if not coupled and container is not model.llm.layers:
            continue  # an encoder block, in the encoders' own layout
        moe = getattr(getattr(block, "_checkpoint_wrapped_module", block), "moe", None)
        if moe is not None and meshes.expert_dp_mesh is not None:
            fully_shard(moe.experts, mesh=meshes.expert_dp_mesh, mp_policy=mp_policy)  # run as one (`Experts`)
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    encoders = encoder_modules(model)
    if coupled:
        for module in encoders:
            fully_shard(module, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    else:
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, ignored_params={p for m in encoders for p in m.parameters()})
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def parallelize_omni(
    model: OmniModel,
    plan: ParallelPlan,
    meshes: ParallelMeshes | None,
    *,
    tokens_per_microbatch: int,
    activation_checkpointing: str = "none",
    compile: bool = False,
    param_dtype: torch.dtype = torch.float32,
) -> OmniModel:
    """Apply `plan` to a model (part) in place; `meshes` is None on a single process."""
    if meshes is not None:
        if plan.tp > 1:
            apply_tensor_parallel(model, meshes.world["tp"])
        if plan.ep > 1:
            from omni_core.parallel.expert import apply_expert_parallel

            for block in llm_blocks(model):
                if block.moe_enabled:
                    apply_expert_parallel(block.moe, meshes.ep_group)
        if plan.cp > 1:
            apply_context_parallel(model, plan, meshes, tokens_per_microbatch)
    if activation_checkpointing != "none":
        apply_activation_checkpointing(model, activation_checkpointing, skip=plan.encoders.sharded)
    if compile:
        apply_compile(model)
    if meshes is not None and meshes.dp_mesh is not None:
        apply_fsdp(model, meshes, param_dtype)
    return model

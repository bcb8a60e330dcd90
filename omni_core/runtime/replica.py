"""This rank's share of the model under a plan: the whole model built on the meta device on every rank (the
flavor's architecture, pretrained parts' from their configs), cut into the parts this rank holds (pipeline
stage chunks, or the encoders on the encoders' own ranks), parallelized, and only then allocated and filled
with this rank's shards (`model_init`); with the pipeline runner and encoder step that the training step
drives them through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from omni_core.common.plan import ParallelPlan
from omni_core.data.balance_groups import balance_group_size
from omni_core.models.args import OmniModelArgs
from omni_core.models.attention import set_attention
from omni_core.models.omni import OmniModel, init_specs
from omni_core.parallel.parallelize import ParallelMeshes, build_meshes, encoder_modules, parallelize_omni
from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.model_init import materialize, own_name, recipe_args
from omni_core.runtime.plan_rules import check_buildable, shards_per_node

if TYPE_CHECKING:
    from omni_core.parallel.encoders import EncoderStep
    from omni_core.parallel.pipeline import PipelineRunner


@dataclass
class ModelReplica:
    """This rank's share of the model: one part, or several pipeline stage chunks, laid out by `plan`."""

    plan: ParallelPlan
    parts: list[OmniModel]
    meshes: ParallelMeshes | None  # None on a single process that trains fp32 parameters
    pipeline: PipelineRunner | None = None  # when plan.pp > 1
    encoders: EncoderStep | None = None  # under `omni` and `disaggregated` (several ranks)

    @property
    def args(self) -> OmniModelArgs:
        return self.parts[0].args

    @property
    def data_rank(self) -> int:
        return self.meshes.dp_rank if self.meshes else 0

    @property
    def loads_data(self) -> bool:
        """Whether this rank reads batches: every LLM rank (not the encoders' own, under `disaggregated`)."""
        rank = dist.get_rank() if self.meshes is not None else 0
        return rank < self.plan.llm_world_size

    @property
    def batch_copies(self) -> int:
        """Ranks that load the same batch: they differ only in tp, cp or pp."""
        return self.plan.tp * self.plan.cp * self.plan.pp

    def trainable(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters() if p.requires_grad]

    def num_params(self) -> int:
        """Parameters of the whole model (not this rank's shard)."""
        from omni_core.models.flops import omni_params

        return omni_params(self.args)["total"]

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)


def build_replica(recipe: Recipe, plan: ParallelPlan, info: DistInfo, compute_dtype: torch.dtype) -> ModelReplica:
    """Build the full model on the meta device, split and parallelize it, then fill this rank's shards from the
    seed (the values of a whole model's `init_weights`) and the pretrained parts' files. On one
    process `omni` is the same placement as `coupled` (the encoders on the one rank) and runs as it. Under
    `disaggregated` the encoders' own ranks keep only the encoders, the LLM ranks only the LLM. bf16 shards
    the parameters at every world size (`parallel.parallelize`), so one process builds meshes then too."""
    check_buildable(plan, recipe.train.compile)
    bf16_params = compute_dtype != torch.float32
    meshes = None
    if info.world_size > 1 or bf16_params:
        made_group = info.world_size == 1 and one_rank_group(info.device)
        meshes = build_meshes(plan, info.device.type, shard_params=bf16_params)
        meshes.owns_default_group = made_group
    args, pretrained = recipe_args(recipe)
    with torch.device("meta"):  # allocated where it lives, after the plan has cut it (`model_init`)
        model = OmniModel(args)
    specs = init_specs(model)
    set_attention(model, recipe.model.attention)
    for name in recipe.model.freeze:
        for param in getattr(model, name).parameters():
            param.requires_grad_(False)
    encoders_train = any(p.requires_grad for m in encoder_modules(model) for p in m.parameters())
    # A part this rank does not hold stays registered, holding None (as in a pipeline stage chunk), so the
    # kept parameters keep the whole model's names.
    if info.rank >= plan.llm_world_size:  # one of the encoders' own ranks
        model.register_module("llm", None)
        parts = [model]
    else:
        if plan.encoders.layout == "disaggregated":
            for name in ("vision", "audio", "projectors"):
                model.register_module(name, None)
        parts = llm_parts(model, plan, meshes, recipe, compute_dtype)
    materialize(parts, specs, pretrained, args, info.device, recipe.experiment.seed)
    if meshes is not None and meshes.zero_mesh is not None and info.rank < plan.llm_world_size:
        from omni_core.parallel.zero import attach_zero

        for part in parts:  # after materializing: the optimizer's slices view the parameters
            attach_zero(part, plan, meshes.zero_mesh, own_name)
    replica = ModelReplica(plan, parts, meshes)
    tokens = recipe.data.seq_len * recipe.data.micro_batch
    if plan.encoders.layout != "coupled" and info.world_size > 1:
        from omni_core.parallel.encoders import EncoderStep

        balance = recipe.data.balance
        group = balance_group_size(balance.policy, balance.group_size, plan.dp, shards_per_node(plan, info.world_size))
        replica.encoders = EncoderStep(parts[0], plan, tokens, encoders_train, info.device, group)
    if plan.pp > 1 and replica.loads_data:
        from omni_core.parallel.pipeline import PipelineRunner

        assert meshes is not None  # pp > 1 spans several ranks, which build meshes
        replica.pipeline = PipelineRunner(
            parts, plan, meshes.group("pp"), meshes.pp_rank, info.device, recipe.train.grad_accum
        )
    return replica


def one_rank_group(device: torch.device) -> bool:
    """A one-rank process group for a process that torchrun did not start (tests, in-process runs), which
    FSDP2's mesh needs; True when it made one (`ParallelMeshes.release` then destroys it)."""
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def llm_parts(
    model: OmniModel, plan: ParallelPlan, meshes: ParallelMeshes | None, recipe: Recipe, compute_dtype: torch.dtype
) -> list[OmniModel]:
    """This LLM rank's model parts (pipeline stage chunks), each parallelized by the plan."""
    if plan.pp > 1:
        from omni_core.parallel.pipeline import pipeline_split

        assert meshes is not None  # pp > 1 spans several ranks, which build meshes
        parts = pipeline_split(model, plan, meshes.pp_rank)
    else:
        parts = [model]
    for part in parts:
        parallelize_omni(
            part,
            plan,
            meshes,
            tokens_per_microbatch=recipe.data.seq_len * recipe.data.micro_batch,
            activation_checkpointing=recipe.train.activation_checkpointing,
            compile=recipe.train.compile,
            param_dtype=compute_dtype,
        )
    return parts

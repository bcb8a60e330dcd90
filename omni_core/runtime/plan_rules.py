"""The rules that decide a launch's plan before anything is built: the recipe's plan on a world, checked
against the model (`resolve_plan`), what the runtime refuses to build (`check_buildable`) and the default
balancing group (`shards_per_node`). The launch (`trainer`, `replica`) and its checks (`preflight`) ask these
same rules; they need no torch, so `omni recipe check` answers without loading it."""

from __future__ import annotations

import os

from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.models import hf_config
from omni_core.models.args import LLMArgs
from omni_core.models.flavors import get_flavor
from omni_core.recipe.schema import Recipe


def resolve_plan(recipe: Recipe, world_size: int) -> ParallelPlan:
    """The recipe's plan on this world, checked against the model and the packed sequence length."""
    plan = ParallelPlan.from_config(recipe.parallel, world_size)
    plan.check_model(recipe_llm(recipe).shape(seq_len=recipe.data.seq_len * recipe.data.micro_batch))
    plan.check_microbatches(recipe.train.grad_accum)
    return plan


def recipe_llm(recipe: Recipe) -> LLMArgs:
    """The LLM the recipe trains: the pretrained one's config (`model.pretrained.llm`, read without torch), else
    the flavor's. Raises what `hf_config` raises for a config it cannot read or honour."""
    folder = recipe.model.pretrained.llm
    if folder is None:
        return get_flavor(recipe.model.flavor, patch_size=recipe.data.patch_size, n_mels=recipe.data.n_mels).llm
    return hf_config.llm_args_from_config(*hf_config.read_config(folder))[0]


def check_buildable(plan: ParallelPlan, compile: bool = False) -> None:
    """Refuse what the estimator prices but the runtime does not build (PlanError), before any rank starts."""
    sharded = plan.encoders.sharded
    if sharded and compile:
        raise PlanError(
            f"plan {plan.name}: encoders.{sharded[0]}.fsdp with train.compile is not built (a step "
            "installs the gathered weights in the encoder blocks, which compiled blocks were not tested "
            "with); set train.compile=false or replicate the encoder"
        )


def shards_per_node(plan: ParallelPlan, world_size: int) -> int:
    """Data shards whose ranks share this node (torchrun's LOCAL_WORLD_SIZE; one node of `world_size` ranks
    when it is unset): the default balancing group."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, min(plan.dp, local * plan.dp // plan.llm_world_size))

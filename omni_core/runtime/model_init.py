"""This rank's parameters, made where they live: the model is built on the meta device and parallelized there
(`replica.build_replica`), then each part is allocated on the rank's device (`to_empty`) and every parameter
gets only this rank's shard of its value: read from a pretrained part's safetensors (memory-mapped, only the
shard's rows and columns), or computed from the seed one whole tensor at a time (`omni.init_specs`, the same
values a whole model's `init_weights` gives on that device type), so no rank ever holds the whole model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from omni_core.common.tokenizer import tokenizer_for
from omni_core.common.torch_compat import local_box, local_shard
from omni_core.models import hf_import
from omni_core.models.args import OmniModelArgs
from omni_core.models.hf_config import PARTS
from omni_core.models.llm import LLM
from omni_core.models.omni import InitSpec, OmniModel, initial_value
from omni_core.models.pretrained import PretrainedPart, recipe_model_args
from omni_core.recipe.schema import Recipe


def recipe_args(recipe: Recipe, parts: Sequence[str] = PARTS) -> tuple[OmniModelArgs, dict[str, PretrainedPart]]:
    """The recipe's model args and its pretrained parts (`parts` of `model.pretrained`: all by default). An LLM
    gets the rows of the tokens its tokenizer adds (the media placeholders) beyond its config's vocabulary."""
    llm = recipe.model.pretrained.llm is not None and "llm" in parts
    return recipe_model_args(recipe, parts, tokenizer_for(recipe).vocab_size if llm else 0)


def unfilled_model(recipe: Recipe, device: torch.device) -> OmniModel:
    """The recipe's whole model allocated on `device` with no values yet: for weights a checkpoint then loads
    (evaluation), so nothing is drawn or read for them first."""
    with torch.device("meta"):
        model = OmniModel(recipe_args(recipe)[0])
    model.to_empty(device=device)
    _tie_heads(model)
    return model


# Module names that wrappers insert between a model's own (activation checkpointing, torch.compile)
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def own_name(name: str) -> str:
    """A parameter's name in the unwrapped model."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


@torch.no_grad()
def materialize(
    parts: Sequence[nn.Module],
    specs: Sequence[InitSpec],
    pretrained: Mapping[str, PretrainedPart],
    args: OmniModelArgs,
    device: torch.device,
    seed: int,
) -> None:
    """Allocate `parts` (built on meta, parallelized) on `device` and fill each parameter's local shard.

    `specs`: the whole model's `init_specs`, taken before it was split: every rank draws the same sequence,
    the tensors it does not hold included, so a shard's values do not depend on the plan. Parameters of a
    pretrained part are read from its files instead (and draw nothing)."""
    for part in parts:
        part.to_empty(device=device)
        _tie_heads(part)
    targets: dict[str, list[nn.Parameter]] = {}
    for part in parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            targets.setdefault(own_name(name), []).append(param)
    generator = torch.Generator(device=device).manual_seed(seed)
    for spec in specs:
        if spec.name.split(".", 1)[0] in pretrained:
            continue
        held = targets.get(spec.name, [])
        whole = next((param for param in held if not isinstance(param, DTensor)), None)
        value = initial_value(spec, generator, out=whole)  # drawn on every rank, held here or not
        for param in held:
            if param is not whole:
                _write(param, value)
    for part_name, where in pretrained.items():
        with torch.device("meta"):  # names the part's tensors in its files
            module = hf_import.part_module(getattr(args, part_name))
        located = hf_import.checked_tensors(module, where.directory, where.layout, where.prefix)
        for name, (file, key) in located.items():
            for param in targets.get(f"{part_name}.{name}", []):
                _write(param, hf_import.read_shard(file, key, param.shape, local_box(param)))


def _tie_heads(part: nn.Module) -> None:
    """`to_empty` allocates each module's parameters apart, so a tied head gets its own tensor (FSDP2 keeps
    the tie, a plain module does not): tie it to the embedding again."""
    for module in part.modules():
        if not (isinstance(module, LLM) and module.args.tied_embeddings):
            continue
        head, embedding = module.output, module.tok_embeddings
        if isinstance(head, nn.Linear) and isinstance(embedding, nn.Embedding):  # not dropped by a pipeline stage
            head.weight = embedding.weight


def _write(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy `value` into the parameter's local shard: `value` is that shard already when its shape is the
    local one (read from a file), else the whole tensor, of which the shard is kept."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if isinstance(param, DTensor) and value.shape != local.shape:
        value = local_shard(value, param)
    local.copy_(value.to(local.device))

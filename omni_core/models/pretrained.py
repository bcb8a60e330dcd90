"""A model whose parts start from transformers checkpoints (`recipe.model.pretrained`): each given part's
architecture comes from its config.json and replaces the flavor's, the dims that connect the parts (the
projectors' widths) follow from the parts, and the parts not given stay the flavor's. Configs only (no torch):
the estimator and the loader's cost model price the same model the runtime builds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from omni_core.models import hf_config
from omni_core.models.args import AudioArgs, LLMArgs, OmniModelArgs, VisionArgs
from omni_core.models.flavors import get_flavor

if TYPE_CHECKING:
    from omni_core.recipe.schema import Recipe


@dataclass(frozen=True)
class PretrainedPart:
    """Where a part's weights are: its checkpoint directory, the name table they are in, and their prefix."""

    directory: Path
    layout: str
    prefix: str


def omni_args(
    flavor: str,
    pretrained: Mapping[str, str | None],
    *,
    patch_size: int,
    n_mels: int,
    vocab_size: int = 0,
) -> tuple[OmniModelArgs, dict[str, PretrainedPart]]:
    """The model's args and its pretrained parts. `vocab_size`: the recipe's tokenizer's; an LLM whose file
    has fewer rows gets the rest (`hf_import.read_shard` fills them). Raises ValueError naming the recipe field
    for a part whose inputs the data settings do not make, `ConfigRefused` / FileNotFoundError from the config."""
    args = get_flavor(flavor, patch_size=patch_size, n_mels=n_mels)
    parts: dict[str, PretrainedPart] = {}
    for part, directory in pretrained.items():
        if directory is None:
            continue
        part_args, layout, prefix = hf_config.part_args(directory, part)
        source = Path(directory) / "config.json"
        if isinstance(part_args, VisionArgs) and part_args.patch_dim != 3 * patch_size * patch_size:
            raise ValueError(
                f"{source} has patch_size {round((part_args.patch_dim // 3) ** 0.5)}, "
                f"but data.patch_size is {patch_size}: set data.patch_size to the tower's"
            )
        if isinstance(part_args, AudioArgs) and part_args.n_mels != n_mels:
            raise ValueError(
                f"{source} has num_mel_bins {part_args.n_mels}, "
                f"but data.n_mels is {n_mels}: set data.n_mels to the encoder's"
            )
        if isinstance(part_args, LLMArgs):
            args = replace(args, llm=replace(part_args, vocab_size=max(vocab_size, part_args.vocab_size)))
        elif isinstance(part_args, VisionArgs):
            args = replace(args, vision=part_args)
        else:
            args = replace(args, audio=part_args)
        parts[part] = PretrainedPart(Path(directory), layout, prefix)
    return args, parts


def recipe_model_args(
    recipe: Recipe, parts: Sequence[str] = hf_config.PARTS, vocab_size: int = 0
) -> tuple[OmniModelArgs, dict[str, PretrainedPart]]:
    """The recipe's model: `omni_args` over the parts of `model.pretrained` named in `parts` (all by default),
    with the model section's options (the vision feature layer, Qwen2-Audio's pool and projector)."""
    pretrained = recipe.model.pretrained.model_dump()
    args, found = omni_args(
        recipe.model.flavor,
        {part: folder for part, folder in pretrained.items() if part in parts},
        patch_size=recipe.data.patch_size,
        n_mels=recipe.data.n_mels,
        vocab_size=vocab_size,
    )
    m = recipe.model
    return replace(
        args,
        vision=replace(args.vision, final_norm=m.vision_final_norm),
        audio=replace(args.audio, pool=m.audio_pool),
        audio_projector=m.audio_projector,
    ), found


def check_weights(args: OmniModelArgs, parts: Mapping[str, PretrainedPart]) -> None:
    """Every pretrained part's files hold exactly the tensors its config describes, with their shapes
    (headers only: the modules are built on the meta device). Raises ValueError naming file and tensor."""
    import torch

    from omni_core.models import hf_import

    for part, where in parts.items():
        with torch.device("meta"):
            module = hf_import.part_module(getattr(args, part))
        hf_import.checked_tensors(module, where.directory, where.layout, where.prefix)

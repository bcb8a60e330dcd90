"""MegaScale-Omni's workloads A-D (a ViT and an LLM of the paper's sizes) at a given share of the LLM's tokens
coming from images: the jobs its comparison of encoder layouts is rerun on. `paper_workload` is the paper's
fixed mix (every image 1,024 patches, text documents of TEXT_DOC tokens); `mix_workload` builds the same job
from any `SequenceMix`, such as a drawn step's (`estimator.dynamic`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni_core.estimator.transformer_layers import llm_layers, projector, vit
from omni_core.estimator.workloads import EncoderItems, Layer, Workload, quadratic_share

if TYPE_CHECKING:
    from omni_core.models.args import OmniModelArgs, VisionArgs

PAPER_WORKLOADS = {  # name: (model flavor, GPUs, seq_len, global batch)
    "A": ("vit-1b+llama-12b", 64, 16384, 32),
    "B": ("vit-2.4b+llama-70b", 128, 16384, 64),
    "C": ("vit-10b+llama-70b", 256, 8192, 128),
    "D": ("vit-10b+gpt-175b", 512, 8192, 256),
}
PATCH = 14
PATCHES_PER_IMAGE = 1024  # 448 x 448 px at patch 14 (32 x 32 patches)
MERGE = 4  # 2 x 2 patch merge before the projector: 256 LLM tokens per image
TEXT_DOC = 2048  # tokens per text document inside a packed sequence


@dataclass(frozen=True)
class SequenceMix:
    """What one packed sequence holds, on average over a step's sequences: its images (`patches` of them in
    all, their squares summing to `patches_sq`: the ViT's attention) and its text documents (`text_sq`: their
    squared lengths). The LLM tokens the images leave (seq_len - patches / MERGE) are text."""

    images: float
    patches: float
    patches_sq: float
    text_docs: float
    text_sq: float
    longest_image: float = 0.0  # patches of the step's longest image (0: every image of the mean length)
    encoder_cv: float | None = None  # spread of encoder work per sequence (None: images are a count, 1/sqrt)

    @classmethod
    def fixed(cls, image_share: float, seq_len: int) -> SequenceMix:
        """The paper's mix: `image_share` of the tokens from images of PATCHES_PER_IMAGE patches, the rest
        from TEXT_DOC-token documents."""
        images = image_share * seq_len / (PATCHES_PER_IMAGE / MERGE)
        text = seq_len - image_share * seq_len
        return cls(images, images * PATCHES_PER_IMAGE, images * PATCHES_PER_IMAGE**2, text / TEXT_DOC, text * TEXT_DOC)


def paper_args(key: str) -> OmniModelArgs:
    """Workload `key`'s model (its ViT at the paper's patch size)."""
    from omni_core.models.flavors import get_flavor

    return get_flavor(PAPER_WORKLOADS[key][0], patch_size=PATCH, n_mels=128)


def paper_workload(key: str, image_share: float) -> Workload:
    """Workload `key` (A-D) with `image_share` of the LLM's tokens coming from images (0.1 = 1:9 image:text)."""
    return mix_workload(key, SequenceMix.fixed(image_share, PAPER_WORKLOADS[key][2]), f"{key}@{image_share:.1f}")


def mix_workload(key: str, mix: SequenceMix, name: str, args: OmniModelArgs | None = None) -> Workload:
    """Workload `key` (A-D) whose sequences hold `mix` (`args`: its model, when the caller has built it)."""
    _, _, seq_len, batch = PAPER_WORKLOADS[key]
    args = args or paper_args(key)
    v, llm = args.vision, args.llm
    images, patches = mix.images, mix.patches
    text_tokens = seq_len - patches / MERGE
    docs = images + mix.text_docs
    sum_sq = mix.patches_sq / MERGE**2 + mix.text_sq
    encoder = _vision_encoder(v, llm.dim, mix)
    items = _image_items(encoder, v, mix)
    longest = _item_work(encoder, mix, mix.longest_image) if mix.longest_image else (1 / images if images else 0.0)
    return Workload(
        name,
        llm_layers(llm, seq_len, sum_sq, docs),
        batch,
        llm.shape(seq_len),
        encoder=encoder,
        tokens_per_sample=seq_len,
        # images per sequence are a count: spread ~ 1 / sqrt(mean), unless the mix measured it
        encoder_cv=mix.encoder_cv if mix.encoder_cv is not None else (images**-0.5 if images else 0.0),
        encoder_max_item=longest,
        items=items,
        head_dim=llm.dim // llm.n_heads,
        doc_span=sum_sq / max(text_tokens + patches / MERGE, 1.0),
    )


def _vision_encoder(v: VisionArgs, llm_dim: int, mix: SequenceMix) -> tuple[Layer, ...]:
    """The ViT over the sequence's images and the projector of their merged patches."""
    return (
        *vit(
            "vision",
            n_layers=v.n_layers,
            dim=v.dim,
            heads=v.n_heads,
            patches=mix.patches,
            sum_sq=mix.patches_sq,
            images=mix.images,
            patch_dim=v.patch_dim,
            mlp_ratio=v.mlp_ratio,
        ),
        projector("projector.image", v.dim * MERGE, llm_dim, llm_dim, mix.patches / MERGE),
    )


def _item_work(encoder: tuple[Layer, ...], mix: SequenceMix, patches: float) -> float:
    """An image of `patches` patches' encoder work, in a mean sequence's: linear layers by its patches,
    attention by their square."""
    linear = sum(layer.flops for layer in encoder)
    quadratic = sum(layer.attn_flops for layer in encoder)
    total = linear + quadratic
    if not total:
        return 0.0
    return (linear * patches / mix.patches + quadratic * patches**2 / mix.patches_sq) / total


def _image_items(encoder: tuple[Layer, ...], v: VisionArgs, mix: SequenceMix) -> EncoderItems:
    """The sequence's images as the `omni` layout balances them; none without images."""
    if not mix.images:
        return EncoderItems()
    return EncoderItems(
        "vision",
        mix.images,
        mix.patches / mix.images,
        v.n_heads,
        quadratic_share(encoder),
        1 / mix.images,
        4.0 * mix.patches * v.patch_dim,
    )

"""MegaScale-Omni's workloads A-D (a ViT and an LLM of the paper's sizes) at a given share of the LLM's tokens
coming from images: the jobs its comparison of encoder layouts is rerun on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_core.estimator.transformer_layers import llm_layers, projector, vit
from omni_core.estimator.workloads import EncoderItems, Layer, Workload, quadratic_share

if TYPE_CHECKING:
    from omni_core.models.args import VisionArgs

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


def paper_workload(key: str, image_share: float) -> Workload:
    """Workload `key` (A-D) with `image_share` of the LLM's tokens coming from images (0.1 = 1:9 image:text)."""
    from omni_core.models.flavors import get_flavor

    flavor, _, seq_len, batch = PAPER_WORKLOADS[key]
    args = get_flavor(flavor, patch_size=PATCH, n_mels=128)
    v, llm = args.vision, args.llm
    image_tokens = image_share * seq_len
    images = image_tokens / (PATCHES_PER_IMAGE / MERGE)
    patches = images * PATCHES_PER_IMAGE
    text_tokens = seq_len - image_tokens
    docs = images + text_tokens / TEXT_DOC
    sum_sq = images * (PATCHES_PER_IMAGE / MERGE) ** 2 + text_tokens * TEXT_DOC
    encoder = _vision_encoder(v, llm.dim, images, patches)
    return Workload(
        f"{key}@{image_share:.1f}",
        llm_layers(llm, seq_len, sum_sq, docs),
        batch,
        llm.shape(seq_len),
        encoder=encoder,
        tokens_per_sample=seq_len,
        encoder_cv=images**-0.5 if images else 0.0,  # images per sequence are a count: spread ~ 1 / sqrt(mean)
        encoder_max_item=1 / images if images else 0.0,
        items=_image_items(encoder, v, images, patches),
        head_dim=llm.dim // llm.n_heads,
        doc_span=sum_sq / seq_len,
    )


def _vision_encoder(v: VisionArgs, llm_dim: int, images: float, patches: float) -> tuple[Layer, ...]:
    """The ViT over the sequence's images and the projector of their merged patches."""
    return (
        *vit(
            "vision",
            n_layers=v.n_layers,
            dim=v.dim,
            heads=v.n_heads,
            patches=patches,
            sum_sq=images * PATCHES_PER_IMAGE**2,
            images=images,
            patch_dim=v.patch_dim,
            mlp_ratio=v.mlp_ratio,
        ),
        projector("projector.image", v.dim * MERGE, llm_dim, llm_dim, patches / MERGE),
    )


def _image_items(encoder: tuple[Layer, ...], v: VisionArgs, images: float, patches: float) -> EncoderItems:
    """The sequence's images as the `omni` layout balances them (all of one length); none without images."""
    if not images:
        return EncoderItems()
    return EncoderItems(
        "vision",
        images,
        PATCHES_PER_IMAGE,
        v.n_heads,
        quadratic_share(encoder),
        1 / images,
        4.0 * patches * v.patch_dim,
    )

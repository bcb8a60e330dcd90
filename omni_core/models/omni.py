"""OmniModel: vision and audio encoders whose projected outputs are anchored into the LLM's packed sequence
(videos take the vision encoder per frame and the image projector, see `encode_video`)."""

from __future__ import annotations

import torch
from torch import nn

from omni_core.common.batch import PackedBatch
from omni_core.common.tokenizer import AUDIO_ID, IMAGE_ID, VIDEO_ID
from omni_core.models.args import OmniModelArgs
from omni_core.models.audio import AudioEncoder
from omni_core.models.feed_forward import MoE
from omni_core.models.flavors import get_flavor
from omni_core.models.flops import omni_train_flops, projector_dims
from omni_core.models.llm import LLM
from omni_core.models.projector import Projector, spatial_merge
from omni_core.models.vision import VisionEncoder


class OmniModel(nn.Module):
    """PackedBatch -> logits [T, vocab]; `aux_loss` then holds the MoE load-balancing loss to add to the loss.

    Submodule names (`vision`, `audio`, `projectors["image"|"audio"]`, `llm`) are the names the runtime
    freezes and parallelises by.
    """

    def __init__(self, args: OmniModelArgs):
        super().__init__()
        self.args = args
        self.vision = VisionEncoder(args.vision)
        self.audio = AudioEncoder(args.audio)
        self.projectors = nn.ModuleDict({name: Projector(*dims) for name, dims in projector_dims(args).items()})
        self.llm = LLM(args.llm)
        self.token_index: torch.Tensor | None = None  # this rank's packed positions under context parallelism

    def forward(
        self, batch: PackedBatch, hidden: torch.Tensor | None = None, encoded: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The whole model, or one pipeline stage of it (see `parallel.pipeline`): a stage without the token
        embedding continues from `hidden`; one without the output head returns hidden states.

        Under context parallelism `token_index` holds the packed positions this rank keeps: the full
        sequence is embedded, then the LLM runs on this rank's tokens only (`cu_seqlens` stays global).
        `encoded` (the `omni` encoder layout, `parallel.encoders`): the encoders already ran elsewhere, and
        these are the projected rows of this rank's placeholders in position order; only its tokens are
        embedded."""
        if self.llm.tok_embeddings is not None and encoded is not None:
            hidden = self.embed_encoded(batch, encoded)
        elif self.llm.tok_embeddings is not None:
            hidden = self.embed(batch)
            if self.token_index is not None:
                hidden = hidden[self.token_index]
        elif hidden is None:
            raise ValueError("this pipeline stage has no token embedding: pass the previous stage's hidden states")
        positions = batch.position_ids if self.token_index is None else batch.position_ids[self.token_index]
        return self.llm(hidden, positions, batch.cu_seqlens)

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        """Token embeddings with the encoders' outputs anchored at their placeholders: [T, dim].

        An encoder whose modality is absent from the batch still runs, on a one-window dummy input whose
        output is added times zero: every rank then runs the same modules with the same collectives
        (sharded parameters are gathered in forward and reduced in backward on all ranks alike) and every
        trainable parameter gets a gradient, zero where it saw nothing."""
        embeds = self.llm.embed(batch.input_ids)
        unused = embeds.new_zeros(())
        if batch.image_grids.shape[0] > 0:
            image_embeds = self.project_image(self.vision(batch.image_patches, batch.image_grids), batch.image_grids)
            embeds = anchor_embeddings(embeds, batch.input_ids, IMAGE_ID, image_embeds, "image")
        else:
            anchor_embeddings(embeds, batch.input_ids, IMAGE_ID, None, "image")
            merge = self.args.spatial_merge
            grid = torch.tensor([[merge, merge]], device=embeds.device)
            patches = embeds.new_zeros(merge * merge, self.args.vision.patch_dim)
            unused = unused + self.project_image(self.vision(patches, grid), grid).sum()
        if batch.video_grids.shape[0] > 0:
            video_embeds = self.encode_video(batch.video_patches, batch.video_grids)
            embeds = anchor_embeddings(embeds, batch.input_ids, VIDEO_ID, video_embeds, "video")
        else:
            anchor_embeddings(embeds, batch.input_ids, VIDEO_ID, None, "video")
            merge = self.args.spatial_merge
            grid = torch.tensor([[1, merge, merge]], device=embeds.device)
            patches = embeds.new_zeros(merge * merge, self.args.vision.patch_dim)
            unused = unused + self.encode_video(patches, grid).sum()
        if batch.audio_frames.shape[0] > 0:
            audio_embeds = self.projectors["audio"](self.audio(batch.audio_mels, batch.audio_frames))
            embeds = anchor_embeddings(embeds, batch.input_ids, AUDIO_ID, audio_embeds, "audio")
        else:
            anchor_embeddings(embeds, batch.input_ids, AUDIO_ID, None, "audio")
            frames = torch.tensor([2], device=embeds.device)
            mels = embeds.new_zeros(2, self.args.audio.n_mels)
            unused = unused + self.projectors["audio"](self.audio(mels, frames)).sum()
        return embeds + 0.0 * unused.to(embeds.dtype)

    def embed_encoded(self, batch: PackedBatch, encoded: torch.Tensor) -> torch.Tensor:
        """Token embeddings of this rank's tokens with `encoded` rows at their image, video and audio
        placeholders."""
        ids = batch.input_ids if self.token_index is None else batch.input_ids[self.token_index]
        embeds = self.llm.embed(ids)
        slots = (ids == IMAGE_ID) | (ids == VIDEO_ID) | (ids == AUDIO_ID)
        if int(slots.sum()) != encoded.shape[0]:
            raise ValueError(
                f"{int(slots.sum())} image, video and audio placeholders on this rank, but "
                f"{encoded.shape[0]} encoded rows were handed to it"
            )
        return embeds.masked_scatter(slots.unsqueeze(-1), encoded.to(embeds.dtype))

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """Weighted MoE load-balancing loss of the last forward (zero for a dense LLM; None before any forward
        and once the training step has used it: `clear_aux_losses`)."""
        return self.llm.aux_loss

    def clear_aux_losses(self) -> None:
        """Drop the last forward's aux losses, once the step has used them. Each holds its forward's autograd
        graph, whose FSDP hooks hold the modules: a cycle through C++ that Python's collector cannot free, so
        a MoE model outlived its training run (with its process groups and their polling threads)."""
        for module in self.modules():
            if isinstance(module, (LLM, MoE)):
                module.aux_loss = None

    def project_image(self, features: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """Vision features of images with these (rows, cols) grids -> LLM embeddings, merged spatially."""
        return self.projectors["image"](spatial_merge(features, grids, self.args.spatial_merge))

    def encode_video(self, patches: torch.Tensor, video_grids: torch.Tensor) -> torch.Tensor:
        """Videos (patches frame after frame, `video_grids` [N, 3] of frames, rows, cols) -> LLM embeddings:
        the vision encoder per frame, `temporal_merge` frames averaged, then the image projector: rows in the
        order of the videos' VIDEO_ID placeholders, `batch.video_tokens` per video."""
        return self.project_video(self.vision(patches, self.vision.frame_grids(video_grids)), video_grids)

    def project_video(self, features: torch.Tensor, video_grids: torch.Tensor) -> torch.Tensor:
        """Vision features of the videos' frames -> LLM embeddings (`encode_video` after the encoder)."""
        merged = self.vision.merge_frames(features, video_grids, self.args.temporal_merge)
        grids = [[r, c] for f, r, c in video_grids.tolist() for _ in range(-(-f // self.args.temporal_merge))]
        return self.project_image(merged, torch.tensor(grids, dtype=torch.long).view(-1, 2))

    def train_flops(self, batch: PackedBatch) -> float:
        """Forward + backward FLOPs of this batch, from its actual documents, images, clips and videos (for MFU)."""
        return omni_train_flops(
            self.args,
            batch.cu_seqlens.diff().tolist(),
            batch.image_grids.tolist(),
            batch.audio_frames.tolist(),
            batch.video_grids.tolist(),
        )

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic for a seed on a given device type: N(0, 0.02) weights, zero biases, unit norms.

        Works after `to_empty()` on a model built on the meta device.
        """
        generator = torch.Generator(device=self.llm.output.weight.device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=generator)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
            else:
                continue
            bias = getattr(module, "bias", None)
            if bias is not None:
                nn.init.zeros_(bias)

    def num_params(self) -> int:
        """Counted from the modules; equals `flops.omni_params(args)["total"]` (a tested invariant)."""
        return sum(p.numel() for p in self.parameters())


def anchor_embeddings(
    embeds: torch.Tensor,
    input_ids: torch.Tensor,
    placeholder_id: int,
    features: torch.Tensor | None,
    modality: str,
) -> torch.Tensor:
    """Scatter encoder outputs, in order, into the positions holding `placeholder_id` ("encoder anchor")."""
    slots = input_ids == placeholder_id
    num_slots = int(slots.sum())
    num_features = 0 if features is None else features.shape[0]
    if num_slots != num_features:
        raise ValueError(
            f"{num_slots} {modality} placeholder tokens in input_ids, but the {modality} encoder "
            f"produced {num_features} embeddings"
        )
    if features is None:
        return embeds
    return embeds.masked_scatter(slots.unsqueeze(-1), features.to(embeds.dtype))


def build_model(flavor: str, *, patch_size: int, n_mels: int, seed: int) -> OmniModel:
    """The flavor's OmniModel on the CPU, initialised from `seed`."""
    model = OmniModel(get_flavor(flavor, patch_size=patch_size, n_mels=n_mels))
    model.init_weights(seed)
    return model

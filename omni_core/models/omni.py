"""OmniModel: vision and audio encoders whose projected outputs are anchored into the LLM's packed sequence
(videos take the vision encoder per frame and the image projector, see `encode_video`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch import nn

from omni_core.common.batch import PLACEHOLDER_KINDS, PackedBatch
from omni_core.models.args import OmniModelArgs
from omni_core.models.audio import AudioEncoder
from omni_core.models.documents import host_to_device
from omni_core.models.feed_forward import MoE
from omni_core.models.flavors import get_flavor
from omni_core.models.flops import omni_train_flops, projector_dims
from omni_core.models.llm import LLM
from omni_core.models.projector import make_projector, spatial_merge
from omni_core.models.shapes import Shapes, host_rows
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
        self.projectors = nn.ModuleDict({name: make_projector(*dims) for name, dims in projector_dims(args).items()})
        self.llm = LLM(args.llm)
        self._token_index: torch.Tensor | None = None
        self._token_positions: dict[int, int] = {}  # packed position -> its place among this rank's tokens
        self._device_token_index: torch.Tensor | None = None

    @property
    def token_index(self) -> torch.Tensor | None:
        """This rank's packed positions under context parallelism (None: all of them)."""
        return self._token_index

    @token_index.setter
    def token_index(self, index: torch.Tensor | None) -> None:
        # Read on the host once, where the plan is applied, so that each step counts this rank's placeholders
        # without reading the device.
        self._token_index, self._device_token_index = index, None
        self._token_positions = {} if index is None else {int(p): j for j, p in enumerate(index.tolist())}

    def token_index_on(self, device: torch.device) -> torch.Tensor | None:
        """`token_index` on `device`, copied once: indexing device tensors with a host index copies it (and
        waits for the copy) at every use."""
        if self._token_index is None:
            return None
        if self._device_token_index is None or self._device_token_index.device != device:
            self._device_token_index = self._token_index.to(device)
        return self._device_token_index

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
        index = self.token_index_on(batch.input_ids.device)
        if self.llm.tok_embeddings is not None and encoded is not None:
            hidden = self.embed_encoded(batch, encoded)
        elif self.llm.tok_embeddings is not None:
            hidden = self.embed(batch)
            if index is not None:
                hidden = hidden[index]
        elif hidden is None:
            raise ValueError("this pipeline stage has no token embedding: pass the previous stage's hidden states")
        positions = batch.position_ids if index is None else batch.position_ids[index]
        return self.llm(hidden, positions, batch.cu_seqlens, batch.layout)

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        """Token embeddings with the encoders' outputs anchored at their placeholders: [T, dim].

        An encoder whose modality is absent from the batch still runs, on a one-window dummy input whose
        output is added times zero: every rank then runs the same modules with the same collectives
        (sharded parameters are gathered in forward and reduced in backward on all ranks alike) and every
        trainable parameter gets a gradient, zero where it saw nothing."""
        embeds = self.llm.embed(batch.input_ids)
        unused = embeds.new_zeros(())
        layout, merge = batch.layout, self.args.spatial_merge
        if layout.image_grids:
            image_embeds = self.project_image(self.vision(batch.image_patches, layout.image_grids), layout.image_grids)
            embeds = anchor_embeddings(embeds, batch, "image", image_embeds)
        else:
            anchor_embeddings(embeds, batch, "image", None)
            patches = embeds.new_zeros(merge * merge, self.args.vision.patch_dim)
            unused = unused + self.project_image(self.vision(patches, [(merge, merge)]), [(merge, merge)]).sum()
        if layout.video_grids:
            embeds = anchor_embeddings(
                embeds, batch, "video", self.encode_video(batch.video_patches, layout.video_grids)
            )
        else:
            anchor_embeddings(embeds, batch, "video", None)
            patches = embeds.new_zeros(merge * merge, self.args.vision.patch_dim)
            unused = unused + self.encode_video(patches, [(1, merge, merge)]).sum()
        if layout.audio_frames:
            audio_embeds = self.projectors["audio"](self.audio(batch.audio_mels, layout.audio_frames))
            embeds = anchor_embeddings(embeds, batch, "audio", audio_embeds)
        else:
            anchor_embeddings(embeds, batch, "audio", None)
            frames = 2 * self.args.audio.pool  # one embedding after the subsampling and the pool
            mels = embeds.new_zeros(frames, self.args.audio.n_mels)
            unused = unused + self.projectors["audio"](self.audio(mels, [frames])).sum()
        return embeds + 0.0 * unused.to(embeds.dtype)

    def embed_encoded(self, batch: PackedBatch, encoded: torch.Tensor) -> torch.Tensor:
        """Token embeddings of this rank's tokens with `encoded` rows at their image, video and audio
        placeholders."""
        index = self.token_index_on(batch.input_ids.device)
        ids = batch.input_ids if index is None else batch.input_ids[index]
        embeds = self.llm.embed(ids)
        positions = [p for kind in PLACEHOLDER_KINDS for p in batch.layout.placeholder_positions[kind]]
        local = self._token_positions
        mine = positions if index is None else [local[p] for p in positions if p in local]
        if len(mine) != encoded.shape[0]:
            raise ValueError(
                f"{len(mine)} image, video and audio placeholders on this rank, but "
                f"{encoded.shape[0]} encoded rows were handed to it"
            )
        return scatter_rows(embeds, sorted(mine), encoded)

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

    def project_image(self, features: torch.Tensor, grids: Shapes) -> torch.Tensor:
        """Vision features of images with these (rows, cols) grids -> LLM embeddings, merged spatially."""
        return self.projectors["image"](spatial_merge(features, grids, self.args.spatial_merge))

    def encode_video(self, patches: torch.Tensor, video_grids: Shapes) -> torch.Tensor:
        """Videos (patches frame after frame, `video_grids` [N, 3] of frames, rows, cols) -> LLM embeddings:
        the vision encoder per frame, `temporal_merge` frames averaged, then the image projector: rows in the
        order of the videos' placeholders, `batch.video_tokens` per video."""
        return self.project_video(self.vision(patches, self.vision.frame_grids(video_grids)), video_grids)

    def project_video(self, features: torch.Tensor, video_grids: Shapes) -> torch.Tensor:
        """Vision features of the videos' frames -> LLM embeddings (`encode_video` after the encoder)."""
        videos = host_rows(video_grids)
        merged = self.vision.merge_frames(features, videos, self.args.temporal_merge)
        return self.project_image(
            merged, [(r, c) for f, r, c in videos for _ in range(-(-f // self.args.temporal_merge))]
        )

    def train_flops(self, batch: PackedBatch) -> float:
        """Forward + backward FLOPs of this batch, from its actual documents, images, clips and videos (for MFU)."""
        layout = batch.layout
        return omni_train_flops(
            self.args, layout.doc_lengths, layout.image_grids, layout.audio_frames, layout.video_grids
        )

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic for a seed on a given device type: N(0, 0.02) weights, zero biases, unit norms
        (`init_specs`, drawn in their order).

        Works after `to_empty()` on a model built on the meta device.
        """
        generator = torch.Generator(device=self.llm.output.weight.device).manual_seed(seed)
        for spec in init_specs(self):
            initial_value(spec, generator, out=self.get_parameter(spec.name))

    def num_params(self) -> int:
        """Counted from the modules; equals `flops.omni_params(args)["total"]` (a tested invariant)."""
        return sum(p.numel() for p in self.parameters())


def anchor_embeddings(
    embeds: torch.Tensor, batch: PackedBatch, modality: str, features: torch.Tensor | None
) -> torch.Tensor:
    """Scatter encoder outputs, in order, into the positions of the modality's placeholders ("encoder
    anchor"); the count is checked against the batch's host layout."""
    num_slots = len(batch.layout.placeholder_positions[modality])
    num_features = 0 if features is None else features.shape[0]
    if num_slots != num_features:
        raise ValueError(
            f"{num_slots} {modality} placeholder tokens in input_ids, but the {modality} encoder "
            f"produced {num_features} embeddings"
        )
    if features is None:
        return embeds
    return scatter_rows(embeds, batch.layout.placeholder_positions[modality], features)


def scatter_rows(embeds: torch.Tensor, positions: Sequence[int], rows: torch.Tensor) -> torch.Tensor:
    """`embeds` with `rows` at `positions` (ascending host ints, from the batch's layout: the placeholders of
    whatever tokenizer made the batch), out of place so gradients reach both. The positions go to the device
    from pinned memory, so the host does not wait for the GPU."""
    index = host_to_device(torch.tensor(positions, dtype=torch.long), embeds.device)
    return embeds.index_put((index,), rows.to(embeds.dtype))


WEIGHTED = (nn.Linear, nn.Conv1d, nn.Embedding, nn.LayerNorm, nn.RMSNorm)  # what init_weights sets


class InitSpec(NamedTuple):
    """One parameter's initial value: its name, how it is drawn, its shape and dtype."""

    name: str
    kind: Literal["normal", "ones", "zeros"]
    shape: torch.Size
    dtype: torch.dtype


def init_specs(model: nn.Module) -> list[InitSpec]:
    """The initial value of every parameter of `model`, in the order `init_weights` draws them from its one
    generator. A sharded build (`runtime.model_init`) replays this list on a meta model's shapes, so each rank
    computes the same values one tensor at a time and keeps its shard. A tied head appears twice (its module
    and the embedding's); the later draw wins, as it does in place."""
    specs = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        weight = module.weight if isinstance(module, WEIGHTED) else None
        if weight is None:
            continue
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
            specs.append(InitSpec(prefix + "weight", "normal", weight.shape, weight.dtype))
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            specs.append(InitSpec(prefix + "weight", "ones", weight.shape, weight.dtype))
        bias = getattr(module, "bias", None)
        if bias is not None:
            specs.append(InitSpec(prefix + "bias", "zeros", bias.shape, bias.dtype))
    return specs


def initial_value(spec: InitSpec, generator: torch.Generator, out: torch.Tensor | None = None) -> torch.Tensor:
    """The spec's whole tensor (a normal draw advances the generator), written into `out` (of the spec's shape)
    when given, else into a new tensor on the generator's device."""
    if out is None:
        out = torch.empty(spec.shape, dtype=spec.dtype, device=generator.device)
    if spec.kind == "normal":
        return out.normal_(0.0, 0.02, generator=generator)
    return out.fill_(1.0 if spec.kind == "ones" else 0.0)


def build_model(flavor: str, *, patch_size: int, n_mels: int, seed: int) -> OmniModel:
    """The flavor's OmniModel on the CPU, initialised from `seed`."""
    model = OmniModel(get_flavor(flavor, patch_size=patch_size, n_mels=n_mels))
    model.init_weights(seed)
    return model

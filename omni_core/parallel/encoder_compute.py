"""This rank's encoder forward in the encoder step (`parallel.encoders`): its pieces' input rows -> their
projected rows. Whole items are batched per modality into one call each, LSSP chunks run one call each; every
encoder's blocks run over all of its calls, block by block (a `BlockChain` where its weights are sharded).
The `phased` step runs it once, the `joint` schedule's thread once per micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from omni_core.models.omni import OmniModel
from omni_core.parallel.encoder_items import Piece
from omni_core.parallel.encoder_shards import BlockChain
from omni_core.parallel.lssp import SequenceShard

Head = Callable[[torch.Tensor], torch.Tensor]  # an encoder call's final features -> its pieces' projected rows


@dataclass
class EncoderCall:
    """One encoder call of this rank: its pieces (their rows in order), the stem's output, its documents'
    bounds and LSSP shard, and its head (final features -> the pieces' projected rows)."""

    encoder: str
    pieces: list[Piece]
    x: torch.Tensor
    cu_seqlens: list[int]
    shard: SequenceShard | None
    head: Head


class EncoderCompute:
    """The encoders of this rank's model part, run over pieces (`encode`). `chains`: the sharded encoders'
    blocks; `lssp_groups`: each LSSP group's process group, by its ranks."""

    def __init__(
        self,
        model: OmniModel,
        chains: dict[str, BlockChain],
        lssp_groups: dict[tuple[int, ...], dist.ProcessGroup],
        trains: bool,
        device: torch.device,
    ):
        self.model, self.chains, self.lssp_groups, self.trains, self.device = model, chains, lssp_groups, trains, device

    def encode(
        self, pieces: list[Piece], inputs: dict[Piece, torch.Tensor]
    ) -> tuple[dict[Piece, torch.Tensor], torch.Tensor | None]:
        """Projected rows of this rank's pieces: whole items batched per modality (one encoder call each),
        LSSP chunks one by one in the canonical order their group's members share; each encoder's blocks run
        over all of its calls, block by block (`BlockChain` where its weights are sharded). Also the sharded
        chains' token (None without any), which the caller hands off with the rows."""
        calls = self._calls(pieces, inputs)
        token = torch.zeros((), device=self.device, requires_grad=self.trains) if self.chains else None
        out: dict[Piece, torch.Tensor] = {}
        for encoder in ("vision", "audio"):  # the chains' token in this order: one backward order on every rank
            mine = [c for c in calls if c.encoder == encoder]
            if encoder in self.chains:
                assert token is not None  # made above whenever there are chains
                token, hidden = self.chains[encoder].run(token, [(c.x, c.cu_seqlens, c.shard) for c in mine])
            else:
                hidden = [c.x for c in mine]
                for layer in getattr(self.model, encoder).layers if mine else ():
                    hidden = [layer(x, c.cu_seqlens, c.shard) for x, c in zip(hidden, mine, strict=True)]
            for call, h in zip(mine, hidden, strict=True):
                rows = call.head(self._finish(encoder, h, call.cu_seqlens))
                out.update(zip(call.pieces, rows.split([p.rows[1] - p.rows[0] for p in call.pieces]), strict=True))
        return out, token

    def _finish(self, encoder: str, hidden: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """The encoder's output after its blocks, as its own forward ends: the audio encoder's pool and norm
        per document (`AudioEncoder.finish`), the vision tower's final norm where it has one."""
        if encoder == "audio":
            return self.model.audio.finish(hidden, cu_seqlens)
        vision = self.model.vision
        return vision.norm(hidden) if vision.args.final_norm else hidden

    def _calls(self, pieces: list[Piece], inputs: dict[Piece, torch.Tensor]) -> list[EncoderCall]:
        """Each encoder call's stem output, in the canonical order: whole images, videos and clips batched per
        modality, then the LSSP chunks one by one."""
        model, calls = self.model, []
        whole = [p for p in pieces if not p.group]
        images = [p for p in whole if p.item.modality == "image"]
        if images:
            grids = [p.item.shape for p in images]
            x, cu = model.vision.embed(torch.cat([inputs[p] for p in images]), grids)
            calls.append(
                EncoderCall("vision", images, x, cu, None, functools.partial(model.project_image, grids=grids))
            )
        videos = [p for p in whole if p.item.modality == "video"]
        if videos:
            calls.append(
                self._video_call(videos, torch.cat([inputs[p] for p in videos]), [p.item.shape for p in videos])
            )
        clips = [p for p in whole if p.item.modality == "audio"]
        if clips:
            frames = [p.item.shape[0] for p in clips]
            x, cu = model.audio.embed(torch.cat([inputs[p] for p in clips]), frames)
            calls.append(EncoderCall("audio", clips, x, cu, None, model.projectors["audio"]))
        calls.extend(self._chunk_call(piece, inputs[piece]) for piece in pieces if piece.group)
        return calls

    def _chunk_call(self, piece: Piece, inputs: torch.Tensor) -> EncoderCall:
        """An LSSP member's call on its chunk of one item. A video's chunk is a shorter video of whole frames
        (no exchange); an image's or a clip's runs its attention over the group (`SequenceShard`)."""
        model, item = self.model, piece.item
        if item.modality == "video":
            frames = (piece.inputs[1] - piece.inputs[0]) // (item.shape[1] * item.shape[2])
            return self._video_call([piece], inputs, [(frames, *item.shape[1:])])
        shard = SequenceShard(self.lssp_groups[piece.group], list(piece.splits))
        if item.modality == "image":
            x, cu = model.vision.embed(inputs, [item.shape], shard)
            return EncoderCall("vision", [piece], x, cu, shard, self._image_chunk_head(item.shape[1]))
        x, cu = model.audio.embed(inputs, [item.shape[0]], shard)
        return EncoderCall("audio", [piece], x, cu, shard, model.projectors["audio"])

    def _image_chunk_head(self, cols: int) -> Head:
        """The head of an LSSP image chunk: its features, whole rows of `cols` patches, merged and projected."""

        def head(features: torch.Tensor) -> torch.Tensor:
            return self.model.project_image(features, [(features.shape[0] // cols, cols)])

        return head

    def _video_call(
        self, pieces: list[Piece], patches: torch.Tensor, video_grids: list[tuple[int, ...]]
    ) -> EncoderCall:
        """Videos through the vision encoder, frame by frame; their frames merged and projected after it."""
        x, cu = self.model.vision.embed(patches, self.model.vision.frame_grids(video_grids))
        return EncoderCall(
            "vision", pieces, x, cu, None, functools.partial(self.model.project_video, video_grids=video_grids)
        )

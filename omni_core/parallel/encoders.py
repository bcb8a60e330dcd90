"""The `omni` encoder layout (MegaScale-Omni's encoder-LLM multiplexing, DESIGN.md §3): every rank of the
world encodes, under the encoders' own layout, items of any data shard; their embeddings then travel to the
LLM ranks whose placeholders they fill. The `disaggregated` baseline (DistTrain) is the same machinery with
the encoder ranks restricted to ranks of their own, which hold no LLM and load no data.

Under the `phased` schedule (the design's reference) a step runs in three phases:

1. `EncoderStep.forward`: each data shard's owner publishes its items' metadata (modality, grid or frames,
   placeholder position; never sample bytes), every rank computes the same assignment (`assign`: on the
   models' FLOPs of each item, a*L + b*L^2, items over their encoder's threshold go to an LSSP group whose
   members each run a chunk; the others start on their own shard's ranks and move, within the shard's
   balancing group, while that lowers the busiest rank's load), inputs travel to their encoder ranks
   (one all-to-all per modality), the encoders run, and the projected rows are handed to their consumers,
   every stage-0 rank of the item's data shard, each getting the rows of its own context-parallel share,
   by one variable-split all-to-all (`AllToAll`) whose backward is the mirrored exchange of their gradients;
2. the LLM's forward and backward, pipelined or not, on detached leaves of those rows;
3. `EncoderStep.backward`: the leaves' gradients go back through the mirrored all-to-all, the encoders run
   backward, and their gradients are summed over the encoders' group: all-reduced for replicated weights,
   reduce-scattered into the shards of FSDP-sharded ones (`parallel.encoder_shards`: their blocks gathered one
   at a time, forward and backward, their gradients reduce-scattered block by block).

Under `joint` (`parallel.joint`) the start of phase 1 is the same (metadata, assignment, inputs), then the
encoders run per micro-batch in each rank's idle time and hand their rows off point to point as they are made.

Every rank calls every collective each step, with empty buffers when it has nothing to send or encode, so
a rank without images or audio never hangs the others. Frozen encoders (and projectors) skip phase 3's
encoder backward by autograd itself: nothing on their side requires a gradient.

Gradient convention (see `parallelize`): a consumer's leaf holds the gradient of the global loss for its rows.
Context-parallel consumers hold disjoint rows; tensor-parallel consumers hold the same rows with the same
(full) gradient, so only tensor-parallel rank 0 sends its gradient back (the others send zeros).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from omni_core.common.batch import PackedBatch, audio_tokens, video_tokens
from omni_core.common.plan import EncoderSpec, ParallelPlan, PlanError
from omni_core.common.tokenizer import AUDIO_ID, IMAGE_ID, VIDEO_ID
from omni_core.models.args import OmniModelArgs
from omni_core.models.flops import audio_forward_flops, vision_forward_flops
from omni_core.models.omni import OmniModel
from omni_core.models.projector import merged_grid
from omni_core.parallel.collectives import AllToAll, all_to_all_uneven
from omni_core.parallel.context import cp_token_index
from omni_core.parallel.encoder_shards import BlockChain, EncoderShards, stem_and_head
from omni_core.parallel.joint import JointStep
from omni_core.parallel.lssp import SequenceShard, lssp_splits

ENCODER_OF = {"image": "vision", "video": "vision", "audio": "audio"}
PLACEHOLDER_OF = {"image": IMAGE_ID, "video": VIDEO_ID, "audio": AUDIO_ID}
INPUT_FIELD = {"image": "image_patches", "video": "video_patches", "audio": "audio_mels"}
ACTIVATION_BYTES_PER_TOKEN_DIM = 4 * 16  # fp32, ~16 saved tensors of [tokens, dim] per encoder block


@dataclass(frozen=True)
class Item:
    """One image or audio clip of the step, as every rank knows it after the metadata all-gather."""

    modality: str  # "image" | "video" | "audio"
    shard: int  # the data shard whose batch holds it
    micro: int  # its micro-batch
    shape: tuple[int, ...]  # (rows, cols) in patches, (frames, rows, cols), or (mel frames,)
    start: int  # packed position of its first placeholder in the micro-batch
    input_offset: int  # its first row in the micro-batch's image_patches / video_patches / audio_mels

    @property
    def input_rows(self) -> int:
        return math.prod(self.shape)

    @property
    def tokens(self) -> int:
        """Encoder tokens: patches (of every frame), or subsampled mel frames."""
        return audio_tokens(self.shape[0]) if self.modality == "audio" else self.input_rows


@dataclass(frozen=True)
class Piece:
    """A part of an item's projected rows that one rank produces: all of them, or an LSSP member's chunk."""

    item: Item
    rank: int
    rows: tuple[int, int]  # [first, end) of the item's projected rows
    inputs: tuple[int, int]  # [first, end) of the item's input rows this rank needs
    group: tuple[int, ...] = ()  # the LSSP group (ranks in order); () for a whole item
    splits: tuple[int, ...] = ()  # the group's chunks: encoder tokens (image, audio) or frames (video)


Transfer = tuple[int, Piece, int, int]  # (consumer, piece, first, end): item rows one consumer gets from a piece


def describe_items(batches: list[PackedBatch], shard: int, args: OmniModelArgs) -> list[Item]:
    """Items of one data shard's micro-batches, each with the position of its (contiguous) placeholders."""
    items = []
    for micro, batch in enumerate(batches):
        for modality, shapes in (
            ("image", batch.image_grids.tolist()),
            ("video", batch.video_grids.tolist()),
            ("audio", batch.audio_frames.tolist()),
        ):
            positions = (batch.input_ids == PLACEHOLDER_OF[modality]).nonzero().flatten().tolist()
            cursor = offset = 0
            for shape in shapes:
                shape = tuple(shape) if isinstance(shape, list) else (shape,)
                item = Item(modality, shard, micro, shape, positions[cursor] if positions else -1, offset)
                rows = output_rows(item, args)
                span = positions[cursor : cursor + rows]
                if len(span) != rows or span[-1] - span[0] != rows - 1:
                    raise ValueError(
                        f"micro-batch {micro}: the placeholders of {modality} {shape} are not {rows} contiguous tokens"
                    )
                items.append(item)
                cursor += rows
                offset += item.input_rows
    return items


def output_rows(item: Item, args: OmniModelArgs) -> int:
    """LLM embeddings an item yields (its placeholders)."""
    if item.modality == "image":
        m_rows, m_cols = merged_grid(*item.shape, args.spatial_merge)
        return m_rows * m_cols
    if item.modality == "video":
        return video_tokens(*item.shape, args.temporal_merge, args.spatial_merge)
    return item.tokens


def item_cost(item: Item, args: OmniModelArgs) -> float:
    """Forward FLOPs (the models' own count: linear and quadratic in the item's tokens; a video's frames are
    attention documents of their own)."""
    if item.modality == "image":
        return vision_forward_flops(args.vision, item.input_rows)
    if item.modality == "video":
        frames, rows, cols = item.shape
        return frames * vision_forward_flops(args.vision, rows * cols)
    return audio_forward_flops(args.audio, item.shape[0])


def split_units(item: Item, args: OmniModelArgs) -> tuple[int, int]:
    """(units, unit size) an LSSP split cuts an item into, in its split dimension: whole merge-rows of an
    image's patches, groups of `temporal_merge` frames of a video, a clip's subsampled tokens one by one."""
    if item.modality == "image":
        unit = args.spatial_merge * item.shape[1]
        return -(-item.tokens // unit), unit
    if item.modality == "video":
        return -(-item.shape[0] // args.temporal_merge), args.temporal_merge
    return item.tokens, 1


def is_long(item: Item, spec: EncoderSpec, args: OmniModelArgs) -> bool:
    """Over the encoder's threshold by tokens (cost) or by its activations' estimated MiB (memory). An item
    too small to give every member of the group a chunk runs whole."""
    if spec.lssp == 1 or split_units(item, args)[0] < spec.lssp:
        return False
    encoder = getattr(args, ENCODER_OF[item.modality])
    dim, layers = encoder.dim, encoder.n_layers
    by_tokens = spec.long_tokens and item.tokens > spec.long_tokens
    mib = item.tokens * dim * layers * ACTIVATION_BYTES_PER_TOKEN_DIM / 2**20
    return bool(by_tokens or (spec.long_mb and mib > spec.long_mb))


def assign(
    items: list[Item], args: OmniModelArgs, plan: ParallelPlan, domains: dict[int, tuple[int, ...]] | None = None
) -> list[Piece]:
    """The same placement on every rank, in a canonical order (items by decreasing cost; ties by shard,
    micro-batch, modality, position). `domains`: the ranks that may encode a shard's items (default: every
    encoder rank).

    Long items first, each onto the least-loaded LSSP group inside its domain (any group when none fits in
    it), a chunk per member. Then short items by longest processing time onto the least-loaded of their own
    shard's ranks, which hold their inputs already (the domain's ranks when none does: `disaggregated`), and
    `_rebalance` moves them to other ranks of their domain only while that lowers the busiest rank's load: a
    batch the loaders balanced (`data.balance`) ships few inputs."""
    ranks = list(plan.encoder_ranks)
    load = dict.fromkeys(ranks, 0.0)
    keyed = sorted(items, key=lambda it: (-item_cost(it, args), it.shard, it.micro, it.modality, it.start))
    cost = {item: item_cost(item, args) for item in keyed}
    split: dict[Item, list[Piece]] = {}
    for item in keyed:
        spec = plan.encoders.spec(ENCODER_OF[item.modality])
        if not is_long(item, spec, args):
            continue
        domain = set(domains[item.shard]) if domains else set(ranks)
        groups = [ranks[i : i + spec.lssp] for i in range(0, len(ranks) - spec.lssp + 1, spec.lssp)]
        groups = [g for g in groups if set(g) <= domain] or groups
        group = min(groups, key=lambda g: (max(load[r] for r in g), g[0]))
        split[item] = lssp_pieces(item, tuple(group), args)
        for rank in group:
            load[rank] += cost[item] / len(group)
    short = [item for item in keyed if item not in split]
    domain_of = {item: domains[item.shard] if domains else tuple(ranks) for item in short}
    home = {
        shard: [r for r in ranks if r < plan.llm_world_size and plan.data_rank(r) == shard]
        for shard in {item.shard for item in short}
    }
    placed = {}
    for item in short:
        rank = min(home[item.shard] or domain_of[item], key=lambda r: (load[r], r))
        load[rank] += cost[item]
        placed[item] = rank
    _rebalance(short, placed, load, cost, domain_of)
    pieces = []
    for item in keyed:
        pieces += split.get(item) or [Piece(item, placed[item], (0, output_rows(item, args)), (0, item.input_rows))]
    return pieces


def _rebalance(
    items: list[Item],
    placed: dict[Item, int],
    load: dict[int, float],
    cost: dict[Item, float],
    domain_of: dict[Item, tuple[int, ...]],
) -> None:
    """Moves from the busiest rank, one item at a time: the move that lowers the larger of its two ranks'
    loads the most, onto the least-loaded rank of the item's domain; stops when no move helps."""
    for _ in range(len(items)):
        busiest = max(load, key=lambda r: (load[r], -r))
        best, best_peak = None, load[busiest]
        for item in (it for it in items if placed[it] == busiest):
            target = min(domain_of[item], key=lambda r: (load[r], r))
            peak = max(load[busiest] - cost[item], load[target] + cost[item])
            if peak < best_peak:
                best, best_peak = (item, target), peak
        if best is None:
            return
        item, target = best
        load[busiest] -= cost[item]
        load[target] += cost[item]
        placed[item] = target


def lssp_pieces(item: Item, group: tuple[int, ...], args: OmniModelArgs) -> list[Piece]:
    """An item's chunks over an LSSP group (`split_units`). An image's chunk merges into whole rows of LLM
    tokens on its own; a video's chunk is a shorter video (its frames are separate attention documents, so its
    members need no exchange); a clip's members each take the whole clip's frames (the conv stem runs whole,
    see `AudioEncoder`) and a chunk of its subsampled tokens."""
    unit = split_units(item, args)[1]
    merge = args.spatial_merge
    if item.modality == "image":
        rows, cols = item.shape
        splits = lssp_splits(item.tokens, len(group), unit)
        m_cols = merged_grid(rows, cols, merge)[1]
        out_rows = [-(-(s // cols) // merge) * m_cols for s in splits]
        inputs = list(splits)
    elif item.modality == "video":
        frames, rows, cols = item.shape
        splits = lssp_splits(frames, len(group), unit)  # frames per member
        out_rows = [video_tokens(f, rows, cols, args.temporal_merge, merge) for f in splits]
        inputs = [f * rows * cols for f in splits]
    else:
        splits = lssp_splits(item.tokens, len(group), unit)
        out_rows, inputs = list(splits), [0] * len(splits)
    pieces, first, row = [], 0, 0
    for rank, count, out in zip(group, inputs, out_rows, strict=True):
        span = (first, first + count) if item.modality != "audio" else (0, item.input_rows)
        pieces.append(Piece(item, rank, (row, row + out), span, group, tuple(splits)))
        first, row = first + count, row + out
    return pieces


@dataclass
class _Call:
    """One encoder call of this rank: its pieces (their rows in order), the stem's output, its documents'
    bounds and LSSP shard, and its head (final features -> the pieces' projected rows)."""

    encoder: str
    pieces: list[Piece]
    x: torch.Tensor
    cu_seqlens: list[int]
    shard: SequenceShard | None
    head: Callable[[torch.Tensor], torch.Tensor]


class EncoderStep:
    """Phases 1 and 3 of the step on this rank (see the module docstring), under `omni` (every rank encodes)
    and `disaggregated` (only the encoders' own ranks encode; the LLM ranks send inputs and receive rows).

    `trains`: whether any encoder or projector parameter trains; the same on every rank (it decides whether
    the handoff has a backward), also on LLM ranks that hold no encoder."""

    def __init__(
        self,
        model: OmniModel,
        plan: ParallelPlan,
        tokens_per_microbatch: int,
        trains: bool,
        device: torch.device,
        balance_group: int = 0,
    ):
        self.model, self.plan, self.trains, self.device = model, plan, trains, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.total_tokens = tokens_per_microbatch
        self.coords = [plan.coordinates(r) for r in range(plan.llm_world_size)]
        self.shard_of = [plan.data_rank(r) for r in range(plan.llm_world_size)]
        owners: dict[int, int] = {}
        for rank, shard in enumerate(self.shard_of):
            owners.setdefault(shard, rank)
        self.owner_of_shard = owners
        self.domains = self._domains(balance_group)
        self.lssp_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for size in sorted({plan.encoders.spec(e).lssp for e in ENCODER_OF.values()} - {1}):
            ranks = list(plan.encoder_ranks)
            for i in range(0, len(ranks) - size + 1, size):  # every rank creates every group, in one order
                group = tuple(ranks[i : i + size])
                self.lssp_groups[group] = dist.new_group(list(group))
        # the encoders' group (gradient all-reduce of replicated weights, FSDP of sharded ones): the world
        # (`omni`), or the encoders' own ranks (every rank creates the group, members or not)
        self.encoder_group = dist.new_group(list(plan.encoder_ranks)) if plan.encoders.ranks else None
        # sharded encoders (those this rank holds): blocks one at a time on a group of their own (the joint
        # schedule's thread runs them), the rest once per step
        held = [e for e in plan.encoders.sharded if getattr(model, e, None) is not None]
        blocks_group = dist.new_group(list(plan.encoder_ranks)) if plan.encoders.sharded else None
        self.chains = {e: BlockChain.of(getattr(model, e), blocks_group, device) for e in held}
        self.shards = EncoderShards([o for e in held for o in stem_and_head(model, e)], self.encoder_group, device)
        sharded = {id(p) for p in (*self.shards.params, *(p for c in self.chains.values() for p in c.params))}
        self.params = [
            p
            for name in ("vision", "audio", "projectors")
            if getattr(model, name, None) is not None
            for p in getattr(model, name).parameters()
            if p.requires_grad and id(p) not in sharded
        ]
        if plan.encoders.joint:
            if device.type != "cpu":
                raise PlanError(
                    f"plan {plan.name}: the joint encoder schedule is built for CPU ranks (its encoder "
                    "thread at idle priority fills their waits); on CUDA it needs a low-priority stream"
                )
            world = list(range(self.world))  # the handoff's own groups: rows, and their gradients back
            self.rows_group, self.grads_group = dist.new_group(world), dist.new_group(world)
        self._received: torch.Tensor | None = None
        self._leaf: torch.Tensor | None = None
        self._joint: JointStep | None = None
        self._outside_s = 0.0
        self.metrics: dict[str, float] = {}

    def _domains(self, group: int) -> dict[int, tuple[int, ...]] | None:
        """Under `omni`, the ranks that encode a shard's items: those of the shards of its balancing group (the
        loaders' `data.balance` group: `group` consecutive data shards; 0: the world). Under `disaggregated`
        every encoder rank."""
        if self.plan.encoders.ranks or not group:
            return None
        return {
            shard: tuple(r for r, s in enumerate(self.shard_of) if s // group == shard // group)
            for shard in self.owner_of_shard
        }

    # --- phase 1 -------------------------------------------------------------------------------------------

    def forward(self, batches: list[PackedBatch], compute_dtype: torch.dtype) -> list[torch.Tensor | None]:
        """This rank's encoded rows per micro-batch, sorted by packed position within its CP share (leaves
        that collect the LLM's gradients), or None per micro-batch on ranks outside pipeline stage 0. Under
        `joint` the list fetches each micro-batch's rows when the LLM first asks for them.

        Metrics: `encoder_s`, the seconds this rank's encoders computed (forward and backward); the wall time
        spent outside the LLM's phase is kept for the step's idle share (`outside_s`)."""
        start = time.perf_counter()
        self.shards.gather()
        mine = describe_items(batches, self.shard_of[self.rank], self.model.args) if self._owns_shard() else []
        gathered: list[tuple[int, list[Item]]] = [None] * self.world  # type: ignore[list-item]
        dist.all_gather_object(gathered, (len(batches), mine))
        n_micro = max(n for n, _ in gathered)  # the encoders' own ranks load no batches
        pieces = assign([it for _, part in gathered for it in part], self.model.args, self.plan, self.domains)
        inputs = self._ship_inputs(pieces, batches)
        transfers = self._transfers(pieces)
        self.metrics = {
            "lssp_items": float(len({p.item for p in pieces if p.group})),
            "encoder_s": 0.0,
            "handoff_bytes": self._handoff_bytes(transfers, compute_dtype),
        }
        if self.plan.encoders.joint:
            joint = self._joint = JointStep(self, pieces, transfers, inputs, n_micro, compute_dtype)
            encoded = [None] * len(batches) if not self._consumes() else _Arrivals(joint, n_micro)
        else:
            computing = time.perf_counter()
            enabled = compute_dtype != torch.float32
            with torch.autocast(self.device.type, dtype=compute_dtype, enabled=enabled):
                produced, token = self._encode([p for p in pieces if p.rank == self.rank], inputs)
            self.metrics["encoder_s"] = time.perf_counter() - computing
            encoded = self._hand_off(transfers, produced, len(batches), compute_dtype, token)
        self._outside_s = time.perf_counter() - start
        return encoded

    def _consumes(self) -> bool:
        """Whether this rank's LLM takes encoder rows (pipeline stage 0 of the LLM's ranks)."""
        return self.rank < self.plan.llm_world_size and self.coords[self.rank]["pp"] == 0

    def sends_gradient(self, consumer: int) -> bool:
        """Whether a consumer returns its rows' gradient: TP rank 0 only (its peers hold the same rows)."""
        return self.coords[consumer]["tp"] == 0

    def _handoff_bytes(self, transfers: list[Transfer], dtype: torch.dtype) -> float:
        """Bytes of embedding rows this rank sends (and, when the encoders train, their gradients back)."""
        rows = sum(end - first for _, piece, first, end in transfers if piece.rank == self.rank)
        element = torch.finfo(dtype).bits // 8
        return float(rows * self.model.args.llm.dim * element * (2 if self.trains else 1))

    def _owns_shard(self) -> bool:
        return self.rank < self.plan.llm_world_size and self.owner_of_shard[self.shard_of[self.rank]] == self.rank

    def _holds(self, rank: int, shard: int) -> bool:
        return rank < self.plan.llm_world_size and self.shard_of[rank] == shard

    def _ship_inputs(self, pieces: list[Piece], batches: list[PackedBatch]) -> dict[Piece, torch.Tensor]:
        """Each of this rank's pieces' input rows: sliced locally where this rank holds the item's batch, else
        received from the shard's owner (one all-to-all per modality, in the canonical piece order)."""
        needs = [p for p in pieces if not self._holds(p.rank, p.item.shard)]
        out: dict[Piece, torch.Tensor] = {}
        widths = {
            "image": self.model.args.vision.patch_dim,
            "video": self.model.args.vision.patch_dim,
            "audio": self.model.args.audio.n_mels,
        }
        for modality in INPUT_FIELD:
            empty = torch.zeros(0, widths[modality], device=self.device)
            send: list[list[torch.Tensor]] = [[] for _ in range(self.world)]  # by destination rank
            recv_splits = [0] * self.world
            mine = []
            for piece in (p for p in needs if p.item.modality == modality):
                source = self.owner_of_shard[piece.item.shard]
                if source == self.rank:
                    send[piece.rank].append(self._input_rows(piece, batches))
                if piece.rank == self.rank:
                    recv_splits[source] += piece.inputs[1] - piece.inputs[0]
                    mine.append((source, piece))
            send_splits = [sum(t.shape[0] for t in rows) for rows in send]
            flat = torch.cat([t for rows in send for t in rows]) if any(send_splits) else empty
            received = all_to_all_uneven(flat, recv_splits, send_splits, None)
            cursor = [sum(recv_splits[:r]) for r in range(self.world)]  # each source's rows, in canonical order
            for source, piece in mine:
                rows = piece.inputs[1] - piece.inputs[0]
                out[piece] = received[cursor[source] : cursor[source] + rows]
                cursor[source] += rows
        for piece in pieces:
            if piece.rank == self.rank and piece not in out:
                out[piece] = self._input_rows(piece, batches)
        return out

    @staticmethod
    def _input_rows(piece: Piece, batches: list[PackedBatch]) -> torch.Tensor:
        source = getattr(batches[piece.item.micro], INPUT_FIELD[piece.item.modality])
        first = piece.item.input_offset
        return source[first + piece.inputs[0] : first + piece.inputs[1]]

    def _encode(
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
                token, hidden = self.chains[encoder].run(token, [(c.x, c.cu_seqlens, c.shard) for c in mine])
            else:
                hidden = [c.x for c in mine]
                for layer in getattr(self.model, encoder).layers if mine else ():
                    hidden = [layer(x, c.cu_seqlens, c.shard) for x, c in zip(hidden, mine, strict=True)]
            for call, h in zip(mine, hidden, strict=True):
                rows = call.head(getattr(self.model, encoder).norm(h))
                out.update(zip(call.pieces, rows.split([p.rows[1] - p.rows[0] for p in call.pieces]), strict=True))
        return out, token

    def _calls(self, pieces: list[Piece], inputs: dict[Piece, torch.Tensor]) -> list[_Call]:
        """Each encoder call's stem output, in the canonical order: whole images, videos and clips batched per
        modality, then the LSSP chunks one by one."""
        model, calls = self.model, []
        whole = [p for p in pieces if not p.group]
        images = [p for p in whole if p.item.modality == "image"]
        if images:
            grids = torch.tensor([p.item.shape for p in images], dtype=torch.long)
            x, cu = model.vision.embed(torch.cat([inputs[p] for p in images]), grids)
            calls.append(_Call("vision", images, x, cu, None, lambda h, g=grids: model.project_image(h, g)))
        videos = [p for p in whole if p.item.modality == "video"]
        if videos:
            calls.append(
                self._video_call(
                    videos,
                    torch.cat([inputs[p] for p in videos]),
                    torch.tensor([p.item.shape for p in videos], dtype=torch.long),
                )
            )
        clips = [p for p in whole if p.item.modality == "audio"]
        if clips:
            frames = torch.tensor([p.item.shape[0] for p in clips], dtype=torch.long)
            x, cu = model.audio.embed(torch.cat([inputs[p] for p in clips]), frames)
            calls.append(_Call("audio", clips, x, cu, None, model.projectors["audio"]))
        for piece in (p for p in pieces if p.group):
            if piece.item.modality == "video":  # a chunk of whole frames: a shorter video, no exchange
                frames = (piece.inputs[1] - piece.inputs[0]) // (piece.item.shape[1] * piece.item.shape[2])
                grid = torch.tensor([[frames, *piece.item.shape[1:]]], dtype=torch.long)
                calls.append(self._video_call([piece], inputs[piece], grid))
                continue
            shard = SequenceShard(self.lssp_groups[piece.group], list(piece.splits))
            if piece.item.modality == "image":
                cols = piece.item.shape[1]
                x, cu = model.vision.embed(inputs[piece], torch.tensor([piece.item.shape], dtype=torch.long), shard)
                head = lambda h, c=cols: model.project_image(h, torch.tensor([[h.shape[0] // c, c]], dtype=torch.long))
                calls.append(_Call("vision", [piece], x, cu, shard, head))
            else:
                x, cu = model.audio.embed(inputs[piece], torch.tensor([piece.item.shape[0]], dtype=torch.long), shard)
                calls.append(_Call("audio", [piece], x, cu, shard, model.projectors["audio"]))
        return calls

    def _video_call(self, pieces: list[Piece], patches: torch.Tensor, video_grids: torch.Tensor) -> _Call:
        """Videos through the vision encoder, frame by frame; their frames merged and projected after it."""
        x, cu = self.model.vision.embed(patches, self.model.vision.frame_grids(video_grids))
        return _Call("vision", pieces, x, cu, None, lambda h: self.model.project_video(h, video_grids))

    # --- the handoff ---------------------------------------------------------------------------------------

    def _consumers(self, shard: int) -> list[int]:
        """Stage-0 LLM ranks of a data shard: each needs the rows of its CP share."""
        return [r for r in range(self.plan.llm_world_size) if self.shard_of[r] == shard and self.coords[r]["pp"] == 0]

    def _share(self, rank: int) -> list[tuple[int, int]]:
        """The packed positions [first, end) a consumer's LLM holds (its context-parallel share)."""
        plan = self.plan
        if plan.cp == 1:
            return [(0, self.total_tokens)]
        index = cp_token_index(self.total_tokens, plan.cp, self.coords[rank]["cp"], plan.cp_kind)
        chunk = self.total_tokens // (plan.cp if plan.cp_kind == "ulysses" else 2 * plan.cp)
        starts = index[::chunk].tolist()
        return [(s, s + chunk) for s in starts]

    def _transfers(self, pieces: list[Piece]) -> list[Transfer]:
        """(consumer, piece, first, end) of item rows, sorted by consumer, micro-batch and packed position:
        the order senders fill and receivers read the handoff buffers in."""
        out = []
        for piece in pieces:
            item = piece.item
            for consumer in self._consumers(item.shard):
                for lo, hi in self._share(consumer):
                    first = max(piece.rows[0], lo - item.start)
                    end = min(piece.rows[1], hi - item.start)
                    if first < end:
                        out.append((consumer, piece, first, end))
        return sorted(out, key=lambda t: (t[0], t[1].item.micro, t[1].item.start + t[2]))

    def _hand_off(
        self,
        transfers: list[Transfer],
        produced: dict[Piece, torch.Tensor],
        n_micro: int,
        dtype: torch.dtype,
        token: torch.Tensor | None = None,
    ) -> list[torch.Tensor | None]:
        """Move the rows to their consumers (every rank's buffers in one dtype: ranks without rows too). The
        sharded chains' `token` rides along (an added zero), so that every rank's backward reaches them."""
        dim = self.model.args.llm.dim
        outgoing = [t for t in transfers if t[1].rank == self.rank]
        chunks = [produced[piece][first - piece.rows[0] : end - piece.rows[0]] for _, piece, first, end in outgoing]
        send_splits, recv_splits = [0] * self.world, [0] * self.world
        for consumer, piece, first, end in transfers:
            if piece.rank == self.rank:
                send_splits[consumer] += end - first
            if consumer == self.rank:
                recv_splits[piece.rank] += end - first
        trains, device = self.trains, self.device
        send = torch.cat(chunks).to(dtype) if chunks else torch.zeros(0, dim, dtype=dtype, device=device)
        if token is not None and token.requires_grad:
            send = send + 0 * token.to(dtype)
        if trains and not send.requires_grad:  # no rows, or only frozen encoders' rows: the backward still runs
            send = send + torch.zeros((), dtype=dtype, device=device, requires_grad=True)
        exchange = AllToAll.apply if trains else all_to_all_uneven
        received = exchange(send, recv_splits, send_splits, None)
        incoming = sorted((t for t in transfers if t[0] == self.rank), key=lambda t: t[1].rank)  # stable
        order = sorted(
            range(len(incoming)), key=lambda i: (incoming[i][1].item.micro, incoming[i][1].item.start + incoming[i][2])
        )
        spans = list(received.split([end - first for _, _, first, end in incoming])) if incoming else []
        rows = torch.cat([spans[i] for i in order]) if incoming else received
        self._received = rows
        self._leaf = rows.detach().requires_grad_(rows.requires_grad)
        if self.rank >= self.plan.llm_world_size or self.coords[self.rank]["pp"] != 0:
            return [None] * n_micro
        per_micro: dict[int, int] = defaultdict(int)
        for i in order:
            per_micro[incoming[i][1].item.micro] += incoming[i][3] - incoming[i][2]
        return list(self._leaf.split([per_micro[m] for m in range(n_micro)]))

    # --- phase 3 -------------------------------------------------------------------------------------------

    def backward(self) -> None:
        """Send the LLM's gradients of the received rows back and run the encoders' backward (`joint`: await the
        encoder thread's); then sum the encoders' gradients over their group: reduce-scattered into the shards of
        sharded weights (`EncoderShards`), all-reduced for replicated ones."""
        start = time.perf_counter()
        if self._joint is not None:
            self.metrics["encoder_s"] = self._joint.finish()
            self._joint = None
        received, leaf = self._received, self._leaf
        self._received = self._leaf = None
        if received is not None and received.requires_grad:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if self.rank < self.plan.llm_world_size and not self.sends_gradient(self.rank):
                grad = torch.zeros_like(grad)  # the same full gradient as TP rank 0's: counted once
            computing = time.perf_counter()
            torch.autograd.backward(received, grad)
            self.metrics["encoder_s"] += time.perf_counter() - computing
        self.shards.reduce()
        if self.params:
            for param in self.params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            dist.all_reduce(flat, group=self.encoder_group)
            offset = 0
            for param in self.params:
                param.grad.copy_(flat[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
        self._outside_s += time.perf_counter() - start
        self.metrics["outside_s"] = self._outside_s


class _Arrivals:
    """A consumer's encoded rows per micro-batch under `joint`: indexing waits for that micro-batch's rows."""

    def __init__(self, joint: JointStep, n_micro: int):
        self.joint, self.n_micro = joint, n_micro

    def __len__(self) -> int:
        return self.n_micro

    def __getitem__(self, micro: int) -> torch.Tensor:
        return self.joint.rows(micro)

"""The `omni` encoder layout (MegaScale-Omni's encoder-LLM multiplexing, DESIGN.md §3): every rank of the
world encodes, under the encoders' own layout, items of any data shard; their embeddings then travel to the
LLM ranks whose placeholders they fill. The `disaggregated` baseline (DistTrain) is the same machinery with
the encoder ranks restricted to ranks of their own, which hold no LLM and load no data (`encoder_roles`: which
rank does what under either layout).

Under the `phased` schedule (the design's reference) a step runs in three phases:

1. `EncoderStep.forward`: each data shard's owner publishes its items' metadata (`encoder_items`: modality,
   grid or frames, placeholder position; never sample bytes), every rank computes the same assignment
   (`encoder_assign`: on the models' FLOPs of each item, a*L + b*L^2, items over their encoder's threshold go
   to an LSSP group whose members each run a chunk; the others start on their own shard's ranks and move,
   within the shard's balancing group, while that lowers the busiest rank's load), inputs travel to their
   encoder ranks (`encoder_inputs`: one all-to-all per modality), the encoders run (`encoder_compute`), and
   the projected rows are handed to their consumers (`encoder_handoff`), every stage-0 rank of the item's
   data shard, each getting the rows of its own context-parallel share, by one variable-split all-to-all
   (`AllToAll`) whose backward is the mirrored exchange of their gradients;
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

import time
from collections.abc import Sequence
from typing import cast, overload

import torch
import torch.distributed as dist

from omni_core.common.batch import PackedBatch
from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.models.omni import OmniModel
from omni_core.parallel.encoder_assign import assign
from omni_core.parallel.encoder_compute import EncoderCompute
from omni_core.parallel.encoder_handoff import Handoff
from omni_core.parallel.encoder_inputs import ship_inputs
from omni_core.parallel.encoder_items import ENCODER_OF, Item, describe_items
from omni_core.parallel.encoder_roles import RankRoles
from omni_core.parallel.encoder_shards import BlockChain, EncoderShards, stem_and_head
from omni_core.parallel.joint import JointStep
from omni_core.parallel.lssp import new_lssp_groups


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
        self.roles = RankRoles.of(plan, dist.get_rank(), dist.get_world_size())
        self.rank, self.world = self.roles.rank, self.roles.world
        self.domains = self.roles.domains(balance_group)
        self.handoff = Handoff(self.roles, tokens_per_microbatch, model.args.llm.dim, trains, device)
        # every rank creates every LSSP group, in one order
        lssp_groups = new_lssp_groups(plan.encoder_ranks, [plan.encoders.spec(e).lssp for e in ENCODER_OF.values()])
        # the encoders' group (gradient all-reduce of replicated weights, FSDP of sharded ones): the world
        # (`omni`), or the encoders' own ranks (every rank creates the group, members or not)
        self.encoder_group = dist.new_group(list(plan.encoder_ranks)) if plan.encoders.ranks else None
        # sharded encoders (those this rank holds): blocks one at a time on a group of their own (the joint
        # schedule's thread runs them), the rest once per step
        held = [e for e in plan.encoders.sharded if getattr(model, e, None) is not None]
        blocks_group = dist.new_group(list(plan.encoder_ranks)) if plan.encoders.sharded else None
        chains = {e: BlockChain.of(getattr(model, e), blocks_group, device) for e in held}
        self.compute = EncoderCompute(model, chains, lssp_groups, trains, device)
        self.shards = EncoderShards([o for e in held for o in stem_and_head(model, e)], self.encoder_group, device)
        sharded = {id(p) for p in (*self.shards.params, *(p for c in chains.values() for p in c.params))}
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

    # --- phase 1 -------------------------------------------------------------------------------------------

    def forward(self, batches: list[PackedBatch], compute_dtype: torch.dtype) -> Sequence[torch.Tensor | None]:
        """This rank's encoded rows per micro-batch, sorted by packed position within its CP share (leaves
        that collect the LLM's gradients), or None per micro-batch on ranks outside pipeline stage 0. Under
        `joint` the sequence fetches each micro-batch's rows when the LLM first asks for them.

        Metrics: `encoder_s`, the seconds this rank's encoders computed (forward and backward); the wall time
        spent outside the LLM's phase is kept for the step's idle share (`outside_s`)."""
        start = time.perf_counter()
        self.shards.gather()
        mine = (
            describe_items(batches, self.roles.shard_of[self.rank], self.model.args) if self.roles.owns_shard() else []
        )
        slots: list[tuple[int, list[Item]] | None] = [None] * self.world
        dist.all_gather_object(slots, (len(batches), mine))
        published = cast(list[tuple[int, list[Item]]], slots)  # the gather filled every rank's slot
        n_micro = max(n for n, _ in published)  # the encoders' own ranks load no batches
        pieces = assign([it for _, part in published for it in part], self.model.args, self.plan, self.domains)
        inputs = ship_inputs(self.roles, pieces, batches, self.model.args, self.device)
        transfers = self.handoff.transfers(pieces)
        self.metrics = {
            "lssp_items": float(len({p.item for p in pieces if p.group})),
            "encoder_s": 0.0,
            "handoff_bytes": self.handoff.bytes_sent(transfers, compute_dtype),
        }
        encoded: Sequence[torch.Tensor | None]
        if self.plan.encoders.joint:
            joint = self._joint = JointStep(self, pieces, transfers, inputs, n_micro, compute_dtype)
            encoded = [None] * len(batches) if not self.roles.consumes() else _Arrivals(joint, n_micro)
        else:
            computing = time.perf_counter()
            enabled = compute_dtype != torch.float32
            with torch.autocast(self.device.type, dtype=compute_dtype, enabled=enabled):
                produced, token = self.compute.encode([p for p in pieces if p.rank == self.rank], inputs)
            self.metrics["encoder_s"] = time.perf_counter() - computing
            rows, per_micro = self.handoff.send(transfers, produced, len(batches), compute_dtype, token)
            self._received = rows
            self._leaf = rows.detach().requires_grad_(rows.requires_grad)
            encoded = list(self._leaf.split(per_micro)) if self.roles.consumes() else [None] * len(batches)
        self._outside_s = time.perf_counter() - start
        return encoded

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
            assert leaf is not None  # made with `received`, in `forward`
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if self.rank < self.plan.llm_world_size and not self.roles.sends_gradient(self.rank):
                grad = torch.zeros_like(grad)  # the same full gradient as TP rank 0's: counted once
            computing = time.perf_counter()
            torch.autograd.backward(received, grad)
            self.metrics["encoder_s"] += time.perf_counter() - computing
        self.shards.reduce()
        self._all_reduce_replicated()
        self._outside_s += time.perf_counter() - start
        self.metrics["outside_s"] = self._outside_s

    def _all_reduce_replicated(self) -> None:
        """Sum the replicated encoder weights' gradients over the encoders' group (one flat all-reduce; zeros
        for a parameter this rank's backward did not reach). The summed gradients stay views of the flat
        buffer: copying them back into the old ones cost a pass over every encoder weight (measured ~8 ms a
        step at world 2 for debug-enc's 13 MB, as much as the all-reduce's own bytes)."""
        if not self.params:
            return
        flat = torch.cat([p.new_zeros(p.numel()) if p.grad is None else p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat, group=self.encoder_group)
        offset = 0
        for param in self.params:
            param.grad = flat[offset : offset + param.numel()].view_as(param)
            offset += param.numel()


class _Arrivals(Sequence[torch.Tensor]):
    """A consumer's encoded rows per micro-batch under `joint`: indexing waits for that micro-batch's rows."""

    def __init__(self, joint: JointStep, n_micro: int):
        self.joint, self.n_micro = joint, n_micro

    def __len__(self) -> int:
        return self.n_micro

    @overload
    def __getitem__(self, micro: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, micro: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, micro: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(micro, slice):
            return [self.joint.rows(m) for m in range(self.n_micro)[micro]]
        return self.joint.rows(micro)

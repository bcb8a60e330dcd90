"""`ParallelPlan`: the one validated description of how an LLM is laid out over ranks.

The estimator ranks plans, the scheduler hands a plan to a job, and the runtime executes it: all three use
this object, so the plan that was estimated is the plan that runs. Degrees:

    pp            pipeline stages (outermost: crosses nodes first)
    dp_replicate  replicated data parallel (HSDP's outer dimension)
    dp_shard      sharded data parallel (FSDP)
    cp            context parallel, `ulysses` (all-to-all over heads) or `ring` (zig-zag blocks)
    tp            tensor parallel (innermost: stays inside a node)
    ep            expert parallel, folded into dp_shard x cp as torchtitan does (it uses no ranks of its own)

world size = pp * dp_replicate * dp_shard * cp * tp. The compact name, e.g. `dp2-tp2-pp2-cp2r-ep2`, is what
MLflow tags, CellTables and logs show; `ParallelPlan.parse` reads it back. `parallel.parallelize.build_meshes`
turns a plan into device meshes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from omni_core.recipe.schema import ParallelConfig

CpKind = Literal["ulysses", "ring"]
PipelineSchedule = Literal["1F1B", "Interleaved1F1B", "GPipe"]
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first
_NAME = re.compile(
    r"^dp(?P<dp_a>\d+)(?:x(?P<dp_b>\d+))?"
    r"(?:-tp(?P<tp>\d+))?"
    r"(?:-pp(?P<pp>\d+)(?:v(?P<v>\d+))?(?P<gpipe>g)?)?"
    r"(?:-cp(?P<cp>\d+)(?P<kind>[ur]))?"
    r"(?:-ep(?P<ep>\d+))?$"
)


class PlanError(ValueError):
    """A plan that does not fit the world size or the model; the message names each offending degree."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan must divide: the LLM's layers, heads, experts and the sequence length."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    num_experts: int = 0  # 0: dense
    seq_len: int | None = None  # tokens of one packed micro-batch


@dataclass(frozen=True)
class ParallelPlan:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    cp_kind: CpKind = "ulysses"
    pp_schedule: PipelineSchedule = "1F1B"
    virtual_stages: int = 1  # pipeline stages per rank (> 1 only for interleaved 1F1B)

    def __post_init__(self) -> None:
        problems = [f"{f.name}={getattr(self, f.name)} must be >= 1" for f in fields(self)
                    if f.type == "int" and getattr(self, f.name) < 1]
        if self.cp_kind not in ("ulysses", "ring"):
            problems.append(f"cp_kind={self.cp_kind!r} must be 'ulysses' or 'ring'")
        if self.pp_schedule not in ("1F1B", "Interleaved1F1B", "GPipe"):
            problems.append(f"pp_schedule={self.pp_schedule!r} must be 1F1B, Interleaved1F1B or GPipe")
        if self.virtual_stages > 1 and self.pp_schedule != "Interleaved1F1B":
            problems.append(f"virtual_stages={self.virtual_stages} needs pp_schedule=Interleaved1F1B")
        if self.pp_schedule == "Interleaved1F1B" and self.virtual_stages < 2:
            problems.append("pp_schedule=Interleaved1F1B needs virtual_stages >= 2")
        if not problems and (self.dp_shard * self.cp) % self.ep:
            problems.append(f"ep={self.ep} must divide dp_shard*cp={self.dp_shard * self.cp} (EP is folded into them)")
        if problems:
            raise PlanError("; ".join(problems))

    # --- sizes -------------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Model replicas that see different data (the batch is split dp ways)."""
        return self.dp_replicate * self.dp_shard

    @property
    def name(self) -> str:
        dp = f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp{self.dp_shard}"
        parts = [dp]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            virtual = f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp}{virtual}{'g' if self.pp_schedule == 'GPipe' else ''}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}{self.cp_kind[0]}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return "-".join(parts)

    def __str__(self) -> str:
        return self.name

    # --- construction ------------------------------------------------------------------------------------

    @classmethod
    def parse(cls, name: str) -> ParallelPlan:
        """Inverse of `name`: `dp2x2-tp2-pp4v2-cp2r-ep2` -> the plan (HSDP 2x2, interleaved, ring CP)."""
        match = _NAME.match(name)
        if not match:
            raise PlanError(f"cannot parse plan name {name!r} (expected e.g. dp2-tp2-pp2-cp2r-ep2)")
        g = match.groupdict()
        replicate, shard = (int(g["dp_a"]), int(g["dp_b"])) if g["dp_b"] else (1, int(g["dp_a"]))
        virtual = int(g["v"] or 1)
        schedule = "GPipe" if g["gpipe"] else ("Interleaved1F1B" if virtual > 1 else "1F1B")
        return cls(
            dp_replicate=replicate, dp_shard=shard, tp=int(g["tp"] or 1), pp=int(g["pp"] or 1),
            cp=int(g["cp"] or 1), ep=int(g["ep"] or 1), cp_kind="ring" if g["kind"] == "r" else "ulysses",
            pp_schedule=schedule, virtual_stages=virtual,
        )

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelPlan:
        """The recipe's degrees on `world_size` ranks; dp_shard=-1 takes whatever the others leave."""
        if cfg.plan == "auto":
            raise PlanError("parallel.plan is auto: the train stage (omni train, omni run) replaces it with the "
                            "estimate's best plan for its Cell before launching; the runtime runs explicit degrees")
        others = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise PlanError(
                    f"world size {world_size} is not divisible by pp={cfg.pp} x dp_replicate={cfg.dp_replicate} "
                    f"x cp={cfg.cp} x tp={cfg.tp} = {others}"
                )
            dp_shard = world_size // others
        schedule = cfg.pp_schedule if cfg.pp > 1 else "1F1B"  # one stage has no schedule to choose
        plan = cls(
            dp_replicate=cfg.dp_replicate, dp_shard=dp_shard, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep,
            cp_kind=cfg.cp_kind, pp_schedule=schedule, virtual_stages=2 if schedule == "Interleaved1F1B" else 1,
        )
        plan.check_world(world_size)
        return plan

    # --- validation --------------------------------------------------------------------------------------

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise PlanError(
                f"plan {self.name} needs pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} "
                f"x cp={self.cp} x tp={self.tp} = {self.world_size} ranks, but the world size is {world_size}"
            )

    def check_model(self, shape: ModelShape) -> None:
        """Refuse a plan the model cannot be split by, naming every degree that does not divide."""
        problems = []
        if shape.n_heads % self.tp:
            problems.append(f"tp={self.tp} does not divide n_heads={shape.n_heads}")
        if shape.n_kv_heads % self.tp:
            problems.append(f"tp={self.tp} does not divide n_kv_heads={shape.n_kv_heads}")
        if self.cp > 1 and self.cp_kind == "ulysses" and (shape.n_heads // max(self.tp, 1)) % self.cp:
            problems.append(f"cp={self.cp} (ulysses) does not divide the {shape.n_heads // self.tp} heads per tp rank")
        stages = self.pp * self.virtual_stages
        if stages > shape.n_layers:
            problems.append(f"pp={self.pp} x virtual_stages={self.virtual_stages} exceeds n_layers={shape.n_layers}")
        if self.ep > 1 and not shape.num_experts:
            problems.append(f"ep={self.ep} needs an MoE model (the model is dense)")
        elif shape.num_experts and shape.num_experts % self.ep:
            problems.append(f"ep={self.ep} does not divide num_experts={shape.num_experts}")
        if shape.seq_len is not None and self.cp * self.tp > 1:
            # ring: zig-zag head and tail chunks; tp: sequence parallelism splits each rank's tokens again
            chunks = (2 * self.cp if self.cp_kind == "ring" else self.cp) * self.tp
            if shape.seq_len % chunks:
                degrees = f"cp={self.cp} ({self.cp_kind}) x tp={self.tp}" if self.cp > 1 else f"tp={self.tp}"
                problems.append(f"{degrees} needs seq_len={shape.seq_len} divisible by {chunks}")
        if problems:
            raise PlanError(f"plan {self.name} does not fit the model: " + "; ".join(problems))

    def check_microbatches(self, n: int) -> None:
        """Refuse a pipeline schedule that cannot run `n` micro-batches per step (torch.distributed.pipelining's
        rules: 1F1B needs one per stage; interleaved 1F1B runs them in rounds of max(1, n // pp))."""
        if self.pp == 1 or self.pp_schedule == "GPipe":
            return
        if self.pp_schedule == "1F1B" and n < self.pp:
            raise PlanError(f"plan {self.name}: pp={self.pp} (1F1B) needs at least {self.pp} micro-batches per step, "
                            f"got {n} (raise train.grad_accum)")
        rounds = max(1, n // self.pp)
        if self.pp_schedule == "Interleaved1F1B" and n % rounds:
            raise PlanError(f"plan {self.name}: pp={self.pp} (interleaved 1F1B) runs micro-batches in rounds of "
                            f"{rounds}, which must divide the {n} per step (train.grad_accum)")

    # --- meshes ------------------------------------------------------------------------------------------

    def mesh_shape(self) -> dict[str, int]:
        """Named mesh dimensions, outermost first: PP crosses nodes, TP stays inside one."""
        return {dim: getattr(self, dim) for dim in MESH_ORDER}

    def coordinates(self, rank: int) -> dict[str, int]:
        """This global rank's index along each mesh dimension (row-major over MESH_ORDER)."""
        coords = {}
        for dim in reversed(MESH_ORDER):
            rank, coords[dim] = divmod(rank, getattr(self, dim))
        return {dim: coords[dim] for dim in MESH_ORDER}

    def data_rank(self, rank: int) -> int:
        """Which of the `dp` data shards a rank loads: ranks differing only in pp, cp or tp share one."""
        coords = self.coordinates(rank)
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

"""`ParallelPlan`: the one validated description of how an LLM is laid out over ranks.

The estimator ranks plans, the scheduler hands a plan to a job, and the runtime executes it: all three use
this object, so the plan that was estimated is the plan that runs. Degrees:

    pp            pipeline stages (outermost: crosses nodes first)
    dp_replicate  replicated data parallel (HSDP's outer dimension)
    dp_shard      sharded data parallel: what its ranks shard is the plan's `sharding` stage (below)
    cp            context parallel, `ulysses` (all-to-all over heads) or `ring` (zig-zag blocks)
    tp            tensor parallel (innermost: stays inside a node)
    ep            expert parallel, folded into dp_shard x cp as torchtitan does (it uses no ranks of its own)

world size = pp * dp_replicate * dp_shard * cp * tp. The compact name, e.g. `dp2-tp2-pp2-cp2r-ep2`, is what
MLflow tags, CellTables and logs show; `ParallelPlan.parse` reads it back. `parallel.parallelize.build_meshes`
turns a plan into device meshes.

The sharding stage: what the dp_shard x cp ranks (the shard group) split among themselves, the rest replicated
(dp_replicate always copies everything). Named by a suffix on the data-parallel part of the name:

    fsdp       parameters, gradients and optimizer states (FSDP2; the default, no suffix: `dp8`, `dp2x4`)
    zero2      gradients and optimizer states: gradients reduce-scattered, only the owned slice kept; `dp8z2`
    zero1      optimizer states: gradients all-reduced, each rank steps its slice; `dp8z1`, `dp2x4z1`
    replicate  nothing: gradients all-reduced, every rank steps everything (plain DDP); `dp8z0`

ZeRO-1/2 and replicate keep whole parameters on every rank and all-gather the updated slices after the step
(`parallel.zero`). They run dense LLMs with coupled encoders over TP, PP and CP; EP and encoder layouts of
their own are refused by name.

The encoders' half is `ParallelPlan.encoders`, an `EncoderPlan` (MegaScale-Omni, DESIGN.md §3):

    coupled        the encoders run inside the LLM's first pipeline stage on its data split, replicated over
                   its TP and CP ranks (Megatron-LLaVA); the name adds nothing (`dp1-tp2`)
    omni           every rank of the world is an encoder rank: the step's items are spread over all of them,
                   balanced by cost, long ones split over an LSSP group; `dp1-tp2+omni`
    disaggregated  the encoders on `ranks` ranks of their own (DistTrain); `dp1+disagg1`

and their schedule: `phased` (the reference: the step's encoder forward, the LLM, the encoder backward) or
`joint` (per micro-batch, in the ranks' idle time, each micro-batch's embeddings handed off as they are made:
MegaScale-Omni's joint encoder-LLM pipeline under `omni`, DistTrain's pipelined encoders under
`disaggregated`), named by a `-joint` suffix: `dp1-pp2+omni-joint`.

Per encoder (`vision`, `audio`) an `EncoderSpec`: its LSSP group size, the long-item threshold (by tokens,
i.e. cost, or by activation memory) and whether its weights are FSDP-sharded over its group, e.g.
`dp2+omni.v-sp2-t256.a-fsdp`. The encoders' data-parallel group is derived, not a dial: the world (`omni`),
the LLM's data shards (`coupled`), or the `ranks` encoder ranks (`disaggregated`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Literal

from omni_core.recipe.model_sections import PLAN_DEGREES, encoder_layout_problems, sharding_problems

if TYPE_CHECKING:
    from omni_core.recipe.model_sections import ParallelConfig

CpKind = Literal["ulysses", "ring"]
EncoderLayout = Literal["coupled", "omni", "disaggregated"]
EncoderSchedule = Literal["phased", "joint"]
ENCODER_KEYS = {"vision": "v", "audio": "a"}  # the encoders a plan lays out, and their letters in names
PipelineSchedule = Literal["1F1B", "Interleaved1F1B", "GPipe"]
Sharding = Literal["replicate", "zero1", "zero2", "fsdp"]
SHARDING_SUFFIX: dict[Sharding, str] = {"replicate": "z0", "zero1": "z1", "zero2": "z2", "fsdp": ""}  # after dp
_SHARDING_OF_SUFFIX: dict[str, Sharding] = {suffix: stage for stage, suffix in SHARDING_SUFFIX.items()}
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first
_NAME = re.compile(
    r"^dp(?P<dp_a>\d+)(?:x(?P<dp_b>\d+))?(?:z(?P<zero>[012]))?"
    r"(?:-tp(?P<tp>\d+))?"
    r"(?:-pp(?P<pp>\d+)(?:v(?P<v>\d+))?(?P<gpipe>g)?)?"
    r"(?:-cp(?P<cp>\d+)(?P<kind>[ur]))?"
    r"(?:-ep(?P<ep>\d+))?$"
)


_ENCODER_NAME = re.compile(
    r"^(?P<layout>coupled|omni|disagg(?P<ranks>\d+))(?P<joint>-joint)?(?P<specs>(?:\.[va](?:-[a-z]+\d*)*)*)$"
)
_SPEC_TOKEN = re.compile(r"^(?:sp(?P<lssp>\d+)|t(?P<tokens>\d+)|m(?P<mb>\d+)|(?P<fsdp>fsdp))$")


class PlanError(ValueError):
    """A plan that does not fit the world size or the model; the message names each offending degree."""


@dataclass(frozen=True)
class EncoderSpec:
    """How one encoder's items are laid out over its group (`omni` and `disaggregated` only).

    An item (an image, an audio clip) is long when it has more than `long_tokens` encoder tokens (patches,
    mel frames; cost) or when its activations would exceed `long_mb` MiB (memory); 0 switches a test off.
    A long item runs split over `lssp` ranks (Ulysses all-to-all over the encoder's heads); a short one runs
    whole on one rank."""

    lssp: int = 1
    long_tokens: int = 0
    long_mb: int = 0
    fsdp: bool = False  # weights FSDP-sharded over the encoder's group (else replicated, gradients all-reduced)

    @property
    def name(self) -> str:
        tokens = [
            f"sp{self.lssp}" if self.lssp > 1 else "",
            f"t{self.long_tokens}" if self.long_tokens else "",
            f"m{self.long_mb}" if self.long_mb else "",
            "fsdp" if self.fsdp else "",
        ]
        return "-".join(t for t in tokens if t)


@dataclass(frozen=True)
class EncoderPlan:
    """The encoders' layout and schedule (see the module docstring); `ranks` only for `disaggregated`."""

    layout: EncoderLayout = "coupled"
    vision: EncoderSpec = EncoderSpec()
    audio: EncoderSpec = EncoderSpec()
    ranks: int = 0
    schedule: EncoderSchedule = "phased"

    def problems(self) -> list[str]:
        return encoder_layout_problems(
            self.layout, self.ranks, {key: asdict(self.spec(key)) for key in ENCODER_KEYS}, self.schedule
        )

    @property
    def joint(self) -> bool:
        return self.schedule == "joint"

    def spec(self, encoder: str) -> EncoderSpec:
        return getattr(self, encoder)

    @property
    def sharded(self) -> list[str]:
        """The encoders whose weights this plan FSDP-shards over their group (`parallel.encoder_shards`)."""
        return [key for key in ENCODER_KEYS if self.spec(key).fsdp]

    @property
    def name(self) -> str:
        """`coupled`, `omni`, `disagg2`, then `.v-...` / `.a-...` for each encoder whose spec is not the default."""
        head = f"disagg{self.ranks}" if self.layout == "disaggregated" else self.layout
        head += "-joint" if self.joint else ""
        specs = "".join(
            f".{letter}-{self.spec(key).name}"
            for key, letter in ENCODER_KEYS.items()
            if self.spec(key) != EncoderSpec()
        )
        return head + specs

    @classmethod
    def parse(cls, name: str) -> EncoderPlan:
        match = _ENCODER_NAME.match(name)
        if not match:
            raise PlanError(
                f"cannot parse encoder layout {name!r} (expected e.g. omni, omni-joint.v-sp2-t256, disagg2)"
            )
        specs = {}
        for part in filter(None, match["specs"].split(".")):
            letter, *tokens = part.split("-")
            values: dict = {}
            for token in tokens:
                t = _SPEC_TOKEN.match(token)
                if not t:
                    raise PlanError(f"encoder layout {name!r}: unknown setting {token!r} (sp<N>, t<N>, m<N>, fsdp)")
                values.update(
                    lssp=int(t["lssp"] or 0) or values.get("lssp", 1),
                    long_tokens=int(t["tokens"] or 0) or values.get("long_tokens", 0),
                    long_mb=int(t["mb"] or 0) or values.get("long_mb", 0),
                    fsdp=bool(t["fsdp"]) or values.get("fsdp", False),
                )
            key = {v: k for k, v in ENCODER_KEYS.items()}[letter]
            specs[key] = EncoderSpec(**values)
        # the pattern names disaggregated layouts disagg<ranks>, and admits only coupled or omni otherwise
        layout: EncoderLayout = (
            "disaggregated" if match["ranks"] else "omni" if match["layout"] == "omni" else "coupled"
        )
        return cls(
            layout=layout, ranks=int(match["ranks"] or 0), schedule="joint" if match["joint"] else "phased", **specs
        )


@dataclass(frozen=True)
class ModelShape:
    """What the plan must divide: the LLM's layers, heads, experts and the sequence length."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    num_experts: int = 0  # 0: dense
    seq_len: int | None = None  # tokens of one packed micro-batch
    tied_embeddings: bool = False  # one parameter for the token embedding and the output head
    sliding_window: bool = False  # some layers attend within a window (built for whole sequences on a rank)


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
    encoders: EncoderPlan = EncoderPlan()
    sharding: Sharding = "fsdp"  # what the shard group (dp_shard x cp) splits: see the module docstring

    def __post_init__(self) -> None:
        problems = [
            f"{f.name}={getattr(self, f.name)} must be >= 1"
            for f in fields(self)
            if f.type == "int" and getattr(self, f.name) < 1
        ]
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
        problems.extend(self.encoders.problems())
        problems.extend(sharding_problems(self.sharding, self.ep, self.encoders.layout))
        if problems:
            raise PlanError("; ".join(problems))

    # --- sizes -------------------------------------------------------------------------------------------

    @property
    def llm_world_size(self) -> int:
        """Ranks the LLM runs on: the whole world, except the encoders' own ranks under `disaggregated`."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def world_size(self) -> int:
        return self.llm_world_size + self.encoders.ranks

    @property
    def encoder_ranks(self) -> range:
        """The global ranks the encoders run on under `omni` (all) and `disaggregated` (the last `ranks`)."""
        if self.encoders.layout == "disaggregated":
            return range(self.llm_world_size, self.world_size)
        return range(self.world_size)

    @property
    def dp(self) -> int:
        """Model replicas that see different data (the batch is split dp ways)."""
        return self.dp_replicate * self.dp_shard

    @property
    def zero(self) -> bool:
        """Whether the shard group keeps whole parameters (ZeRO-1/2 or replicated), not FSDP's shards."""
        return self.sharding != "fsdp"

    @property
    def name(self) -> str:
        dp = f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp{self.dp_shard}"
        parts = [dp + SHARDING_SUFFIX[self.sharding]]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            virtual = f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp}{virtual}{'g' if self.pp_schedule == 'GPipe' else ''}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}{self.cp_kind[0]}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        llm = "-".join(parts)
        return llm if self.encoders == EncoderPlan() else f"{llm}+{self.encoders.name}"

    def __str__(self) -> str:
        return self.name

    # --- construction ------------------------------------------------------------------------------------

    @classmethod
    def parse(cls, name: str) -> ParallelPlan:
        """Inverse of `name`: `dp2x2-tp2-pp4v2-cp2r-ep2` -> the plan (HSDP 2x2, interleaved, ring CP);
        `dp8z1-tp2` ZeRO-1 over the 8 shard ranks; `dp2+omni.v-sp2-t256` also lays out the encoders."""
        name, _, encoder_name = name.partition("+")
        encoders = EncoderPlan.parse(encoder_name) if encoder_name else EncoderPlan()
        match = _NAME.match(name)
        if not match:
            raise PlanError(f"cannot parse plan name {name!r} (expected e.g. dp2-tp2-pp2-cp2r-ep2)")
        g = match.groupdict()
        replicate, shard = (int(g["dp_a"]), int(g["dp_b"])) if g["dp_b"] else (1, int(g["dp_a"]))
        virtual = int(g["v"] or 1)
        schedule: PipelineSchedule = "GPipe" if g["gpipe"] else ("Interleaved1F1B" if virtual > 1 else "1F1B")
        return cls(
            dp_replicate=replicate,
            dp_shard=shard,
            tp=int(g["tp"] or 1),
            pp=int(g["pp"] or 1),
            cp=int(g["cp"] or 1),
            ep=int(g["ep"] or 1),
            cp_kind="ring" if g["kind"] == "r" else "ulysses",
            pp_schedule=schedule,
            virtual_stages=virtual,
            encoders=encoders,
            sharding=_SHARDING_OF_SUFFIX[f"z{g['zero']}" if g["zero"] else ""],
        )

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelPlan:
        """The recipe's degrees on `world_size` ranks; dp_shard=-1 takes whatever the others leave."""
        if cfg.plan == "auto":
            raise PlanError(
                "parallel.plan is auto: the train stage (omni train, omni run) replaces it with the "
                "estimate's best plan for its Cell before launching; the runtime runs explicit degrees"
            )
        e = cfg.encoders
        encoders = EncoderPlan(
            e.layout, EncoderSpec(**e.vision.model_dump()), EncoderSpec(**e.audio.model_dump()), e.ranks, e.schedule
        )
        llm_ranks = world_size - encoders.ranks
        others = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if llm_ranks < 1 or llm_ranks % others:
                ranks = (
                    f"the LLM's {llm_ranks} ranks (world size {world_size} less encoders.ranks={encoders.ranks}) are"
                    if encoders.ranks
                    else f"world size {world_size} is"
                )
                raise PlanError(
                    f"{ranks} not divisible by pp={cfg.pp} x dp_replicate={cfg.dp_replicate} x cp={cfg.cp} "
                    f"x tp={cfg.tp} = {others}"
                )
            dp_shard = llm_ranks // others
        schedule = cfg.pp_schedule if cfg.pp > 1 else "1F1B"  # one stage has no schedule to choose
        plan = cls(
            dp_replicate=cfg.dp_replicate,
            dp_shard=dp_shard,
            tp=cfg.tp,
            pp=cfg.pp,
            cp=cfg.cp,
            ep=cfg.ep,
            cp_kind=cfg.cp_kind,
            pp_schedule=schedule,
            virtual_stages=2 if schedule == "Interleaved1F1B" else 1,
            encoders=encoders,
            sharding=cfg.sharding,
        )
        plan.check_world(world_size)
        return plan

    def recipe_fields(self) -> dict:
        """The recipe's `parallel` fields that run this plan (its degrees, sharding stage and encoders' layout)."""
        return {**{degree: getattr(self, degree) for degree in PLAN_DEGREES}, "encoders": asdict(self.encoders)}

    # --- validation --------------------------------------------------------------------------------------

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            encoders = f" + encoders.ranks={self.encoders.ranks}" if self.encoders.ranks else ""
            raise PlanError(
                f"plan {self.name} needs pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} "
                f"x cp={self.cp} x tp={self.tp}{encoders} = {self.world_size} ranks, but the world size is {world_size}"
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
        if shape.tied_embeddings and self.pp > 1:
            problems.append(f"pp={self.pp} would put the tied embedding and output head on different stages")
        if shape.tied_embeddings and self.tp > 1:
            problems.append(f"tp={self.tp} shards the embedding and the output head apart, but they are tied")
        if shape.sliding_window and self.cp > 1:
            problems.append(f"cp={self.cp}: context-parallel attention has no sliding window")
        if problems:
            raise PlanError(f"plan {self.name} does not fit the model: " + "; ".join(problems))

    def check_microbatches(self, n: int) -> None:
        """Refuse a pipeline schedule that cannot run `n` micro-batches per step (torch.distributed.pipelining's
        rules: 1F1B needs one per stage; interleaved 1F1B runs them in rounds of max(1, n // pp))."""
        if self.pp == 1 or self.pp_schedule == "GPipe":
            return
        if self.pp_schedule == "1F1B" and n < self.pp:
            raise PlanError(
                f"plan {self.name}: pp={self.pp} (1F1B) needs at least {self.pp} micro-batches per step, "
                f"got {n} (raise train.grad_accum)"
            )
        rounds = max(1, n // self.pp)
        if self.pp_schedule == "Interleaved1F1B" and n % rounds:
            raise PlanError(
                f"plan {self.name}: pp={self.pp} (interleaved 1F1B) runs micro-batches in rounds of "
                f"{rounds}, which must divide the {n} per step (train.grad_accum)"
            )

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

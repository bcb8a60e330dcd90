"""The `model` and `parallel` sections of a recipe: the flavor, its pretrained parts and starting weights, its
frozen parts, the LLM's 5D degrees and where the encoders run (`encoder_layout_problems` is shared with
`common.plan.EncoderPlan`)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

from omni_core.recipe.base import Strict

MAX_LOCAL_RANKS = 1024  # torchrun ranks on one machine at most: past any node's GPUs or cores
ModelPart = Literal["vision", "audio", "projectors", "llm"]  # OmniModel's modules, what model.freeze names
MODEL_PARTS: tuple[str, ...] = get_args(ModelPart)


class PretrainedParts(Strict):
    """Local checkpoint directories in transformers' layout (config.json and safetensors), one per part."""

    llm: str | None = Field(None, description="A Llama/Qwen2/Mistral-style LLM; its tokenizer becomes the recipe's")
    vision: str | None = Field(None, description="A SigLIP vision tower (its processor config sets image inputs)")
    audio: str | None = Field(None, description="A Whisper encoder (its feature extractor config sets log-mels)")


class ModelConfig(Strict):
    flavor: str = Field("debug", description="Name in the model flavor registry")
    pretrained: PretrainedParts = Field(
        default_factory=PretrainedParts,
        description="Parts started from transformers checkpoints: each part's architecture from its config.json "
        "(the flavor's is replaced), its weights from its files; the projectors start fresh",
    )
    init_from: str | None = Field(
        None,
        description="Start from these weights only (no optimizer state, step or data position; saved under any "
        "plan): a checkpoint step folder (…/step_NNNNNN), a checkpoint folder (its newest complete step), or "
        "models:/NAME@ALIAS from the MLflow registry. How a stage starts from the one before it. A run's own "
        "checkpoint wins: a resumed run (train.resume) continues from it instead",
    )
    freeze: list[ModelPart] = Field(default_factory=list)
    vision_final_norm: bool = Field(
        True,
        description="The image projector reads the vision tower's output after its final LayerNorm (SigLIP's "
        "post_layernorm); false: the last block's output, as LLaVA does (needed by `omni export`)",
    )
    audio_pool: StrictInt = Field(
        1,
        ge=1,
        description="Neighbouring audio encoder outputs averaged into one after its blocks, before its final norm: "
        "2 is Qwen2-Audio's avg_pooler, needed by `omni export` of an audio model (the LLM gets half the audio "
        "tokens); 1: none, Whisper's encoder as it is",
    )
    # the names of omni_core.models.args.ProjectorKind (a test compares)
    audio_projector: Literal["mlp", "linear"] = Field(
        "mlp",
        description="The audio projector: mlp, omni's two-layer GELU MLP; linear, one Linear from the encoder's "
        "width to the LLM's, Qwen2-Audio's multi_modal_projector (needed by `omni export` of an audio model)",
    )
    placeholders: dict[Literal["image", "audio", "video"], str] = Field(
        default_factory=dict,
        description="The token standing for each medium's embeddings in the LLM's vocabulary, where a model family "
        "has its own (Qwen2-VL's <|image_pad|>, Qwen2-Audio's <|AUDIO|>) and its chat template writes it; by "
        "default <image>, <audio>, <video>, added as special tokens where the vocabulary lacks them",
    )
    # the names of omni_core.models.args.AttentionKind (the recipe layer imports no model code; a test compares)
    attention: Literal["auto", "sdpa", "flex", "varlen"] = Field(
        "auto",
        description="How attention runs over the packed documents (LLM and encoders): varlen, FlashAttention over "
        "all documents in one call (CUDA, bf16); sdpa, one SDPA call per document (everywhere); flex, "
        "flex_attention with a block-sparse document mask (CUDA); auto: varlen where it runs, else sdpa",
    )

    @model_serializer(mode="wrap")
    def _options_only_when_set(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The audio options and the placeholders are left out of a dump at their defaults, so that the recipes
        and training hashes (checkpoint folders) from before them stay what they were."""
        out = dump(self)
        for name in ("audio_pool", "audio_projector"):
            if getattr(self, name) == type(self).model_fields[name].default:
                out.pop(name, None)
        if not self.placeholders:
            out.pop("placeholders", None)
        return dict(out)

    @model_validator(mode="after")
    def _placeholders_name_a_vocabulary(self) -> ModelConfig:
        if self.placeholders and self.pretrained.llm is None:
            raise ValueError(
                "placeholders: tokens of a pretrained LLM's vocabulary; without model.pretrained.llm the byte "
                "tokenizer's placeholders are fixed ids"
            )
        return self

    @field_validator("freeze")
    @classmethod
    def _something_to_train(cls, freeze: list[str]) -> list[str]:
        if set(freeze) >= set(MODEL_PARTS):
            raise ValueError(
                f"every part of the model is frozen ({', '.join(MODEL_PARTS)}): nothing is left to "
                "train (the optimizer would get no parameters)"
            )
        return freeze


ENCODER_LAYOUTS = ("coupled", "omni", "disaggregated")
ENCODER_SCHEDULES = ("phased", "joint")
PLAN_DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "pp_schedule", "cp", "cp_kind", "ep", "sharding")
SHARDING_STAGES = ("replicate", "zero1", "zero2", "fsdp")


def sharding_problems(sharding: str, ep: int, layout: str) -> list[str]:
    """What the runtime cannot build of a sharding stage, each naming `sharding`; shared by the recipe and by
    `common.plan.ParallelPlan`. ZeRO-1/2 and replicate keep one gradient reduction group for every parameter
    (`parallel.zero`): experts under EP reduce over their own replicas, and `omni` / `disaggregated` encoders
    reduce on their own layout, so both are left to FSDP."""
    if sharding not in SHARDING_STAGES:
        return [f"sharding={sharding!r} must be one of {', '.join(SHARDING_STAGES)}"]
    if sharding == "fsdp":
        return []
    out = []
    if ep > 1:
        out.append(f"sharding={sharding} with ep={ep} is not built: experts reduce over their own replicas (use fsdp)")
    if layout != "coupled":
        out.append(
            f"sharding={sharding} with encoders.layout={layout} is not built: those encoders reduce on their own "
            "layout (use fsdp, or coupled encoders)"
        )
    return out


ENCODER_SPEC_DEFAULTS = {"lssp": 1, "long_tokens": 0, "long_mb": 0, "fsdp": False}


def encoder_layout_problems(layout: str, ranks: int, specs: dict[str, dict], schedule: str = "phased") -> list[str]:
    """Every problem of an encoder layout, each naming its `encoders.` field; shared by the recipe and by
    `common.plan.EncoderPlan` (a plan read back from its name)."""
    if layout not in ENCODER_LAYOUTS:
        return [f"encoders.layout={layout!r} must be one of {', '.join(ENCODER_LAYOUTS)}"]
    out: list[str] = []
    for encoder, spec in specs.items():
        out.extend(
            f"encoders.{encoder}.{key}={spec[key]} must be >= {least}"
            for key, least in (("lssp", 1), ("long_tokens", 0), ("long_mb", 0))
            if spec[key] < least
        )
        if spec["lssp"] > 1 and not (spec["long_tokens"] or spec["long_mb"]):
            out.append(f"encoders.{encoder}.lssp={spec['lssp']} needs a long-item threshold (long_tokens or long_mb)")
        if layout == "coupled" and spec != ENCODER_SPEC_DEFAULTS:
            out.append(
                f"encoders.{encoder} is set, which needs layout omni or disaggregated: coupled encoders "
                "run on their LLM stage's batches as they come"
            )
    if layout == "disaggregated" and ranks < 1:
        out.append("encoders.ranks must be >= 1 under layout disaggregated (the encoders' own ranks)")
    if layout != "disaggregated" and ranks:
        out.append(f"encoders.ranks={ranks} needs layout disaggregated (layout is {layout})")
    if schedule not in ENCODER_SCHEDULES:
        out.append(f"encoders.schedule={schedule!r} must be one of {', '.join(ENCODER_SCHEDULES)}")
    elif schedule == "joint" and layout == "coupled":
        out.append(
            "encoders.schedule=joint needs layout omni or disaggregated: coupled encoders already run inside "
            "the first pipeline stage, per micro-batch"
        )
    return out


class EncoderSpecConfig(Strict):
    """One encoder's layout over its group (omni and disaggregated layouts)."""

    lssp: StrictInt = Field(1, ge=1, description="Ranks a long item is split over (long-short sequence parallelism)")
    long_tokens: StrictInt = Field(
        0, ge=0, description="An item with more encoder tokens (patches, mel frames) is long; 0: no threshold by cost"
    )
    long_mb: StrictInt = Field(
        0, ge=0, description="An item whose encoder activations exceed this many MiB is long; 0: no threshold by memory"
    )
    fsdp: StrictBool = Field(
        False,
        description="Shard the encoder's weights over its group, its blocks gathered one at a time (else replicated)",
    )


class EncodersConfig(Strict):
    """Where the encoders run (DESIGN.md §3): coupled (the LLM's first stage, Megatron-LLaVA), omni (every rank,
    their own balanced layout, MegaScale-Omni) or disaggregated (ranks of their own, DistTrain)."""

    layout: Literal["coupled", "omni", "disaggregated"] = "coupled"
    ranks: StrictInt = Field(0, ge=0, description="disaggregated: ranks the encoders get (the LLM gets the rest)")
    vision: EncoderSpecConfig = EncoderSpecConfig()
    audio: EncoderSpecConfig = EncoderSpecConfig()
    schedule: Literal["phased", "joint"] = Field(
        "phased",
        description="phased: the step's encoder forward, the LLM, the encoder backward; joint: the encoders per "
        "micro-batch in the ranks' idle time, embeddings handed off as they are made (omni, disaggregated)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> EncodersConfig:
        problems = encoder_layout_problems(
            self.layout,
            self.ranks,
            {"vision": self.vision.model_dump(), "audio": self.audio.model_dump()},
            self.schedule,
        )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ParallelConfig(Strict):
    """Degrees of the LLM's 5D layout; their product with dp is the world size."""

    nproc: StrictInt = Field(
        1, ge=1, le=MAX_LOCAL_RANKS, description="Local ranks started by torchrun (--nproc-per-node)"
    )
    plan: Literal["explicit", "auto"] = Field(
        "explicit",
        description="explicit: the degrees below; auto: the estimate stage's best plan for the Cell "
        "the train stage has (this machine's device type x nproc), with its micro-batch, gradient accumulation "
        "(the global batch kept) and activation checkpointing; the degrees below must then stay unset",
    )
    dp_replicate: StrictInt = Field(1, ge=1)
    dp_shard: StrictInt = Field(-1, ge=-1, description="-1: whatever is left of the world after the other degrees")
    tp: StrictInt = Field(1, ge=1)
    pp: StrictInt = Field(1, ge=1)
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe"] = "1F1B"
    cp: StrictInt = Field(1, ge=1)
    cp_kind: Literal["ulysses", "ring"] = "ulysses"
    ep: StrictInt = Field(1, ge=1)
    sharding: Literal["replicate", "zero1", "zero2", "fsdp"] = Field(
        "fsdp",
        description="What the dp_shard x cp ranks split: fsdp (parameters, gradients, optimizer states), zero2 "
        "(gradients and optimizer states), zero1 (optimizer states), replicate (nothing); see common/plan.py",
        exclude_if=lambda stage: stage == "fsdp",  # the default leaves dumps and recipe hashes as they were
    )
    encoders: EncodersConfig = EncodersConfig()
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    @model_validator(mode="after")
    def _dp_shard_set_or_derived(self) -> ParallelConfig:
        if self.dp_shard == 0:
            raise ValueError("dp_shard must be -1 (derived from the world size) or >= 1")
        return self

    @model_validator(mode="after")
    def _sharding_built(self) -> ParallelConfig:
        problems = sharding_problems(self.sharding, self.ep, self.encoders.layout)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _auto_leaves_the_degrees_unset(self) -> ParallelConfig:
        given = [k for k in PLAN_DEGREES if getattr(self, k) != type(self).model_fields[k].default]
        if self.plan == "auto" and given:
            raise ValueError(
                f"plan is auto, so the estimate stage chooses {', '.join(given)}: drop "
                f"{'them' if len(given) > 1 else 'it'}, or set parallel.plan=explicit to run them"
            )
        return self

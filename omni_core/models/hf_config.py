"""A Hugging Face `config.json` <-> our model args, for the architectures `hf_import` reads: Llama, Mistral,
Qwen2, Mixtral and Qwen2-MoE decoders, the SigLIP vision tower and the Whisper encoder.

Every key of the file is accounted for: read into the args, known to change nothing we compute (token ids,
bookkeeping, the parts of a model we do not import), or refused, naming the file, the key and the value. A
setting that changes the numbers and that we cannot honour therefore never loads silently. Defaults of keys a
file leaves out are transformers' defaults for that model type. Export writes the config transformers builds
the same module from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from omni_core.models.args import (
    Activation,
    AudioArgs,
    EncoderActivation,
    LLMArgs,
    MoEArgs,
    RopeKind,
    RopeScaling,
    VisionArgs,
)

# model_type -> (our name table in hf_import, transformers' defaults for the keys a file may leave out)
DECODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
    "mistral": ("llama", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "sliding_window": 4096}),
    "qwen2": ("qwen2", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
    "mixtral": ("mixtral", {"rope_theta": 1e6, "rms_norm_eps": 1e-5}),
    "qwen2_moe": ("qwen2_moe", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}

# Keys that change nothing in a forward or a training step of the imported part
_BOOKKEEPING = {
    "architectures",
    "model_type",
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "use_cache",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "tokenizer_class",
    "id2label",
    "label2id",
    "problem_type",
    "max_position_embeddings",
    "output_router_logits",
    "task_specific_params",
    "prefix",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
}
_ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}  # gelu_new is the tanh formula written out
_ENCODER_ACTIVATIONS: dict[str, EncoderActivation] = {
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}


class ConfigRefused(ValueError):
    """A config.json setting omni cannot honour (or read): the message names the file, the key and the value."""


class _Reader:
    """One config's keys, each marked as it is read, so that what nobody read can be refused by name."""

    def __init__(self, config: dict[str, Any], source: str, defaults: dict[str, Any] | None = None):
        self.config, self.source, self.defaults = config, source, defaults or {}
        self.read: set[str] = set(_BOOKKEEPING)

    def get(self, key: str, default: Any = None) -> Any:
        """The key's value; transformers' default for the model type when the file leaves it out, `default`
        when the file writes null (Mistral's `sliding_window: null` is no window, not the type's 4096)."""
        self.read.add(key)
        if key not in self.config:
            return self.defaults.get(key, default)
        value = self.config[key]
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigRefused(f"{self.source}: {key} is missing")
        return value

    def refuse(self, key: str, why: str) -> ConfigRefused:
        return ConfigRefused(f"{self.source}: {key}={self.config.get(key)!r}: {why}")

    def only(self, key: str, allowed: Callable[[Any], bool], why: str, default: Any = None) -> None:
        """Refuse `key` unless its value (or default) passes `allowed`."""
        if not allowed(self.get(key, default)):
            raise self.refuse(key, why)

    def ignore(self, *keys: str) -> None:
        self.read.update(keys)

    def finish(self) -> None:
        unread = sorted(set(self.config) - self.read)
        if unread:
            raise ConfigRefused(
                f"{self.source}: {', '.join(f'{k}={self.config[k]!r}' for k in unread)}: "
                "not a setting omni reads, so it cannot be honoured"
            )


def read_config(directory: str | Path) -> tuple[dict[str, Any], str]:
    """The parsed config.json of a checkpoint directory, and its path for messages."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (a checkpoint directory holds it beside the weights)")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as err:
        raise ConfigRefused(f"{path}: not JSON ({err})") from err


# --- decoders -------------------------------------------------------------------------------------------


def llm_args_from_config(config: dict[str, Any], source: str) -> tuple[LLMArgs, str]:
    """LLMArgs of a decoder config and the name table its weights use (`hf_import.LAYOUTS`)."""
    model_type = config.get("model_type")
    if model_type not in DECODERS:
        raise ConfigRefused(f"{source}: model_type={model_type!r}: omni imports decoders of type {', '.join(DECODERS)}")
    layout, defaults = DECODERS[model_type]
    r = _Reader(config, source, defaults)
    dim, heads = r.need("hidden_size"), r.need("num_attention_heads")
    r.only(
        "head_dim",
        lambda v: v is None or v == dim // heads,
        f"omni's attention heads are hidden_size / num_attention_heads = {dim // heads} wide",
    )
    activation = r.get("hidden_act", "silu")
    if activation not in _ACTIVATIONS:
        raise r.refuse("hidden_act", f"omni's FFN gates with {', '.join(_ACTIVATIONS)}")
    r.only("attention_dropout", lambda v: not v, "omni trains without dropout", 0.0)
    r.only("attention_bias", lambda v: not v, "omni's Llama-style attention has no projection biases", False)
    r.only("mlp_bias", lambda v: not v, "omni's FFN has no biases", False)
    r.ignore("pretraining_tp")  # transformers' sliced matmuls for it compute the same product
    args = LLMArgs(
        vocab_size=r.need("vocab_size"),
        dim=dim,
        n_layers=r.need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=r.get("num_key_value_heads", heads),
        ffn_hidden=r.need("intermediate_size"),
        norm_eps=r.get("rms_norm_eps"),
        qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        activation=_ACTIVATIONS[activation],
        tied_embeddings=bool(r.get("tie_word_embeddings", False)),
        **_rope(r),
        **_window(r, model_type),
    )
    if model_type == "mixtral":
        args = _mixtral(r, args)
    elif model_type == "qwen2_moe":
        args = _qwen2_moe(r, args)
    r.finish()
    return args, layout


def _rope(r: _Reader) -> dict[str, Any]:
    """rope_theta and rope_scaling from transformers 5's `rope_parameters` or the older top-level keys."""
    if r.config.get("rope_parameters") is not None:
        params, key = dict(r.get("rope_parameters")), "rope_parameters"
    else:
        params, key = dict(r.get("rope_scaling") or {}), "rope_scaling"
        params["rope_theta"] = r.get("rope_theta")
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = params.pop("rope_theta", None) or r.defaults["rope_theta"]

    def refuse(name: str, why: str) -> ConfigRefused:
        return ConfigRefused(f"{r.source}: {key}.{name}={params.get(name, kind)!r}: {why}")

    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigRefused(f"{r.source}: {key}.partial_rotary_factor: omni rotates every head dimension")
    if kind == "default":
        scaling = None
    elif kind in ("linear", "llama3", "yarn"):
        scaling = _scaling(kind, params, r, refuse)
    else:
        why = (
            "transformers recomputes it from the longest sequence seen so far, so a packed step has no equivalent"
            if kind == "dynamic"
            else "omni builds default, linear, llama3 and yarn"
        )
        raise refuse("rope_type", why)
    if params:
        raise refuse(next(iter(params)), "not a rope setting omni reads")
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def _scaling(
    kind: RopeKind, params: dict[str, Any], r: _Reader, refuse: Callable[[str, str], ConfigRefused]
) -> RopeScaling:
    original = params.pop("original_max_position_embeddings", None)
    factor = params.pop("factor", None)
    if factor is None and kind == "yarn" and original:  # transformers: the context's growth over pre-training
        factor = r.config.get("max_position_embeddings", original) / original
    if factor is None:
        raise refuse("factor", "is missing")
    options = {
        name: params.pop(name)
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "truncate")
        if params.get(name) is not None
    }
    for name in ("mscale", "mscale_all_dim"):
        if params.pop(name, None):
            raise refuse(name, "DeepSeek's mscale attention factor is not built")
    if kind == "linear":
        original, options = None, {}
    return RopeScaling(kind=kind, factor=float(factor), original_max_positions=original, **options)


def _window(r: _Reader, model_type: str) -> dict[str, Any]:
    """Mistral and Mixtral slide in every layer; Qwen2 from max_window_layers on, when use_sliding_window."""
    n_layers: int = r.need("num_hidden_layers")
    if model_type in ("mistral", "mixtral"):
        return {"sliding_window": r.get("sliding_window") or None}
    if model_type == "llama":
        return {}
    window, start = r.get("sliding_window"), r.get("max_window_layers", 28)
    if not r.get("use_sliding_window", False) or not window:
        r.ignore("layer_types")
        return {}
    types = r.get("layer_types")
    if types is not None:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if sliding != list(range(sliding[0] if sliding else n_layers, n_layers)):
            raise r.refuse("layer_types", "omni slides in a last run of layers only")
        start = sliding[0] if sliding else n_layers
    return {"sliding_window": window, "full_attention_layers": min(start, n_layers)}


def _mixtral(r: _Reader, args: LLMArgs) -> LLMArgs:
    r.only("router_jitter_noise", lambda v: not v, "omni's router adds no noise", 0.0)
    top_k = r.need("num_experts_per_tok")
    # transformers' balancing loss sums its k slots where ours averages them: the same objective at k x coef
    moe = MoEArgs(
        num_experts=r.need("num_local_experts"), top_k=top_k, aux_loss_coef=r.get("router_aux_loss_coef", 0.001) * top_k
    )
    return replace(args, moe=moe)


def _qwen2_moe(r: _Reader, args: LLMArgs) -> LLMArgs:
    r.only("decoder_sparse_step", lambda v: v == 1, "omni builds every layer sparse", 1)
    r.only("mlp_only_layers", lambda v: not v, "omni builds every layer sparse", [])
    r.ignore("intermediate_size", "qkv_bias")  # the dense layers' width, of which there are none; biases: always
    top_k = r.need("num_experts_per_tok")
    moe = MoEArgs(
        num_experts=r.need("num_experts"),
        top_k=top_k,
        shared_expert=True,
        shared_hidden=r.need("shared_expert_intermediate_size"),
        shared_gate=True,
        renormalize=bool(r.get("norm_topk_prob", False)),
        aux_loss_coef=r.get("router_aux_loss_coef", 0.001) * top_k,
    )
    return replace(args, ffn_hidden=r.need("moe_intermediate_size"), moe=moe)


def llm_config(args: LLMArgs, model_type: str) -> dict[str, Any]:
    """The config.json of `args` as a decoder of `model_type` (transformers 5's keys)."""
    if model_type not in DECODERS:
        raise ValueError(f"unknown decoder type {model_type!r}; known: {', '.join(DECODERS)}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope.update(rope_type=s.kind, factor=s.factor)
        if s.kind != "linear":
            rope["original_max_position_embeddings"] = s.original_max_positions
        if s.kind == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
        if s.kind == "yarn":
            rope.update(
                beta_fast=s.beta_fast, beta_slow=s.beta_slow, attention_factor=s.attention_factor, truncate=s.truncate
            )
    activation = {"gelu_tanh": "gelu_pytorch_tanh"}.get(args.activation, args.activation)
    config = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "hidden_act": activation,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": args.tied_embeddings,
    }
    if args.sliding_window is not None:
        config["sliding_window"] = args.sliding_window
        if model_type in ("qwen2", "qwen2_moe"):
            config.update(use_sliding_window=True, max_window_layers=args.full_attention_layers)
    moe = args.moe
    if model_type == "mixtral" and moe:
        config.update(
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            router_aux_loss_coef=moe.aux_loss_coef / moe.top_k,
        )
    if model_type == "qwen2_moe" and moe:
        config.update(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=args.ffn_hidden,
            shared_expert_intermediate_size=moe.shared_hidden or args.ffn_hidden,
            norm_topk_prob=moe.renormalize,
            router_aux_loss_coef=moe.aux_loss_coef / moe.top_k,
        )
    return config


# --- encoders -------------------------------------------------------------------------------------------


def vision_args_from_config(config: dict[str, Any], source: str) -> tuple[VisionArgs, str]:
    """VisionArgs of a SigLIP vision config (or a full SigLIP model's `vision_config`) and the tensors' prefix."""
    prefix = ""
    if config.get("model_type") == "siglip":
        config, source, prefix = config.get("vision_config") or {}, f"{source} vision_config", "vision_model."
    elif config.get("model_type") != "siglip_vision_model":
        raise ConfigRefused(
            f"{source}: model_type={config.get('model_type')!r}: omni imports the SigLIP vision "
            "tower (siglip, siglip_vision_model); CLIP's class token and pre-norm are not built"
        )
    r = _Reader(config, source)
    r.only("num_channels", lambda v: v == 3, "omni's patches are RGB", 3)
    r.only("attention_dropout", lambda v: not v, "omni trains without dropout", 0.0)
    r.ignore("vision_use_head")  # the pooling head's tensors are skipped on import (an MLLM uses the patches)
    dim, patch = r.get("hidden_size", 768), r.get("patch_size", 16)
    activation = r.get("hidden_act", "gelu_pytorch_tanh")
    if activation not in _ENCODER_ACTIVATIONS:
        raise r.refuse("hidden_act", "omni's encoder MLPs use gelu, gelu_pytorch_tanh or relu")
    args = VisionArgs(
        patch_dim=3 * patch * patch,
        dim=dim,
        n_layers=r.get("num_hidden_layers", 12),
        n_heads=r.get("num_attention_heads", 12),
        mlp_ratio=_mlp_ratio(dim, r.get("intermediate_size", 3072)),
        pos_embed="absolute",
        max_grid=r.get("image_size", 224) // patch,
        activation=_ENCODER_ACTIVATIONS[activation],
        norm_eps=r.get("layer_norm_eps", 1e-6),
    )
    r.finish()
    return args, prefix


def audio_args_from_config(config: dict[str, Any], source: str) -> tuple[AudioArgs, str]:
    """AudioArgs of a Whisper config's encoder and the tensors' prefix in a full Whisper file."""
    if config.get("model_type") != "whisper":
        raise ConfigRefused(f"{source}: model_type={config.get('model_type')!r}: omni imports Whisper's encoder")
    r = _Reader(config, source)
    # the decoder and generation: not imported
    r.ignore(
        *(
            k
            for k in config
            if k.startswith(
                (
                    "decoder_",
                    "max_target",
                    "suppress",
                    "begin_suppress",
                    "forced_decoder",
                    "mask_",
                    "classifier",
                    "median_filter",
                )
            )
        )
    )
    r.ignore("vocab_size", "init_std", "use_weighted_layer_sum", "tie_word_embeddings")  # the decoder's
    r.only("apply_spec_augment", lambda v: not v, "omni does not mask features in training", False)
    for key in ("dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop"):
        r.only(key, lambda v: not v, "omni trains without dropout", 0.0)
    r.only("scale_embedding", lambda v: not v, "omni's encoder does not scale its inputs by sqrt(d_model)", False)
    activation = r.get("activation_function", "gelu")
    if activation not in _ENCODER_ACTIVATIONS:
        raise r.refuse("activation_function", "omni's encoder MLPs use gelu, gelu_pytorch_tanh or relu")
    dim = r.get("d_model", 256)
    args = AudioArgs(
        n_mels=r.get("num_mel_bins", 80),
        dim=dim,
        n_layers=r.get("encoder_layers", 4),
        n_heads=r.get("encoder_attention_heads", 4),
        mlp_ratio=_mlp_ratio(dim, r.get("encoder_ffn_dim", 1536)),
        max_frames=2 * r.get("max_source_positions", 1500),
        activation=_ENCODER_ACTIVATIONS[activation],
    )
    r.finish()
    return args, "model.encoder."


def _mlp_ratio(dim: int, hidden: int) -> float:
    """The ratio whose int(dim * ratio) is exactly `hidden` (the encoder blocks' width rule)."""
    ratio = hidden / dim
    return ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim


def vision_config(args: VisionArgs) -> dict[str, Any]:
    patch = math.isqrt(args.patch_dim // 3)
    return {
        "architectures": ["SiglipVisionModel"],
        "model_type": "siglip_vision_model",
        "hidden_size": args.dim,
        "intermediate_size": int(args.dim * args.mlp_ratio),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_channels": 3,
        "patch_size": patch,
        "image_size": args.max_grid * patch,
        "layer_norm_eps": args.norm_eps,
        "vision_use_head": False,
        "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(args.activation, args.activation),
    }


def audio_config(args: AudioArgs) -> dict[str, Any]:
    """An encoder-only Whisper config: `WhisperEncoder.from_pretrained` builds the encoder from it."""
    return {
        "model_type": "whisper",
        "d_model": args.dim,
        "encoder_layers": args.n_layers,
        "encoder_attention_heads": args.n_heads,
        "encoder_ffn_dim": int(args.dim * args.mlp_ratio),
        "num_mel_bins": args.n_mels,
        "max_source_positions": args.max_frames // 2,
        "activation_function": {"gelu_tanh": "gelu_pytorch_tanh"}.get(args.activation, args.activation),
    }


PARTS = ("llm", "vision", "audio")
PartArgs = LLMArgs | VisionArgs | AudioArgs


def part_args(directory: str | Path, part: str) -> tuple[PartArgs, str, str]:
    """The args of the part (`llm`, `vision` or `audio`) a transformers checkpoint directory holds, from its
    config.json, with the layout its weights are in and their prefix. Raises `ConfigRefused` naming the key for
    a setting omni cannot honour, FileNotFoundError for a missing config.json."""
    config, source = read_config(directory)
    if part == "llm":
        llm_args, layout = llm_args_from_config(config, source)
        return llm_args, layout, ""
    if part == "vision":
        vision_args, prefix = vision_args_from_config(config, source)
        return vision_args, "siglip", prefix
    if part == "audio":
        audio_args, prefix = audio_args_from_config(config, source)
        return audio_args, "whisper", prefix
    raise ValueError(f"unknown model part {part!r}; parts: {', '.join(PARTS)}")

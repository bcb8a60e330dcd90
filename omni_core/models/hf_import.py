"""Hugging Face checkpoints <-> our modules: the LLM (Llama/Mistral, Qwen2, Mixtral and Qwen2-MoE layouts), a
SigLIP ViT and the Whisper encoder. Local files only.

`load_pretrained` reads a checkpoint directory: its config.json into the part's args (`hf_config`, which refuses
by name what we cannot honour) and its safetensors into the module built from them; `save_pretrained` writes
both back. Our parameter names stay torchtitan-style; each layout is a name table plus the few tensors HF
stores and we derive: SigLIP's key bias (softmax cancels it, so it is dropped on import and exported as zeros)
and Whisper's sinusoidal position table (computed by our encoder; checked on import, written on export); a
tied output head is the embedding, so it is neither read nor written. A file is accepted only if it holds
exactly the layout's tensors with the expected shapes; the error names every missing, extra and mis-shaped
tensor and the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from omni_core.models import hf_config
from omni_core.models.args import LLMArgs, VisionArgs
from omni_core.models.audio import AudioEncoder, sinusoids
from omni_core.models.llm import LLM
from omni_core.models.vision import VisionEncoder

# Name tables: our name -> HF name, "{i}" a layer, "{e}" an expert index, "{p}" weight or bias. Every parameter
# must match one.
_LLM_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.wq.{p}": "model.layers.{i}.self_attn.q_proj.{p}",
    "layers.{i}.attention.wk.{p}": "model.layers.{i}.self_attn.k_proj.{p}",
    "layers.{i}.attention.wv.{p}": "model.layers.{i}.self_attn.v_proj.{p}",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_DENSE_FFN = {f"layers.{{i}}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
_ATTENTION_AND_NORMS = {ours: hf for ours, hf in _LLM_NAMES.items() if ours not in _DENSE_FFN}
_MIXTRAL_NAMES = {
    **_ATTENTION_AND_NORMS,
    "layers.{i}.moe.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    **{
        f"layers.{{i}}.moe.experts.{{e}}.{w}.weight": f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight"
        for w in ("w1", "w2", "w3")
    },
}
_SWIGLU_HF = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_QWEN2_MOE_NAMES = {
    **_ATTENTION_AND_NORMS,
    "layers.{i}.moe.router.weight": "model.layers.{i}.mlp.gate.weight",
    **{
        f"layers.{{i}}.moe.experts.{{e}}.{w}.weight": f"model.layers.{{i}}.mlp.experts.{{e}}.{hf}.weight"
        for w, hf in _SWIGLU_HF.items()
    },
    **{
        f"layers.{{i}}.moe.shared_expert.{w}.weight": f"model.layers.{{i}}.mlp.shared_expert.{hf}.weight"
        for w, hf in _SWIGLU_HF.items()
    },
    "layers.{i}.moe.shared_gate.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
# rotary tables some files carry: transformers recomputes them from the config, and so do we
_ROTARY_BUFFERS = r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$"


def _encoder_block_names(hf_layer: str, norm1: str, norm2: str, mlp: str) -> dict[str, str]:
    """EncoderBlock names under HF's SigLIP/Whisper layer naming (which differ only in these parts)."""
    return {
        "layers.{i}.attention_norm.{p}": f"{hf_layer}.{norm1}.{{p}}",
        "layers.{i}.attention.wq.{p}": f"{hf_layer}.self_attn.q_proj.{{p}}",
        "layers.{i}.attention.wk.weight": f"{hf_layer}.self_attn.k_proj.weight",
        "layers.{i}.attention.wv.{p}": f"{hf_layer}.self_attn.v_proj.{{p}}",
        "layers.{i}.attention.wo.{p}": f"{hf_layer}.self_attn.out_proj.{{p}}",
        "layers.{i}.mlp_norm.{p}": f"{hf_layer}.{norm2}.{{p}}",
        "layers.{i}.mlp.0.{p}": f"{hf_layer}.{mlp}fc1.{{p}}",
        "layers.{i}.mlp.2.{p}": f"{hf_layer}.{mlp}fc2.{{p}}",
    }


@dataclass(frozen=True)
class Layout:
    module_type: type[nn.Module]
    names: dict[str, str]
    # HF tensors we derive instead of storing: module -> {HF name: (tensor to export, must match on import)}
    derived: Callable[[nn.Module], dict[str, tuple[torch.Tensor, bool]]] = lambda module: {}
    # Our tensor -> its HF form (same elements, another shape)
    to_hf: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, tensor: tensor
    ignored: str = r"$^"  # HF tensors in the file that this module does not use (by default: none)

    def hf_name(self, name: str) -> str:
        for ours, hf in self.names.items():
            pattern = (
                re.escape(ours)
                .replace(r"\{i\}", r"(?P<i>\d+)")
                .replace(r"\{e\}", r"(?P<e>\d+)")
                .replace(r"\{p\}", r"(?P<p>weight|bias)")
            )
            match = re.fullmatch(pattern, name)
            if match:
                return hf.format(**match.groupdict())
        raise ValueError(f"parameter {name!r} of this {self.module_type.__name__} has no name in the layout")


def _siglip_key_biases(module: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    vit = cast(VisionEncoder, module)  # the siglip layout's module type
    zeros = torch.zeros(vit.args.dim, dtype=vit.norm.weight.dtype)
    return {f"encoder.layers.{i}.self_attn.k_proj.bias": (zeros, False) for i in range(len(vit.layers))}


def _siglip_patch_conv(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Linear over (c, y, x)-flattened patches == Conv2d(3, dim, p, stride=p) with the weight viewed [dim, 3, p, p]."""
    if name != "patch_embed.weight":
        return tensor
    patch = round((tensor.shape[1] // 3) ** 0.5)
    return tensor.view(tensor.shape[0], 3, patch, patch)


def _whisper_positions(module: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    encoder = cast(AudioEncoder, module)  # the whisper layout's module type
    table = sinusoids(torch.arange(encoder.args.max_frames // 2), encoder.args.dim)
    return {"embed_positions.weight": (table.to(encoder.norm.weight.dtype), True)}


LAYOUTS: dict[str, Layout] = {
    "llama": Layout(LLM, _LLM_NAMES, ignored=_ROTARY_BUFFERS),  # also Mistral's
    "qwen2": Layout(LLM, _LLM_NAMES, ignored=_ROTARY_BUFFERS),  # the same names; q/k/v biases: LLMArgs.qkv_bias
    "mixtral": Layout(LLM, _MIXTRAL_NAMES, ignored=_ROTARY_BUFFERS),
    "qwen2_moe": Layout(LLM, _QWEN2_MOE_NAMES, ignored=_ROTARY_BUFFERS),
    "siglip": Layout(  # SiglipVisionModel (in a full SiglipModel file: prefix="vision_model.")
        VisionEncoder,
        {
            "patch_embed.{p}": "embeddings.patch_embedding.{p}",
            "pos_embed.weight": "embeddings.position_embedding.weight",
            **_encoder_block_names("encoder.layers.{i}", "layer_norm1", "layer_norm2", "mlp."),
            "norm.{p}": "post_layernorm.{p}",
        },
        derived=_siglip_key_biases,
        to_hf=_siglip_patch_conv,
        ignored=r"head\.",  # the attention-pooling head of the contrastive model: an MLLM uses the patch tokens
    ),
    "whisper": Layout(  # WhisperEncoder (in a full Whisper file: prefix="model.encoder.")
        AudioEncoder,
        {
            "conv1.{p}": "conv1.{p}",
            "conv2.{p}": "conv2.{p}",
            **_encoder_block_names("layers.{i}", "self_attn_layer_norm", "final_layer_norm", ""),
            "norm.{p}": "layer_norm.{p}",
        },
        derived=_whisper_positions,
    ),
}


def _layout(module: nn.Module, layout: str) -> Layout:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    spec = LAYOUTS[layout]
    if not isinstance(module, spec.module_type):
        raise TypeError(f"layout {layout!r} is for a {spec.module_type.__name__}, got a {type(module).__name__}")
    return spec


def _stored(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state as a file stores it: a tied output head is the embedding, stored once."""
    state = module.state_dict()
    if isinstance(module, LLM) and module.args.tied_embeddings:
        del state["output.weight"]
    return state


def hf_state_dict(module: nn.Module, layout: str) -> dict[str, torch.Tensor]:
    """The module's weights under the layout's names and shapes, derived tensors included."""
    spec = _layout(module, layout)
    tensors = {spec.hf_name(name): spec.to_hf(name, t.detach()) for name, t in _stored(module).items()}
    tensors.update({name: tensor for name, (tensor, _) in spec.derived(module).items()})
    return tensors


def export_safetensors(module: nn.Module, path: str | Path, layout: str) -> None:
    """Write the model part as one safetensors file in the layout (loadable by the transformers class)."""
    tensors = {name: t.contiguous().clone() for name, t in hf_state_dict(module, layout).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _files(path: Path) -> list[Path]:
    """A safetensors file, or every shard in a directory (model-0000x-of-0000y.safetensors)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors file at {path}")
    return files


def checked_tensors(module: nn.Module, path: str | Path, layout: str, prefix: str = "") -> dict[str, tuple[Path, str]]:
    """Where each tensor the module stores lies in a local checkpoint of the layout: our name -> (file, key).

    `prefix` selects this part's tensors in a file that holds more (e.g. "vision_model."); tensors outside
    it are skipped. Inside it, every tensor must be one the part expects, with the expected shape (read from
    the files' headers: nothing else is read, so `module` may be on the meta device). Rows of an embedding
    or untied head that the module has beyond the file's are allowed (`resized_rows`: a tokenizer added them).
    Raises ValueError naming the file and every missing, extra or mis-shaped tensor."""
    spec = _layout(module, layout)
    path = Path(path)
    expected = {name: tuple(t.shape) for name, t in hf_state_dict(module, layout).items()}
    located: dict[str, Path] = {}
    for file in _files(path):
        with safe_open(file, framework="pt") as f:
            names = f.keys()
            located.update({key[len(prefix) :]: file for key in names if key.startswith(prefix)})
    problems = [f"missing tensor {prefix + name!r}" for name in expected if name not in located]
    tied = isinstance(module, LLM) and module.args.tied_embeddings
    problems += [
        f"unexpected tensor {prefix + name!r}"
        for name in located
        if name not in expected and not re.match(spec.ignored, name) and not (tied and name == "lm_head.weight")
    ]
    for file in sorted(set(located.values())):
        with safe_open(file, framework="pt") as f:
            for name in (name for name in expected if located.get(name) == file):
                shape, want = tuple(f.get_slice(prefix + name).get_shape()), expected[name]
                if shape != want and not (name in RESIZABLE and shape[1:] == want[1:] and shape[0] <= want[0]):
                    problems.append(f"tensor {prefix + name!r} has shape {shape}, expected {want}")
    for name, (value, must_match) in spec.derived(module).items():
        if must_match and name in located and not problems:
            with safe_open(located[name], framework="pt") as f:
                if not torch.allclose(f.get_tensor(prefix + name).float(), value.float(), atol=1e-3):
                    problems.append(f"tensor {prefix + name!r} differs from the table this model computes")
    if problems:
        raise ValueError(f"{path} does not fit the {layout} layout: " + "; ".join(problems))
    return {name: (located[spec.hf_name(name)], prefix + spec.hf_name(name)) for name in _stored(module)}


# The LLM's tensors with a row per token: a tokenizer's added tokens add rows (initialised to the mean of the file's)
RESIZABLE = ("model.embed_tokens.weight", "lm_head.weight")


@torch.no_grad()
def read_shard(file: Path, key: str, shape: torch.Size, box: tuple[slice, ...] | None) -> torch.Tensor:
    """The `box` (global index ranges) of a stored tensor of our `shape`, read memory-mapped: only the box is
    read, so a rank holds its shard, not the tensor. `box` None: the whole tensor. A file tensor in another
    shape (SigLIP's patch convolution) is read whole and viewed in ours; rows past the file's (`RESIZABLE`)
    are the mean of the file's rows."""
    box = box or tuple(slice(0, n) for n in shape)
    with safe_open(file, framework="pt") as f:
        stored = f.get_slice(key)
        stored_shape = tuple(stored.get_shape())
        if stored_shape[1:] != tuple(shape[1:]):  # the same elements in another shape
            return f.get_tensor(key).reshape(shape)[box]
        rows, rest, file_rows = box[0], box[1:], stored_shape[0]
        kept = stored[min(rows.start, file_rows) : min(rows.stop, file_rows), *rest]
        added = rows.stop - max(rows.start, file_rows)
        if added <= 0:
            return kept
        mean = _mean_rows(stored, file_rows, rest)
        return torch.cat([kept, mean.expand(added, *mean.shape[1:]).to(kept.dtype)])


def _mean_rows(stored, rows: int, rest: tuple[slice, ...], chunk: int = 4096) -> torch.Tensor:
    """The mean of a stored tensor's rows (over `rest`'s columns), summed in fp32 a chunk of rows at a time."""
    total = sum(stored[i : min(i + chunk, rows), *rest].float().sum(0, keepdim=True) for i in range(0, rows, chunk))
    return total / rows


@torch.no_grad()
def load_safetensors(module: nn.Module, path: str | Path, layout: str, prefix: str = "") -> None:
    """Copy a local checkpoint in the given layout into the model part (an LLM, VisionEncoder or AudioEncoder);
    nothing is copied unless every tensor fits (`checked_tensors`)."""
    located = checked_tensors(module, path, layout, prefix)
    for name, target in _stored(module).items():
        file, key = located[name]
        target.copy_(read_shard(file, key, target.shape, None))


def part_module(args: hf_config.PartArgs) -> nn.Module:
    """The module a part's args build (on the current default device)."""
    if isinstance(args, LLMArgs):
        return LLM(args)
    return VisionEncoder(args) if isinstance(args, VisionArgs) else AudioEncoder(args)


def load_pretrained(directory: str | Path, part: str) -> tuple[nn.Module, str]:
    """The model part (`llm`, `vision` or `audio`) a transformers checkpoint directory holds, built from its
    config.json and filled from its safetensors; with the layout it was read in. Raises `ConfigRefused`
    naming the key for a setting omni cannot honour, ValueError naming the tensor for weights that do not fit."""
    args, layout, prefix = hf_config.part_args(directory, part)
    module = part_module(args)
    load_safetensors(module, directory, layout, prefix)
    return module, layout


def save_pretrained(module: nn.Module, directory: str | Path, model_type: str | None = None) -> None:
    """Write the part as a transformers checkpoint directory (config.json and model.safetensors) that the
    matching transformers class loads with `from_pretrained`. `model_type`: the decoder family of an LLM
    (llama, mistral, qwen2, mixtral, qwen2_moe)."""
    if isinstance(module, LLM):
        if model_type is None:
            raise ValueError("save_pretrained of an LLM needs its model_type (llama, mistral, qwen2, ...)")
        config, layout = hf_config.llm_config(module.args, model_type), hf_config.DECODERS[model_type][0]
    elif isinstance(module, VisionEncoder):
        config, layout = hf_config.vision_config(module.args), "siglip"
    elif isinstance(module, AudioEncoder):
        if module.args.pool != 1:  # Qwen2-Audio's pooled tower is written whole, with its LLM (`hf_export_audio`)
            raise ValueError(f"save_pretrained: a WhisperEncoder has no pooling, this encoder pools {module.args.pool}")
        config, layout = hf_config.audio_config(module.args), "whisper"
    else:
        raise TypeError(f"no transformers checkpoint for a {type(module).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    export_safetensors(module, directory / "model.safetensors", layout)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")

"""Model architectures: LLM backbone (dense or MoE), vision and audio encoders, projectors, OmniModel, flavor
registry, parameter/FLOP counts (`flops`) and HF safetensors import/export (`hf_import`)."""

from omni_core.models.args import AudioArgs, LLMArgs, MoEArgs, OmniModelArgs, VisionArgs
from omni_core.models.attention import varlen_attention
from omni_core.models.flavors import FLAVORS, get_flavor
from omni_core.models.omni import OmniModel, build_model

__all__ = [
    "FLAVORS",
    "AudioArgs",
    "LLMArgs",
    "MoEArgs",
    "OmniModel",
    "OmniModelArgs",
    "VisionArgs",
    "build_model",
    "get_flavor",
    "varlen_attention",
]

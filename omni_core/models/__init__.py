"""Model architectures: LLM backbone, vision and audio encoders, projectors, OmniModel, flavor registry."""

from omni_core.models.args import AudioArgs, LLMArgs, OmniModelArgs, VisionArgs
from omni_core.models.attention import varlen_attention
from omni_core.models.flavors import FLAVORS, get_flavor
from omni_core.models.omni import OmniModel, build_model

__all__ = [
    "FLAVORS",
    "AudioArgs",
    "LLMArgs",
    "OmniModel",
    "OmniModelArgs",
    "VisionArgs",
    "build_model",
    "get_flavor",
    "varlen_attention",
]

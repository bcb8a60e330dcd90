"""Training FLOPs of one sample from its measured sizes, vectorized over whole chunks of samples.

The counts are the model's own (`omni_core.models.flops`: the convention of the trainer's MFU and of the
estimator). Each is a polynomial in a sample's sizes, so it is evaluated at two sizes per flavor to get the
coefficients, which then apply to arrays of samples at once. A recipe's model is its flavor with the parts
`model.pretrained` names (`FlopModel.for_recipe`). Per sample, training = 3 x forward:

    LLM      a * T + b * T^2                   T: the sample's LLM tokens, as its own causal document
    vision   sum over its images and video frames of  c * n + d * n^2,  + p * V
             n: patches; V: LLM tokens of its images and videos, the image projector's outputs
    audio    e * F + f * sum over its clips of t^2      F: log-mel frames, t = F / 2 encoder tokens per clip

The data's tokens follow its own merges (sample.SPATIAL_MERGE, TEMPORAL_MERGE); under a flavor that merges
spatially more, the projector's tokens are taken as V * (data merge / flavor merge)^2 (edges not rounded up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from omni_core.data.sample import SPATIAL_MERGE
from omni_core.models import flops as model_flops
from omni_core.models.flavors import get_flavor

if TYPE_CHECKING:
    from omni_core.models.args import OmniModelArgs
    from omni_core.recipe.schema import Recipe

FORMULA = __doc__.split("\n\n", 2)[2].strip()


def _coefficients(f: Callable[[float], float], at: float = 1.0) -> tuple[float, float]:
    """(linear, quadratic) coefficients of f(x) = l * x + q * x^2, from f at x = at and 2 * at."""
    one, two = f(at), f(2 * at)
    quadratic = (two - 2 * one) / (2 * at * at)
    return one / at - quadratic * at, quadratic


@dataclass(frozen=True)
class FlopModel:
    llm_per_token: float
    llm_per_token_sq: float
    vision_per_patch: float
    vision_per_patch_sq: float
    projector_per_token: float
    audio_per_frame: float
    audio_per_token_sq: float

    @classmethod
    def for_flavor(cls, flavor: str, *, patch_size: int, n_mels: int) -> FlopModel:
        return cls.for_args(get_flavor(flavor, patch_size=patch_size, n_mels=n_mels))

    @classmethod
    def for_recipe(cls, recipe: Recipe) -> FlopModel:
        """The recipe's model (`models.pretrained.recipe_model_args`): its flavor, with each part
        `model.pretrained` names as its config.json describes it and the model section's options, so a
        pretrained LLM's or tower's cost is its own (the tokenizer's few added rows are left out of the head)."""
        from omni_core.models.pretrained import recipe_model_args

        return cls.for_args(recipe_model_args(recipe)[0])

    @classmethod
    def for_args(cls, args: OmniModelArgs) -> FlopModel:
        train, dims = model_flops.TRAIN_FACTOR, model_flops.projector_dims(args)

        def llm(tokens: float) -> float:
            return train * model_flops.llm_forward_flops(args.llm, [int(tokens)])

        def vision(patches: float) -> float:
            return train * model_flops.vision_forward_flops(args.vision, int(patches))

        rescale = (SPATIAL_MERGE / args.spatial_merge) ** 2
        projector = train * model_flops.projector_forward_flops(*dims["image"], 1) * rescale

        def audio(frames: float) -> float:
            return train * (
                model_flops.audio_forward_flops(args.audio, int(frames))
                + model_flops.projector_forward_flops(*dims["audio"], int(frames) // 2)
            )

        per_frame, per_frame_sq = _coefficients(audio, at=2.0)  # frames are even: t = F / 2, so t^2 = F^2 / 4
        return cls(*_coefficients(llm), *_coefficients(vision), projector, per_frame, 4 * per_frame_sq)

    def llm(self, tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)
        return self.llm_per_token * t + self.llm_per_token_sq * t * t

    def encoder(
        self,
        vision_tokens: np.ndarray,
        vision_sq: np.ndarray,
        vision_llm: np.ndarray,
        audio_frames: np.ndarray,
        audio_sq: np.ndarray,
    ) -> np.ndarray:
        """From a sample's measured sizes: patches and sum of patches^2 over its images and frames, LLM tokens of
        its images and videos, log-mel frames and sum of encoder tokens^2 over its clips."""
        return (
            self.vision_per_patch * np.asarray(vision_tokens, dtype=np.float64)
            + self.vision_per_patch_sq * np.asarray(vision_sq, dtype=np.float64)
            + self.projector_per_token * np.asarray(vision_llm, dtype=np.float64)
            + self.audio_per_frame * np.asarray(audio_frames, dtype=np.float64)
            + self.audio_per_token_sq * np.asarray(audio_sq, dtype=np.float64)
        )

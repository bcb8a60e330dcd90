"""`parallelize_omni(model, plan, ...)`: applies a plan to an OmniModel in one fixed order, as torchtitan
does — tensor parallel -> activation checkpointing -> compile -> FSDP — so every combination composes the
same way. Steps the runtime does not execute yet are refused earlier, by `executable_plan`; data parallelism
is the trainer's gradient all-reduce."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from omni_core.models.omni import OmniModel
from omni_core.parallel.plan import ParallelPlan


def transformer_blocks(model: OmniModel) -> list[tuple[nn.Module, str]]:
    """(container, key) of every transformer block: the encoders' and the LLM's `layers`."""
    blocks = []
    for part in (model.vision, model.audio, model.llm):
        layers = part.layers
        keys = layers.keys() if isinstance(layers, nn.ModuleDict) else range(len(layers))
        blocks.extend((layers, key) for key in keys)
    return blocks


def apply_activation_checkpointing(model: OmniModel) -> None:
    """Recompute each block's activations in backward: memory O(blocks) instead of O(blocks x activations).
    Checkpoint keys are unchanged (DCP's state-dict helpers strip the wrapper's prefix)."""
    for container, key in transformer_blocks(model):
        container[key] = checkpoint_wrapper(container[key], preserve_rng_state=False)


def parallelize_omni(model: OmniModel, plan: ParallelPlan, *, activation_checkpointing: bool) -> OmniModel:
    del plan  # TP, compile and FSDP slot in here, in this order, as the plan's degrees become executable
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    return model

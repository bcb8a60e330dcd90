"""The optimizer probes: the step's gradient norm and the runtime's AdamW over a few and over many small
parameters, plain (one process) or as DTensors (on the ranks): a line through their times gives what the
update costs per parameter group and per tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from omni_core.measure.sampling import fit_line

if TYPE_CHECKING:
    import torch

PROBE_TENSOR_COUNTS = (8, 64)  # parameters of the optimizer probes: the difference is what one more costs


def parameter_probes(make: Callable[[int], list[torch.Tensor]]) -> dict[int, Callable[[], None]]:
    """Per tensor count n of PROBE_TENSOR_COUNTS: the step's gradient norm and the runtime's AdamW
    (`runtime.optimizer.build_optimizer`: foreach, one group per kind of tensor) over `make(n)` small tensors
    (plain or DTensors). A line through their times gives seconds per parameter group and per tensor."""
    import torch

    from omni_core.recipe import Recipe
    from omni_core.runtime.optimizer import build_optimizer

    recipe = Recipe.model_validate({"experiment": {"name": "calibration"}})
    probes = {}
    for n in PROBE_TENSOR_COUNTS:
        module = torch.nn.Module()
        module.params = torch.nn.ParameterList(make(n))
        grads = make(n)
        for param, grad in zip(module.params, grads):
            param.grad = grad
        probes[n] = _update(grads, build_optimizer(module, recipe))
    return probes


def _update(grads: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """The step's update: the norm of the parameters' gradients `grads` (a full tensor's, for DTensors) and
    `optimizer`'s step."""
    import torch
    from torch.distributed.tensor import DTensor

    def update() -> None:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        optimizer.step()

    return update


def per_group_and_tensor(seconds: list[float]) -> tuple[float, float]:
    """(seconds per parameter group, per tensor): the line through the `parameter_probes` times at
    PROBE_TENSOR_COUNTS tensors (a tensor never costs less than nothing)."""
    group_s, tensor_s = fit_line(list(PROBE_TENSOR_COUNTS), seconds)
    return group_s, max(tensor_s, 0.0)

"""The cost model's prediction for a validation case, from a calibration of the device only: the case's plan on
the calibrated device, its data's profile, and the loader's own speed on that data (measured alone, before
any training step)."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.calibration import runtime_efficiency
from omni_core.estimator.cost import Efficiency, Estimate, Options, estimate_step
from omni_core.estimator.omni_workloads import omni_workload
from omni_core.measure.cases import Case, case_recipe

if TYPE_CHECKING:
    from omni_core.data.profile_result import DatasetProfile


def predict(
    case: Case,
    profile: DatasetProfile,
    spec: GpuSpec,
    eff: Efficiency,
    *,
    loader_s: float = 0.0,
    precision: str = "fp32",
) -> Estimate:
    """The cost model's Estimate for the case: its plan on the calibrated device (one node of `world`
    ranks) at the `precision` it trains in, its encoders where the plan puts them, plus `loader_s` of host
    data path per micro-batch on every rank."""
    from omni_core.models.flavors import get_flavor

    recipe_data = case_recipe(case, Path("/nonexistent")).data
    args = get_flavor(case.flavor, patch_size=recipe_data.patch_size, n_mels=recipe_data.n_mels)
    workload = omni_workload(
        args, seq_len=case.seq_len, global_batch=case.global_batch, profile=profile, precision=precision, name=case.name
    )
    eff = replace(runtime_efficiency(eff), step_overhead_s=loader_s * case.grad_accum)
    options = Options(micro_batch=case.micro_batch)
    return estimate_step(workload, spec, case.parallel_plan, options, gpus_per_node=case.world, eff=eff)


def data_profile(case: Case, root: Path) -> DatasetProfile:
    """The profile of the case's data (its mix at its sequence length), written under `root`."""
    from omni_core.data.profile import profile_dataset

    return profile_dataset(case_recipe(case, root), root / "profiles" / f"{case.mix}-s{case.seq_len}", draw=False)[0]


def loader_seconds(case: Case, root: Path, batches: int = 8) -> float:
    """Host data path: median seconds for the runtime's loader to read, decode and pack one micro-batch of
    this case's data (measured alone, before any training step)."""
    from omni_core.data.dataset import open_dataset
    from omni_core.data.loader import PackedLoader

    recipe = case_recipe(case, root)
    loader = iter(PackedLoader(open_dataset(recipe), recipe.data, "train", 0, 1, 0))
    next(loader)
    times = []
    for _ in range(batches):
        start = time.process_time()
        next(loader)
        times.append(time.process_time() - start)
    return statistics.median(times)

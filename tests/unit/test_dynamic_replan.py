"""What a re-planned job's looks need from the estimator when its data drifts: a running plan with LSSP is still
priced on a window without images (the first window of a job that starts on text)."""

from __future__ import annotations

import pytest

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.cost import Options, estimate_step
from omni_core.estimator.paper_workloads import paper_workload

H100 = GpuCatalog()["h100"]


@pytest.mark.parametrize("lssp", [2, 3])
def test_an_lssp_plan_runs_text_only_data(lssp):
    text = paper_workload("A", 0.0)
    assert not text.items.count
    plan = ParallelPlan.parse(f"dp32-cp2u+omni.v-sp{lssp}-t512")
    assert estimate_step(text, H100, plan, Options(1, True), gpus_per_node=8).fits
    images = paper_workload("A", 0.5)  # with images the long-item encoder's heads must split (16 heads)
    priced = estimate_step(images, H100, plan, Options(1, True), gpus_per_node=8)
    assert priced.fits == (images.items.heads % lssp == 0)
    if lssp == 3:
        assert "attention heads" in priced.reason

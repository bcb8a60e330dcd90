"""Host syncs on the step's path (issue #46 item 3): the counter itself, and a training step whose count does
not grow with micro-batches, layers or experts."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from omni_core.common.plan import ParallelPlan
from omni_core.models.flavors import FLAVORS
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from omni_core.runtime.sync_count import HOST_READS, SyncCounter, count_host_syncs
from tests.helpers.models import MIXED_DOCS, VIDEO_DOCS, make_batch
from tests.helpers.recipes import build_recipe
from tests.helpers.runtime import CPU


def test_the_counter_counts_each_host_read_once_and_restores_the_methods():
    values = torch.arange(5)
    before = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    with count_host_syncs() as counter:
        values.tolist()
        int(values[1])
        float(values[2])
        bool(values[0])
        values[1].item()
        values.cpu()
        list(range(values[3]))
    assert dict(counter.by_method) == {
        "tolist": 1,
        "__int__": 1,
        "__float__": 1,
        "__bool__": 1,
        "item": 1,
        "cpu": 1,
        "__index__": 1,
    }
    assert counter.total == 7 and sum(counter.by_site.values()) == 7
    assert all(site.startswith("tests/unit/test_host_syncs.py:") for site in counter.by_site)
    assert {name: getattr(torch.Tensor, name) for name in HOST_READS} == before
    assert not any(name in vars(torch.Tensor) for name in HOST_READS)


def test_the_counter_can_count_only_a_device_types_tensors():
    with count_host_syncs(device_type="cuda") as counter:
        torch.arange(3).tolist()
    assert counter.total == 0


def step_host_reads(root: Path, monkeypatch, *, moe: bool, layers: int, experts: int, micro: int) -> SyncCounter:
    """Host reads of one world-1 `train_step` (after a first one: optimizer state and lazy device copies are
    made once) over `micro` micro-batches of text, images and audio, on `debug` / `debug-moe` resized to
    `layers` blocks and `experts` experts, in the `omni` encoder layout (at world 1, the encoders on the rank).

    AdamW's step counters are not counted: they are host tensors on a GPU too (outside fused AdamW), so reading
    them is no sync, though on the CPU they cannot be told apart from the step's tensors by device."""
    base = FLAVORS["debug-moe" if moe else "debug"]
    llm = replace(base.llm, n_layers=layers)
    if moe:
        assert llm.moe is not None
        llm = replace(llm, moe=replace(llm.moe, num_experts=experts))
    monkeypatch.setitem(FLAVORS, "sync-count", replace(base, llm=llm))
    recipe = build_recipe(root, {"model.flavor": "sync-count", "train.dtype": "float32"})
    replica = build_replica(recipe, ParallelPlan.parse("dp1+omni"), CPU, torch.float32)
    optimizers = Optimizers(replica.parts, recipe)
    docs = MIXED_DOCS + VIDEO_DOCS
    for step in range(2):
        batches = [make_batch(docs, seed=10 * step + i) for i in range(micro)]  # built, on the CPU, before counting
        counters = {id(s["step"]) for opt in optimizers.optimizers for s in opt.state.values()}
        with count_host_syncs(ignore=lambda tensor, ids=counters: id(tensor) in ids) as counter:
            stats = train_step(replica, optimizers, batches, grad_clip=1.0)
    assert math.isfinite(stats.metrics["loss"])
    return counter


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_training_step_reads_the_host_a_fixed_number_of_times(tmp_path, monkeypatch, moe):
    """Issue #46: the count does not grow with micro-batches, layers or experts, and stays at the step's
    one read of its reduced metrics."""
    base = step_host_reads(tmp_path, monkeypatch, moe=moe, layers=2, experts=2, micro=1)
    grown = {
        "micro-batches": step_host_reads(tmp_path, monkeypatch, moe=moe, layers=2, experts=2, micro=3),
        "layers": step_host_reads(tmp_path, monkeypatch, moe=moe, layers=4, experts=2, micro=1),
    }
    if moe:
        grown["experts"] = step_host_reads(tmp_path, monkeypatch, moe=moe, layers=2, experts=4, micro=1)
    for what, counter in grown.items():
        assert counter.total == base.total, f"more {what}: {counter.summary()} against {base.summary()}"
    assert base.total <= 1, base.summary()

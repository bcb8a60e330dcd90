"""Host syncs on the step's path (issue #46 item 3): the counter itself, and a training step whose count does
not grow with micro-batches, layers or experts."""

from __future__ import annotations

import torch

from omni_core.runtime.sync_count import HOST_READS, count_host_syncs


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

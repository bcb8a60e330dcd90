"""The torch version gates (`common.torch_compat`): each takes torch's own function where this torch has it and
its named fallback where it does not (torch 2.11-2.12), and says so."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_core.common import torch_compat

GATES = [
    (torch_compat.all_gather_single, "all_gather_single", "all_gather_into_tensor"),
    (torch_compat.reduce_scatter_single, "reduce_scatter_single", "reduce_scatter_tensor"),
]


def _recorder(calls: list[str], name: str):
    def record(output, tensor, group=None, async_op=False):
        calls.append(name)

    return record


@pytest.mark.parametrize(("gate", "new", "old"), GATES)
def test_a_torch_without_the_new_collective_takes_its_older_name(monkeypatch, gate, new, old):
    calls: list[str] = []
    monkeypatch.delattr(dist, new, raising=False)
    monkeypatch.setattr(dist, old, _recorder(calls, old))
    gate(torch.empty(2), torch.empty(1))
    assert calls == [old]
    assert f"{new} -> {old}" in torch_compat.active_fallbacks()


@pytest.mark.parametrize(("gate", "new", "old"), GATES)
def test_a_torch_with_the_new_collective_takes_it(monkeypatch, gate, new, old):
    calls: list[str] = []
    monkeypatch.setattr(dist, new, _recorder(calls, new), raising=False)
    monkeypatch.setattr(dist, old, _recorder(calls, old))
    gate(torch.empty(2), torch.empty(1))
    assert calls == [new]
    assert not any(name.startswith(new) for name in torch_compat.active_fallbacks())


def test_the_pinned_torch_takes_no_fallback():
    """torch 2.13 (the CPU wheel these tests run on) has every API the gates look for."""
    if torch.__version__.split("+")[0] != "2.13.0":
        pytest.skip(f"torch {torch.__version__}: the expected fallbacks differ by version")
    assert torch_compat.active_fallbacks() == []

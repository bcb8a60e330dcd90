"""Batches on the compute device (`data.prefetch.DevicePrefetcher`, `PackedLoader(device=...)`): a pass-through
`.to(device)` on CPU, in order and without drawing ahead; a loader that draws ahead (as on CUDA) keeps the state
of the batches it handed out, so a checkpoint resumes at the next one; the CUDA copy where there is a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from omni_core.common.batch import PackedBatch
from omni_core.data import loader as loader_module
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.prefetch import DevicePrefetcher
from omni_core.data.synthetic import ensure_dataset
from tests.helpers.models import MIXED_DOCS, make_batch
from tests.helpers.recipes import build_recipe

CPU = torch.device("cpu")


class Counted:
    """An iterator of batches that counts how many were drawn from it."""

    def __init__(self, batches: list[PackedBatch]) -> None:
        self.batches, self.drawn = iter(batches), 0

    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
        batch = next(self.batches)
        self.drawn += 1
        return batch


def test_on_cpu_each_batch_passes_through_in_order_as_it_is_drawn():
    batches = [make_batch(MIXED_DOCS, seed=seed) for seed in range(3)]
    source = Counted(batches)
    prefetcher = DevicePrefetcher(source, CPU)
    assert source.drawn == 0  # nothing drawn ahead on CPU
    for index, batch in enumerate(batches):
        out = next(prefetcher)
        assert source.drawn == index + 1
        assert out.input_ids is batch.input_ids and out.image_patches is batch.image_patches  # no copy on CPU
        assert out.layout is batch.layout  # the host layout is carried, never read from the tensors again
    with pytest.raises(StopIteration):
        next(prefetcher)


class DrawingAhead(DevicePrefetcher):
    """The CUDA prefetcher's order on CPU: one batch drawn ahead of the one handed out."""

    def __init__(self, batches: Iterator[PackedBatch], device: torch.device) -> None:
        self.batches, self.device, self.stream = batches, device, None
        self.ahead = next(batches, None)

    def __next__(self) -> PackedBatch:
        batch = self.ahead
        if batch is None:
            raise StopIteration
        self.ahead = next(self.batches, None)
        return batch


def _loader(recipe, workers: int, device: torch.device | None) -> PackedLoader:
    data = recipe.data.model_copy(update={"num_workers": workers})
    return PackedLoader(open_dataset(recipe), data, "train", 0, 1, recipe.experiment.seed, device=device)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_drawing_ahead_saves_the_state_of_the_batches_it_handed_out(tmp_path, monkeypatch, workers):
    recipe = build_recipe(tmp_path, {"data.synthetic.num_samples": 60})
    ensure_dataset(recipe)
    plain = _loader(recipe, workers, None)
    plain_batches = iter(plain)
    expected = [next(plain_batches).input_ids for _ in range(5)]
    saved_plain = plain.state_dict()

    monkeypatch.setattr(loader_module, "DevicePrefetcher", DrawingAhead)
    ahead = _loader(recipe, workers, CPU)
    ahead_batches = iter(ahead)
    got = [next(ahead_batches).input_ids for _ in range(3)]
    saved = ahead.state_dict()
    resumed = _loader(recipe, workers, CPU)
    resumed.load_state_dict(saved)
    got += [batch.input_ids for batch, _ in zip(resumed, range(2), strict=False)]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert saved_plain["batches"] == 5 and saved["batches"] == 3


def test_a_cpu_loader_with_a_device_yields_the_host_loaders_batches(tmp_path):
    recipe = build_recipe(tmp_path, {"data.synthetic.num_samples": 60})
    ensure_dataset(recipe)
    host, on_device = iter(_loader(recipe, 0, None)), iter(_loader(recipe, 0, CPU))
    for _ in range(3):
        a, b = next(host), next(on_device)
        assert torch.equal(a.input_ids, b.input_ids) and a.layout == b.layout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy needs a GPU")
def test_on_cuda_batches_arrive_pinned_copied_and_in_order():
    device = torch.device("cuda")
    batches = [make_batch(MIXED_DOCS, seed=seed) for seed in range(4)]
    source = Counted(batches)
    prefetcher = DevicePrefetcher(source, device)
    assert source.drawn == 1  # one batch ahead
    for batch in batches:
        out = next(prefetcher)
        assert out.input_ids.device.type == "cuda" and out.layout is batch.layout
        # read on the step's stream, which waited for the side stream's copy
        torch.testing.assert_close(out.image_patches.sum(), batch.image_patches.sum().to(device))
        assert torch.equal(out.input_ids.cpu(), batch.input_ids)
    with pytest.raises(StopIteration):
        next(prefetcher)

"""Batches on the compute device before the step that uses them: `DevicePrefetcher` wraps an iterator of host
batches (`data.loader.PackedLoader` wraps its own, keeping its state at the batches it handed out).

On CUDA each batch is pinned (page-locked: the copy then runs without the host) unless the DataLoader's
workers pinned it already, and copied on a side stream while the step before it computes: the prefetcher
holds one batch ahead. On any other device it is a plain `.to(device)` of each batch as it is drawn.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

import torch

from omni_core.common.batch import PackedBatch


class DevicePrefetcher:
    def __init__(self, batches: Iterator[PackedBatch], device: torch.device) -> None:
        self.batches, self.device = batches, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead: PackedBatch | None = None  # the next batch, its copy issued on the side stream
        if self.stream is not None:
            self.ahead = self._copy_ahead()

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> PackedBatch:
        if self.stream is None:
            return next(self.batches).to(self.device)
        batch = self.ahead
        if batch is None:
            raise StopIteration
        step_stream = torch.cuda.current_stream(self.device)
        step_stream.wait_stream(self.stream)  # the step's kernels start once the copy is done
        for tensor in _tensors(batch):
            # made on the side stream, used on the step's: its memory is not reused before the step is done
            tensor.record_stream(step_stream)
        self.ahead = self._copy_ahead()
        return batch

    def _copy_ahead(self) -> PackedBatch | None:
        host = next(self.batches, None)
        if host is None:
            return None
        if not host.input_ids.is_pinned():
            host = host.pin_memory()
        with torch.cuda.stream(self.stream):
            return host.to(self.device)


def _tensors(batch: PackedBatch) -> list[torch.Tensor]:
    values = (getattr(batch, f.name) for f in fields(batch))
    return [value for value in values if isinstance(value, torch.Tensor) and value.numel()]

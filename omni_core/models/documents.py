"""The documents of a packed sequence as attention needs them: host offsets (which paths split and size by, never
read from a device), the documents that are padding alone, and their device copies, made once per forward."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

Offsets = Sequence[int] | torch.Tensor


@dataclass(eq=False)  # not frozen: dynamo (torch 2.11) guards on a frozen dataclass's fields, one graph per layout
class PackedDocuments:
    """The documents of a packed sequence as host integers, with what each path builds from them on a device.

    One is built per forward (`of`) and shared by every layer, so that device copies of the offsets (and of the
    index of the tokens that are not padding) are made once, asynchronously, never read back. Not changed once
    built (its cached properties assume so)."""

    offsets: tuple[int, ...]  # [D+1] from 0 to the tokens
    padding: frozenset[int] = frozenset()  # indices of the documents that are padding alone
    device_offsets: torch.Tensor | None = None  # the same offsets, int32, already on the compute device
    _on_device: dict = field(default_factory=dict, repr=False)  # (what, device) -> tensor, built once

    def __post_init__(self) -> None:
        offsets = self.offsets
        if not offsets or offsets[0] != 0 or any(b < a for a, b in itertools.pairwise(offsets)):
            raise ValueError(f"cu_seqlens must run from 0, non-decreasing, got {list(offsets)}")

    @classmethod
    def of(cls, cu_seqlens: Offsets | PackedDocuments, padding: Sequence[int] = ()) -> PackedDocuments:
        """From host offsets, or from a tensor of them: a device tensor is read once (a sync), kept as the
        device copy. Callers that hold the batch's layout pass its host offsets instead."""
        if isinstance(cu_seqlens, PackedDocuments):
            return cu_seqlens
        if isinstance(cu_seqlens, torch.Tensor):
            on_device = cu_seqlens if cu_seqlens.device.type != "cpu" else None
            return cls(tuple(cu_seqlens.tolist()), frozenset(padding), on_device)
        return cls(tuple(int(v) for v in cu_seqlens), frozenset(padding))

    @property
    def total(self) -> int:
        return self.offsets[-1]

    @functools.cached_property
    def runs(self) -> list[tuple[int, int, bool]]:
        """(start, end, is padding) of each non-empty document, consecutive padding documents merged (worked
        out once per layout: every layer asks)."""
        runs: list[tuple[int, int, bool]] = []
        for doc, (start, end) in enumerate(itertools.pairwise(self.offsets)):
            if end == start:
                continue
            padding = doc in self.padding
            if runs and padding and runs[-1][2]:
                runs[-1] = (runs[-1][0], end, True)
            else:
                runs.append((start, end, padding))
        return runs

    @functools.cached_property
    def attended(self) -> tuple[tuple[int, ...], int, list[tuple[int, int]] | None]:
        """(offsets, longest document) of the documents that are not padding, laid end to end, and the
        (start, end) token spans they come from (None when nothing is padding: the layout is the whole)."""
        if not self.padding:
            return self.offsets, max((b - a for a, b in itertools.pairwise(self.offsets)), default=0), None
        spans = [(start, end) for start, end, padding in self.runs if not padding]
        offsets = [0]
        for start, end in spans:
            offsets.append(offsets[-1] + end - start)
        return tuple(offsets), max((end - start for start, end in spans), default=0), spans

    def on_device(self, what: str, device: torch.device) -> torch.Tensor:
        """`cu_seqlens` (int32 offsets of the attended documents) or `index` (long positions of their tokens) on
        `device`, copied from pinned memory without waiting, once per layout and device."""
        key = (what, device)
        if key not in self._on_device:
            offsets, _, spans = self.attended
            if what == "cu_seqlens" and spans is None and self.device_offsets is not None:
                value = self.device_offsets.to(device, torch.int32)
            elif what == "cu_seqlens":
                value = host_to_device(torch.tensor(offsets, dtype=torch.int32), device)
            else:
                assert spans is not None, "an index is built only where documents are padding"
                value = host_to_device(
                    torch.cat([torch.arange(a, b) for a, b in spans] or [torch.zeros(0, dtype=torch.long)]), device
                )
            self._on_device[key] = value
        return self._on_device[key]


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: from pinned memory without blocking (a pageable copy would wait for the GPU)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def document_ids(documents: Offsets | PackedDocuments, device=None, padding: bool = False) -> torch.Tensor:
    """[T] index of the document each packed token belongs to; -1 for padding documents' tokens if `padding`.
    Built on the host from the host offsets, then copied without waiting."""
    docs = PackedDocuments.of(documents)
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(docs.offsets)])
    ids = torch.arange(len(lengths))
    if padding and docs.padding:
        ids[sorted(docs.padding)] = -1
    return host_to_device(torch.repeat_interleave(ids, lengths), torch.device(device or "cpu"))


def document_mask(documents: Offsets | PackedDocuments, causal: bool, device=None) -> torch.Tensor:
    """[T, T] bool, True where query i may attend key j: same document (and j <= i when causal)."""
    doc = document_ids(documents, device)
    mask = doc[:, None] == doc[None, :]
    return mask.tril() if causal else mask

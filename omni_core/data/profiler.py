"""The profile's streaming accumulator (`Profiler`): it takes measured samples, a chunk or a record at a time,
keeps exact token-length counts and per-window sums in bounded memory, packs them with the loader's packer, and
summarises them into a `DatasetProfile`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omni_core.data.balance import POLICIES, simulate
from omni_core.data.balance_groups import balance_group_size
from omni_core.data.flops import FORMULA, FlopModel
from omni_core.data.packing import BatchPacker
from omni_core.data.profile_drift import TokenWindow, drift_window
from omni_core.data.profile_result import (
    BalanceProfile,
    DatasetProfile,
    DriftWindow,
    MediaProfile,
    ModalityProfile,
    SequenceProfile,
)
from omni_core.data.sample import KIND_CODE, KINDS, SIZE_FIELDS
from omni_core.data.source_base import Record, Sizes
from omni_core.recipe.data_sections import DataConfig

HIST_BINS = 20
BALANCE_STEPS = 50  # steps the balancing policies are simulated over (fewer when the samples run out)
BALANCE_SAMPLES = 200_000  # the first samples the simulation reads (what the profile keeps for it)


MEDIA = ("image", "video", "audio")


def media_columns(sizes: Sizes) -> dict[str, tuple[np.ndarray, ...]]:
    """Per media kind, MediaProfile's fields per sample."""
    image_patches = sizes.vision_tokens - sizes.video_patches
    return {
        "image": (sizes.image_items, sizes.image_items, image_patches, sizes.image_llm),
        "video": (sizes.video_items, sizes.video_frames, sizes.video_patches, sizes.video_llm),
        "audio": (sizes.audio_items, sizes.audio_frames, sizes.audio_tokens, sizes.audio_tokens),
    }


class Counts:
    """Exact counts of non-negative integers: memory grows with the largest value, never with how many."""

    def __init__(self) -> None:
        self.counts = np.zeros(0, dtype=np.int64)

    def add(self, values: np.ndarray) -> None:
        added = np.bincount(values)
        if len(added) > len(self.counts):
            self.counts = np.concatenate([self.counts, np.zeros(len(added) - len(self.counts), dtype=np.int64)])
        self.counts[: len(added)] += added

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    def total(self) -> int:
        return int(np.dot(np.arange(len(self.counts)), self.counts))

    def min(self) -> int:
        return int(np.flatnonzero(self.counts)[0])

    def max(self) -> int:
        return int(np.flatnonzero(self.counts)[-1])

    def quantile(self, q: float) -> float:
        """numpy's default (linear) percentile of the values counted."""
        cumulative = np.cumsum(self.counts)
        h = (cumulative[-1] - 1) * q
        lo, hi = np.searchsorted(cumulative, [np.floor(h), np.ceil(h)], side="right")
        return float(lo + (h - np.floor(h)) * (hi - lo))

    def histogram(self) -> tuple[list[float], list[int]]:
        """HIST_BINS bins of whole-token width over [min, max], so no bin is empty by rounding."""
        lo, hi = self.min(), self.max()
        width = -(-(hi - lo + 1) // HIST_BINS)
        edges = np.arange(lo, hi + width + 1, width)
        values = np.arange(lo, hi + 1)
        counts = np.bincount((values - lo) // width, weights=self.counts[lo : hi + 1], minlength=len(edges) - 1)
        return edges.astype(float).tolist(), counts.astype(np.int64).tolist()


class Profiler:
    """Feeds on chunks of measured records (`add_chunk`) or on records one at a time (`add`); `result()`
    summarises. Statistics are taken a drift window at a time, over arrays, whichever way the samples came;
    at most one window of samples is buffered."""

    def __init__(self, cfg: DataConfig, flops: FlopModel) -> None:
        self.cfg, self.flops = cfg, flops
        self.window, self.threshold = cfg.profile_window, cfg.drift_threshold
        self.rows: list[tuple[int, ...]] = []  # records added one at a time, as rows of Sizes
        self.pending: list[Sizes] = []  # samples of the current window
        self.pending_count = 0
        self.lengths = {m: Counts() for m in KINDS}
        self.sums = {m: np.zeros(4) for m in KINDS}  # encoder tokens, encoder FLOPs, LLM FLOPs, samples
        self.media = {kind: np.zeros(4, dtype=np.int64) for kind in MEDIA}  # MediaProfile's fields
        self.reference: TokenWindow | None = None
        self.windows: list[DriftWindow] = []
        self.seen = 0
        self.packer: BatchPacker[int] = BatchPacker(cfg.micro_batch, cfg.seq_len, cfg.pack_lookahead, size=int)
        self.loads: list[int] = []  # real tokens of the sequences packed since the last window
        self.real, self.docs = Counts(), 0
        self.batches = 0
        self.costs: list[np.ndarray] = []  # per window, [n, 3]: tokens, encoder and LLM FLOPs of packable samples

    def add(self, record: Record, *, packable: bool) -> None:
        """Counts a sample; a packable one (it fits seq_len) also goes through the packer at once (a scheduled
        source draws its next sample at the batch count)."""
        self.rows.append((KIND_CODE[record.modality], *(getattr(record, name) for name in SIZE_FIELDS)))
        if len(self.rows) == self.window:
            self._take_rows()
        if packable:
            self._pack((record.tokens,))

    def add_chunk(self, sizes: Sizes, packable: np.ndarray) -> None:
        """Counts consecutive samples; those where `packable` go through the packer, in order."""
        self._add_sizes(sizes)
        self._pack(sizes.tokens[packable].tolist())

    def _take_rows(self) -> None:
        self._add_sizes(Sizes(*np.array(self.rows, dtype=np.int64).reshape(-1, len(Sizes._fields)).T))
        self.rows.clear()

    def _add_sizes(self, sizes: Sizes) -> None:
        """Buffers samples, summarising each window as it fills."""
        self.pending.append(sizes)
        self.pending_count += len(sizes.tokens)
        while self.pending_count >= self.window:
            joined = Sizes(*map(np.concatenate, zip(*self.pending))) if len(self.pending) > 1 else self.pending[0]
            rest = Sizes(*(c[self.window :] for c in joined))
            self.pending, self.pending_count = [rest], len(rest.tokens)
            self._flush(Sizes(*(c[: self.window] for c in joined)))

    def _pack(self, tokens: Sequence[int]) -> None:
        for sequences in self.packer.fill(tokens):
            self._sequences(sequences)

    def _sequences(self, sequences: list[list[int]]) -> None:
        self.batches += 1
        self.loads += map(sum, sequences)
        self.docs += sum(map(len, sequences))

    def _flush(self, sizes: Sizes) -> None:
        """One window's statistics."""
        modality, tokens = sizes.modality, sizes.tokens
        encoder = self.flops.encoder(
            sizes.vision_tokens, sizes.vision_sq, sizes.image_llm + sizes.video_llm, sizes.audio_frames, sizes.audio_sq
        )
        for kind, columns in media_columns(sizes).items():
            self.media[kind] += [int(c.sum()) for c in columns]
        llm = self.flops.llm(tokens)
        if self.seen < BALANCE_SAMPLES:
            packable = tokens <= self.cfg.seq_len
            self.costs.append(np.stack([tokens[packable], encoder[packable], llm[packable]], axis=1))
        encoder_tokens = sizes.vision_tokens + sizes.audio_tokens
        for code, m in enumerate(KINDS):
            mine = modality == code
            if mine.any():
                self.lengths[m].add(tokens[mine])
                self.sums[m] += [encoder_tokens[mine].sum(), encoder[mine].sum(), llm[mine].sum(), mine.sum()]
        self._window(TokenWindow(modality, tokens))
        self.seen += len(tokens)
        self.real.add(np.array(self.loads, dtype=np.int64))
        self.loads.clear()

    def _window(self, window: TokenWindow) -> None:
        if self.reference is None:
            self.reference = window
        if window.count < self.window // 2 and self.windows:
            return  # a short last window is all noise
        self.windows.append(drift_window(window, self.reference, self.seen, self.threshold))

    def balance(self, ranks: int, group: int, step_batches: int) -> dict[str, BalanceProfile]:
        """Each policy's imbalance over `ranks` data ranks in groups of `group`, from the first profiled samples
        in stream order."""
        if not self.costs:
            return {}
        columns = np.concatenate(self.costs)
        tokens, costs = columns[:, 0].astype(np.int64), columns[:, 1:]
        out = {}
        for policy in POLICIES:
            figures = simulate(
                tokens,
                costs,
                policy,
                ranks,
                balance_group_size(policy, group, ranks, ranks),
                self.cfg.micro_batch * step_batches,
                self.cfg.seq_len,
                self.cfg.pack_lookahead,
                BALANCE_STEPS,
            )
            if not np.isnan(figures["imbalance"]):
                out[policy] = BalanceProfile(**figures)
        return out

    def result(
        self,
        *,
        location: str,
        source: str,
        skipped: dict[str, int],
        decode_rates: dict[str, float],
        balance_ranks: int = 1,
        step_batches: int = 1,
    ) -> DatasetProfile:
        self._finish()
        total = self.seen
        if not total:
            raise ValueError(f"{location} holds no valid sample to profile (skipped: {skipped or 'none'})")
        modalities = self._modality_profiles(total)
        sequences = self._sequence_profile()
        group = self._balance_group(balance_ranks)
        return DatasetProfile(
            manifest=location,
            source=source,
            manifest_samples=total + sum(v for k, v in skipped.items() if k != "too_long"),
            total_samples=total,
            total_tokens=sum(p.tokens for p in modalities.values()),
            seq_len=self.cfg.seq_len,
            modalities=modalities,
            media=self._media_profiles(),
            skipped=skipped,
            packed_sequences=sequences.count,
            packing_efficiency=sequences.real_tokens_mean / sequences.capacity,
            sequences=sequences,
            encoder_flops=float(sum(self.sums[m][1] for m in KINDS)),
            llm_flops=float(sum(self.sums[m][2] for m in KINDS)),
            flops_formula=FORMULA,
            window=self.window,
            drift_threshold=self.threshold,
            drift_detected=any(w.drift for w in self.windows),
            windows=self.windows,
            decode_samples_per_s=decode_rates,
            balance_ranks=balance_ranks,
            balance_group=group,
            balance=self.balance(balance_ranks, group, step_batches),
        )

    def _finish(self) -> None:
        """Takes in what is still buffered: rows added one at a time, the last (short) window, and the
        packer's pool, packed into its last sequences."""
        if self.rows:
            self._take_rows()
        if self.pending_count:  # the last, short window
            self._flush(Sizes(*map(np.concatenate, zip(*self.pending))))
        while self.packer.items:
            self._sequences(self.packer.pack())
        self.real.add(np.array(self.loads, dtype=np.int64))

    def _modality_profiles(self, total: int) -> dict[str, ModalityProfile]:
        """Per modality present, its lengths and FLOPs; `total` is the samples profiled."""
        modalities = {}
        for m in KINDS:
            counts = self.lengths[m]
            if not counts.n:
                continue
            edges, hist = counts.histogram()
            enc_tokens, enc_flops, llm_flops, n = self.sums[m]
            modalities[m] = ModalityProfile(
                count=counts.n,
                share=counts.n / total,
                tokens=counts.total(),
                encoder_tokens_mean=enc_tokens / n,
                mean=counts.total() / counts.n,
                p50=counts.quantile(0.5),
                p90=counts.quantile(0.9),
                p99=counts.quantile(0.99),
                max=counts.max(),
                hist_edges=edges,
                hist_counts=hist,
                encoder_flops_mean=enc_flops / n,
                llm_flops_mean=llm_flops / n,
            )
        return modalities

    def _balance_group(self, ranks: int) -> int:
        """The group size `grouped` is simulated with over one node's `ranks` data ranks: data.balance.group_size,
        or the node's ranks where that does not divide them."""
        group = self.cfg.balance.group_size
        return group if group and ranks % group == 0 else ranks

    def _media_profiles(self) -> dict[str, MediaProfile]:
        names = list(MediaProfile.model_fields)
        return {kind: MediaProfile(**dict(zip(names, sums.tolist()))) for kind, sums in self.media.items() if sums[0]}

    def _sequence_profile(self) -> SequenceProfile:
        capacity, count = self.cfg.seq_len, self.real.n
        if not count:  # every sample was longer than seq_len
            return SequenceProfile(
                count=0,
                capacity=capacity,
                real_tokens_mean=0,
                real_tokens_p50=0,
                real_tokens_min=0,
                padding_mean=capacity,
                padding_p90=capacity,
                padding_max=capacity,
                documents_mean=0,
            )
        mean = self.real.total() / count
        return SequenceProfile(
            count=count,
            capacity=capacity,
            real_tokens_mean=mean,
            real_tokens_p50=self.real.quantile(0.5),
            real_tokens_min=self.real.min(),
            padding_mean=capacity - mean,
            padding_p90=capacity - self.real.quantile(0.1),
            padding_max=capacity - self.real.min(),
            documents_mean=self.docs / count,
        )

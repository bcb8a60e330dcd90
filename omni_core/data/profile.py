"""The profile stage: what is in the data, in one streaming pass with bounded memory, as a typed
`DatasetProfile` plus figures. The estimator and the balancer price work from these numbers.

Sizes come from metadata (nothing is decoded unless data.profile_decode asks for it). Memory does not grow
with the number of samples: token lengths are kept as exact counts per length (so quantiles are exact and
memory follows the longest sample), samples are buffered one drift window at a time, and packing is simulated
with the loader's own packer, whose pool is bounded. The stream is read in shard-name order (no shuffle), as
the data was written, so a schedule written into the data shows up as drift.

From metadata, JSONL and WebDataset sources are read as columns, CHUNK records at a time, and every statistic
is taken over arrays a window at a time: per record there is only parsing and the packer's bookkeeping. The
result is the same, to the bit, as feeding records one by one (which decoding and the scheduled source do).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from omni_core.common.results import Result
from omni_core.data.balance import POLICIES, balance_group_size, simulate
from omni_core.data.dataset import CorruptSample, ManifestDataset, open_dataset
from omni_core.data.flops import FORMULA, FlopModel
from omni_core.data.packing import BatchPacker
from omni_core.data.sample import KIND_CODE, KINDS, SIZE_FIELDS
from omni_core.data.source_base import Record, Sizes, View
from omni_core.data.sources import ShardedSource
from omni_core.data.synthetic import DynamicSource
from omni_core.recipe.data_sections import DataConfig
from omni_core.recipe.schema import Recipe

HIST_BINS = 20
KS_CRITICAL = 1.949  # c(alpha) of the two-sample Kolmogorov-Smirnov test at alpha = 0.001
MIN_KS_SAMPLES = 20  # per-modality KS only when both windows hold at least this many of the modality
BALANCE_STEPS = 50  # steps the balancing policies are simulated over (fewer when the samples run out)
BALANCE_SAMPLES = 200_000  # the first samples the simulation reads (what the profile keeps for it)


class ModalityProfile(Result):
    count: int
    share: float  # of profiled samples
    tokens: int  # LLM tokens, placeholders included
    encoder_tokens_mean: float  # image/frame patches and audio embeddings per sample: the encoders' share
    mean: float
    p50: float
    p90: float
    p99: float
    max: int
    hist_edges: list[float]
    hist_counts: list[int]
    encoder_flops_mean: float  # training FLOPs per sample (flops.FORMULA)
    llm_flops_mean: float


class MediaProfile(Result):
    """One kind of media over all profiled samples, whichever sample holds it (a sample's modality is only its
    first media's kind)."""

    items: int  # images, videos or clips
    frames: int  # video: sampled frames; audio: log-mel frames; an image is one
    encoder_tokens: int  # patches (of every frame) or audio embeddings
    llm_tokens: int  # their placeholders: a video's after the temporal and spatial merge


class SequenceProfile(Result):
    """Packed sequences of the profiled samples (held-out ones too: same distribution), as a loader on one
    rank packs them."""

    count: int
    capacity: int  # seq_len
    real_tokens_mean: float
    real_tokens_p50: float
    real_tokens_min: int
    padding_mean: float
    padding_p90: float
    padding_max: int
    documents_mean: float


class DriftWindow(Result):
    start: int  # index of its first sample in the profiled stream
    count: int
    shares: dict[str, float]
    tokens_mean: float
    ks: float  # Kolmogorov-Smirnov statistic of all token lengths against the first window
    ks_by_modality: dict[str, float]  # the same within each modality present in both windows
    mix_distance: float  # total-variation distance of the mix against the first window
    drift: bool


class BalanceProfile(Result):
    """The imbalance the data would have over the recipe's data ranks under one `data.balance` policy
    (`balance.simulate` on the profiled samples, medians over the simulated steps)."""

    imbalance: float  # max / mean of the ranks' predicted cost (encoders + LLM) per step
    fill: float  # share of sequence tokens filled
    metadata_bytes_per_rank: float  # per step


class DatasetProfile(Result):
    manifest: str  # the dataset's location
    source: str  # jsonl | wds | dynamic
    manifest_samples: int  # records met, skipped ones included
    total_samples: int  # samples profiled
    total_tokens: int
    seq_len: int
    modalities: dict[str, ModalityProfile]
    media: dict[str, MediaProfile] = {}  # image, video, audio: those the data holds (profiles before it: none)
    skipped: dict[str, int]  # reason (sources.SKIP_REASONS) -> count; too_long samples are profiled too
    packed_sequences: int
    packing_efficiency: float  # real tokens / (packed_sequences * seq_len)
    sequences: SequenceProfile
    encoder_flops: float  # all profiled samples, training
    llm_flops: float
    flops_formula: str
    window: int  # samples per drift window
    drift_threshold: float
    drift_detected: bool
    windows: list[DriftWindow]
    decode_samples_per_s: dict[str, float]  # per modality, when the profile decoded (data.profile_decode)
    balance_ranks: int = 1  # the data ranks `balance` was simulated over (one node's)
    balance_group: int = 1  # and the group size of `grouped` there
    balance: dict[str, BalanceProfile] = {}  # policy -> the imbalance under it


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


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic of two count arrays over the same integer values."""
    size = max(len(a), len(b))
    cdf_a = np.cumsum(np.pad(a, (0, size - len(a)))) / a.sum()
    cdf_b = np.cumsum(np.pad(b, (0, size - len(b)))) / b.sum()
    return float(np.abs(cdf_a - cdf_b).max())


def significant(n: int, m: int) -> float:
    """Smallest KS statistic significant at alpha = 0.001 for samples of n and m."""
    return KS_CRITICAL * float(np.sqrt((n + m) / (n * m)))


class _Window:
    """Per-modality token-length counts of one window."""

    def __init__(self, modality: np.ndarray, tokens: np.ndarray) -> None:
        self.count = len(tokens)
        self.pooled = np.bincount(tokens)
        self.by_modality = {
            m: np.bincount(tokens[modality == code]) for code, m in enumerate(KINDS) if (modality == code).any()
        }
        self.sizes = {m: int(c.sum()) for m, c in self.by_modality.items()}
        self.tokens_mean = float(tokens.mean())

    def shares(self) -> np.ndarray:
        return np.array([self.sizes.get(m, 0) / self.count for m in KINDS])


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
        self.reference: _Window | None = None
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
        self._window(_Window(modality, tokens))
        self.seen += len(tokens)
        self.real.add(np.array(self.loads, dtype=np.int64))
        self.loads.clear()

    def _window(self, window: _Window) -> None:
        if self.reference is None:
            self.reference = window
        if window.count < self.window // 2 and self.windows:
            return  # a short last window is all noise
        ref = self.reference
        ks = ks_statistic(window.pooled, ref.pooled)
        ks_by = {
            m: ks_statistic(c, ref.by_modality[m])
            for m, c in window.by_modality.items()
            if m in ref.by_modality and min(window.sizes[m], ref.sizes[m]) >= MIN_KS_SAMPLES
        }
        mix = 0.5 * float(np.abs(window.shares() - ref.shares()).sum())
        drift = (
            ks > max(self.threshold, significant(window.count, ref.count))
            or mix > max(self.threshold, significant(window.count, ref.count))
            or any(v > max(self.threshold, significant(window.sizes[m], ref.sizes[m])) for m, v in ks_by.items())
        )
        self.windows.append(
            DriftWindow(
                start=self.seen,
                count=window.count,
                shares={m: float(s) for m, s in zip(KINDS, window.shares()) if s},
                tokens_mean=window.tokens_mean,
                ks=ks,
                ks_by_modality=ks_by,
                mix_distance=mix,
                drift=drift,
            )
        )

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
        if self.rows:
            self._take_rows()
        if self.pending_count:  # the last, short window
            self._flush(Sizes(*map(np.concatenate, zip(*self.pending))))
        while self.packer.items:
            self._sequences(self.packer.pack())
        self.real.add(np.array(self.loads, dtype=np.int64))
        total = self.seen
        if not total:
            raise ValueError(f"{location} holds no valid sample to profile (skipped: {skipped or 'none'})")
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
        sequences = self._sequence_profile()
        group = self.cfg.balance.group_size  # a group that does not divide one node's data ranks: the node's
        group = group if group and balance_ranks % group == 0 else balance_ranks
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


def profile_source(
    dataset: ManifestDataset,
    cfg: DataConfig,
    seed: int,
    flops: FlopModel,
    limit: int | None = None,
    decode: bool = False,
    by_record: bool = False,
    balance_ranks: int = 1,
    step_batches: int = 1,
    at_step: int = 0,
    skip: int = 0,
) -> DatasetProfile:
    """One pass over (at most `limit` samples of) the dataset's stream. From metadata, a sharded source is
    read as columns, CHUNK records at a time; decoding, a scheduled source (which draws each sample at the
    training step the packer has reached, `step_batches` micro-batches a step, counted from `at_step`), or
    `by_record` (the reference the columns are tested against) go record by record. `skip` samples are
    passed over first (what a job already read: a watcher profiles the data a running job reads next)."""
    source = dataset.source
    dynamic = isinstance(source, DynamicSource)
    view = View(0, 1, "train" if dynamic else "all", seed, one_pass=True, shuffle=False)
    skipped: dict[str, int] = {}
    profiler = Profiler(cfg, flops)
    if isinstance(source, ShardedSource) and not (decode or by_record or skip):
        _profile_columns(source.measured(view), profiler, cfg.seq_len, skipped, limit)
        rates = {}
    else:
        rates = _profile_records(
            dataset, view, profiler, cfg.seq_len, skipped, limit, decode, at_step, skip, step_batches
        )
    kind = "dynamic" if dynamic else type(source).__name__.removesuffix("Source").lower()
    return profiler.result(
        location=dataset.location,
        source=kind,
        skipped=skipped,
        decode_rates=rates,
        balance_ranks=balance_ranks,
        step_batches=step_batches,
    )


def _profile_records(
    dataset: ManifestDataset,
    view: View,
    profiler: Profiler,
    seq_len: int,
    skipped: dict[str, int],
    limit: int | None,
    decode: bool,
    at_step: int = 0,
    skip: int = 0,
    step_batches: int = 1,
) -> dict[str, float]:
    """Record by record; returns the decode rates per modality."""

    def count(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    stream = dataset.source.stream(view, None, count)
    for _ in range(skip):
        if stream.next(at_step) is None:
            break
    skipped.clear()  # the skips of what a job already read are not the window's
    decode_s = {m: [0.0, 0] for m in KINDS}
    met = 0
    while limit is None or met < limit:
        record = stream.next(at_step + profiler.batches // step_batches)  # a scheduled source: the simulated step
        if record is None:
            break
        met += 1
        if decode:
            started = time.perf_counter()
            try:
                dataset.decode(record)
            except CorruptSample as err:
                count(err.reason)
                continue
            decode_s[record.modality][0] += time.perf_counter() - started
            decode_s[record.modality][1] += 1
        fits = record.tokens <= seq_len
        if not fits:
            count("too_long")
        profiler.add(record, packable=fits)
    return {m: n / s for m, (s, n) in decode_s.items() if n}


def _profile_columns(
    chunks: Iterator[tuple[Sizes, list[tuple[int, str]]]],
    profiler: Profiler,
    seq_len: int,
    skipped: dict[str, int],
    limit: int | None,
) -> None:
    """Chunk by chunk, counting what `_profile_records` would: the skips met before the limit-th record, and
    too_long records; `skipped` gets its reasons in the order they are first met, as record by record."""
    met = 0
    for sizes, skips in chunks:
        take = len(sizes.tokens) if limit is None else min(len(sizes.tokens), limit - met)
        if take < len(sizes.tokens):
            sizes = Sizes(*(c[:take] for c in sizes))
        reasons = [(reason, 1) for before, reason in skips if limit is None or met + before < limit]
        fits = sizes.tokens <= seq_len
        too_long = np.flatnonzero(~fits)
        if len(too_long):  # after the skips met before its first one
            reasons.insert(sum(before <= too_long[0] for before, _ in skips), ("too_long", len(too_long)))
        for reason, n in reasons:
            skipped[reason] = skipped.get(reason, 0) + n
        profiler.add_chunk(sizes, fits)
        met += take
        if limit is not None and met >= limit:
            return


def data_ranks(recipe: Recipe) -> int:
    """The recipe's data-parallel ranks on one node of `parallel.nproc` ranks (what the profile simulates the
    balancing policies over): its explicit dp, else what the other degrees leave."""
    par = recipe.parallel
    if par.dp_shard != -1:
        return par.dp_shard * par.dp_replicate
    return max(1, par.nproc // (par.tp * par.pp * par.cp * par.dp_replicate)) * par.dp_replicate


def profile_dataset(recipe: Recipe, out_dir: Path) -> tuple[DatasetProfile, list[Path]]:
    """Profiles the recipe's dataset (generated first if synthetic) into out_dir/profile.json and figures.

    At most data.profile_max_samples samples (in stream order) when set; a dynamic source is profiled over
    data.synthetic.num_samples samples unless capped lower."""
    cfg = recipe.data
    dataset = open_dataset(recipe)
    flops = FlopModel.for_flavor(recipe.model.flavor, patch_size=cfg.patch_size, n_mels=cfg.n_mels)
    profile = profile_source(
        dataset,
        cfg,
        recipe.experiment.seed,
        flops,
        cfg.profile_max_samples or None,
        decode=cfg.profile_decode,
        balance_ranks=data_ranks(recipe),
        step_batches=recipe.train.grad_accum,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile.save(out_dir / "profile.json")
    return profile, figures(profile, out_dir)


# --- figures ---------------------------------------------------------------------------------------------


def _save(fig: Figure, path: Path) -> Path:
    """Agg canvas on a bare Figure: no pyplot, so no global backend switch and no figure registry to leak."""
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def figures(profile: DatasetProfile, out_dir: Path) -> list[Path]:
    """Length histograms per modality, modality shares, mix over time, drift per window, sequence fill."""
    names = list(profile.modalities)
    lengths = Figure(figsize=(4 * len(names), 3))
    for ax, name in zip(lengths.subplots(1, len(names), squeeze=False)[0], names):
        mod = profile.modalities[name]
        ax.stairs(mod.hist_counts, mod.hist_edges, fill=True)
        ax.set(title=f"{name} (n={mod.count})", xlabel="tokens per sample", ylabel="samples")
        if max(mod.hist_counts) > 100 * min(c for c in mod.hist_counts if c):
            ax.set_yscale("log")  # a long tail (long documents) would not show on a linear scale

    shares = Figure(figsize=(4, 3))
    ax = shares.subplots()
    x = np.arange(len(names))
    ax.bar(x - 0.2, [profile.modalities[n].share for n in names], width=0.4, label="samples")
    ax.bar(x + 0.2, [profile.modalities[n].tokens / profile.total_tokens for n in names], width=0.4, label="tokens")
    ax.set(title="modality shares", ylabel="share", xticks=x, xticklabels=names)
    ax.legend()

    starts = [w.start for w in profile.windows]
    mix = Figure(figsize=(6, 3))
    ax = mix.subplots()
    ax.stackplot(starts, [[w.shares.get(n, 0.0) for w in profile.windows] for n in names], labels=names, step="post")
    ax.set(title=f"mix over time (windows of {profile.window})", xlabel="sample", ylabel="share", ylim=(0, 1))
    ax.legend(loc="upper right", fontsize="small")

    drift = Figure(figsize=(6, 3))
    ax = drift.subplots()
    ax.plot(starts, [w.ks for w in profile.windows], marker=".", label="KS, all lengths")
    ax.plot(
        starts,
        [max(w.ks_by_modality.values(), default=0.0) for w in profile.windows],
        marker=".",
        label="KS, worst modality",
    )
    ax.plot(starts, [w.mix_distance for w in profile.windows], marker=".", label="mix distance")
    ax.axhline(profile.drift_threshold, color="red", linestyle="--", label="threshold")
    for w in profile.windows:
        if w.drift:
            ax.axvspan(w.start, w.start + w.count, color="red", alpha=0.1)
    ax.set(title="drift against the first window", xlabel="sample", ylim=(0, 1))
    ax.legend(loc="upper left", fontsize="small")

    packing = Figure(figsize=(4, 3))
    ax = packing.subplots()
    seqs = profile.sequences
    ax.bar(["real", "padding"], [seqs.real_tokens_mean, seqs.padding_mean])
    ax.set(
        title=f"packing efficiency {profile.packing_efficiency:.3f} ({seqs.count} sequences)",
        ylabel=f"tokens per sequence (of {seqs.capacity})",
    )
    return [
        _save(lengths, out_dir / "token_lengths.png"),
        _save(shares, out_dir / "modality_shares.png"),
        _save(mix, out_dir / "mix_over_time.png"),
        _save(drift, out_dir / "drift.png"),
        _save(packing, out_dir / "packing.png"),
    ]

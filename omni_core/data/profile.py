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

The accumulator is `profiler.Profiler`; its result types are in `profile_result`, the drift statistics in
`profile_drift`, the figures in `profile_figures`. This module reads the dataset's stream into it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from omni_core.data.dataset import CorruptSample, ManifestDataset, open_dataset
from omni_core.data.dynamic_source import DynamicSource
from omni_core.data.flops import FlopModel
from omni_core.data.profile_result import DatasetProfile
from omni_core.data.profiler import Profiler
from omni_core.data.sample import KINDS
from omni_core.data.source_base import Sizes, View
from omni_core.data.sources import ShardedSource
from omni_core.recipe.data_sections import DataConfig
from omni_core.recipe.schema import Recipe


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


def profile_dataset(recipe: Recipe, out_dir: Path, draw: bool = True) -> tuple[DatasetProfile, list[Path]]:
    """Profiles the recipe's dataset (generated first if synthetic) into out_dir/profile.json and, with `draw`,
    figures. Without `draw` matplotlib is never imported: the GPU check and the estimator's validation need the
    numbers only, on machines that may lack it.

    At most data.profile_max_samples samples (in stream order) when set; a dynamic source is profiled over
    data.synthetic.num_samples samples unless capped lower."""
    cfg = recipe.data
    dataset = open_dataset(recipe)
    flops = FlopModel.for_recipe(recipe)
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
    if not draw:
        return profile, []
    from omni_core.data.profile_figures import figures

    return profile, figures(profile, out_dir)

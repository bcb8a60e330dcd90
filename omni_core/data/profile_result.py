"""What the profile stage hands on (`DatasetProfile`, saved as profile.json): per modality, per media kind,
the packed sequences, the drift windows and the imbalance under each balancing policy."""

from __future__ import annotations

from pydantic import Field

from omni_core.common.results import Result


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
    (`balance.simulate` on the profiled samples)."""

    imbalance: float  # the slowest rank's predicted cost (encoders + LLM) over the mean rank's, summed over steps
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
    media: dict[str, MediaProfile] = Field(
        default_factory=dict
    )  # image, video, audio: those the data holds (profiles before it: none)
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
    balance: dict[str, BalanceProfile] = Field(default_factory=dict)  # policy -> the imbalance under it

"""OmniModel flavors as workloads: the LLM over packed sequences of `seq_len` tokens and both encoders (ViT,
audio encoder, projectors), with what each sequence holds (documents, images, clips and their lengths) taken
from a `DatasetProfile` of the data it trains on."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from omni_core.estimator.transformer_layers import (
    ATTENTION_CALL_OPS,
    CLIP_OPS,
    CONV_OPS,
    llm_layers,
    projector,
    transformer_block,
    vit,
)
from omni_core.estimator.workloads import BYTES, EncoderItems, Layer, Workload, quadratic_share

if TYPE_CHECKING:
    from omni_core.data.profile_result import DatasetProfile, ModalityProfile
    from omni_core.models.args import OmniModelArgs


def _second_moment(hist_edges: list[float], hist_counts: list[int], mean: float) -> float:
    """E[L^2] of a length histogram (bin centres), rescaled so that its mean matches the exact mean."""
    total = sum(hist_counts)
    if not total:
        return mean**2
    centres = [(lo + hi) / 2 for lo, hi in itertools.pairwise(hist_edges)]
    m1 = sum(c * n for c, n in zip(centres, hist_counts)) / total
    m2 = sum(c * c * n for c, n in zip(centres, hist_counts)) / total
    return m2 * (mean / m1) ** 2 if m1 else mean**2


@dataclass(frozen=True)
class _SequenceMix:
    """What one packed sequence holds: `docs` documents (its padding one more) whose squared lengths sum to
    `sum_sq`, images and their patches, audio clips and their encoder tokens, and the profile's modalities."""

    docs: float
    sum_sq: float
    images: float = 0.0
    patches: float = 0.0
    clips: float = 0.0
    audio_tokens: float = 0.0
    modalities: Mapping[str, ModalityProfile] = field(default_factory=dict)


def _sequence_mix(profile: DatasetProfile | None, seq_len: int) -> _SequenceMix:
    """A packed sequence of the profiled mix and its padding; without a profile, one text document."""
    if profile is None or not profile.modalities:
        return _SequenceMix(1.0, float(seq_len) ** 2)
    mods = profile.modalities
    mean_len = sum(m.share * m.mean for m in mods.values())
    per_seq = profile.packing_efficiency * seq_len / mean_len  # samples per packed sequence
    pad = (1 - profile.packing_efficiency) * seq_len
    sum_sq = per_seq * sum(m.share * _second_moment(m.hist_edges, m.hist_counts, m.mean) for m in mods.values())
    images = per_seq * mods["image"].share if "image" in mods else 0.0
    clips = per_seq * mods["audio"].share if "audio" in mods else 0.0
    return _SequenceMix(
        docs=per_seq + (1 if pad >= 1 else 0),
        sum_sq=sum_sq + pad**2,
        images=images,
        patches=images * mods["image"].encoder_tokens_mean if "image" in mods else 0.0,
        clips=clips,
        audio_tokens=clips * mods["audio"].encoder_tokens_mean if "audio" in mods else 0.0,
        modalities=mods,
    )


def omni_workload(
    args: OmniModelArgs,
    *,
    seq_len: int,
    global_batch: int,
    profile: DatasetProfile | None = None,
    name: str = "omni",
    precision: str = "bf16",
) -> Workload:
    """An OmniModel flavor: sample = one packed sequence of `seq_len` tokens. With a profile, each sequence
    holds the profiled mix (documents per sequence, their squared lengths for attention, images and audio
    clips with their encoder tokens) and its padding; without one, it is one text document."""
    mix = _sequence_mix(profile, seq_len)
    b = BYTES[precision]
    frames = _mel_frames(mix.audio_tokens)
    # Both encoders always run (the runtime feeds a dummy input to one whose modality a batch lacks, so that
    # every rank issues the same collectives): their host costs and parameters count even without data.
    encoder = _with_dummy_calls([*_vision_encoder(args, mix, b), *_audio_encoder(args, mix, frames, b)], mix)
    items = mix.images + mix.clips  # encoder inputs per sequence: a count, so its spread is ~ 1 / sqrt(mean)
    max_item, described = _encoder_items(args, encoder, mix, frames)
    llm = args.llm
    return Workload(
        name,
        llm_layers(llm, seq_len, mix.sum_sq, mix.docs, b),
        global_batch,
        llm.shape(seq_len),
        encoder=tuple(encoder),
        precision=precision,
        tokens_per_sample=seq_len,
        encoder_cv=items**-0.5 if items else 0.0,
        encoder_max_item=max_item,
        items=described,
        head_dim=llm.dim // llm.n_heads,
        doc_span=mix.sum_sq / seq_len,
    )


def _item_lengths(profile: ModalityProfile) -> tuple[tuple[float, float], ...]:
    """The modality's samples by length (histogram bin centres, in mean samples) and share: an item's length
    relative to the mean, as `_encoder_items` takes the longest's (one item per sample of its modality)."""
    total, edges = sum(profile.hist_counts), profile.hist_edges
    bins = zip(edges, edges[1:], profile.hist_counts)
    return tuple(((lo + hi) / 2 / profile.mean, n / total) for lo, hi, n in bins if n)


def _vision_encoder(args: OmniModelArgs, mix: _SequenceMix, b: int) -> list[Layer]:
    """The ViT over the sequence's images (bidirectional attention per image) and the image projector."""
    v, llm = args.vision, args.llm
    side = (mix.patches / mix.images) ** 0.5 if mix.images else 0.0
    merge = getattr(args, "spatial_merge", 1) ** 2  # merge x merge patches concatenated per LLM token
    return [
        *vit(
            "vision",
            n_layers=v.n_layers,
            dim=v.dim,
            heads=v.n_heads,
            patches=mix.patches,
            sum_sq=mix.images * side**4,
            images=mix.images,
            patch_dim=v.patch_dim,
            mlp_ratio=v.mlp_ratio,
            dtype_bytes=b,
        ),
        projector("projector.image", v.dim * merge, args.projector_mult * llm.dim, llm.dim, mix.patches / merge, b),
    ]


def _mel_frames(audio_tokens: float) -> float:
    """The mel frames behind `audio_tokens` audio encoder tokens: the convs' subsampling, as the data path
    counts it (imported here: `common.batch` needs torch, which the estimator's modules do not)."""
    from omni_core.common.batch import audio_tokens as tokens_of

    return audio_tokens * 3000 / tokens_of(3000)


def _audio_encoder(args: OmniModelArgs, mix: _SequenceMix, frames: float, b: int) -> list[Layer]:
    """The audio encoder over the sequence's clips (`frames` mel frames): its conv subsampling, its blocks
    (bidirectional attention per clip) and the audio projector."""
    a, audio_tokens, clips = args.audio, mix.audio_tokens, mix.clips
    conv = Layer(
        "audio.conv",
        params=3 * a.dim * (a.n_mels + a.dim) + 4 * a.dim,
        flops=2 * 3 * a.dim * (a.n_mels * frames + a.dim * audio_tokens),
        mm_bytes=b * 3 * (frames * (a.n_mels + a.dim) + audio_tokens * 2 * a.dim),  # unfolded windows
        mm_weight_bytes=b * 3 * a.dim * (a.n_mels + a.dim),
        act_bytes=b * frames * (a.n_mels + a.dim),
        out_bytes=b * audio_tokens * a.dim,
        mem_bytes=4 * b * frames * a.dim,
        ops=CONV_OPS,
        sample_ops=CLIP_OPS * clips,
        tensors=6,
        units=1,
    )
    per_clip = audio_tokens / clips if clips else 0.0
    blocks = transformer_block(
        "audio.block",
        dim=a.dim,
        heads=a.n_heads,
        kv_heads=a.n_heads,
        ffn=int(a.dim * a.mlp_ratio),
        tokens=audio_tokens,
        sum_sq=clips * per_clip**2,
        docs=clips,
        causal=False,
        gated=False,
        bias=True,
        dtype_bytes=b,
    )
    return [
        conv,
        *([blocks] * a.n_layers),
        projector("projector.audio", *_audio_projector(args), audio_tokens / a.pool, b),
    ]


def _audio_projector(args: OmniModelArgs) -> tuple[int, int, int]:
    """(in, hidden, out) of the audio projector, which runs on the encoder's pooled tokens (`AudioArgs.pool`)."""
    from omni_core.models.flops import projector_dims  # imports torch (common.batch), as `_mel_frames` does

    return projector_dims(args)["audio"]


def _with_dummy_calls(encoder: list[Layer], mix: _SequenceMix) -> list[Layer]:
    """The encoders with the attention call of their dummy input added to each block of an encoder without
    data (it runs its one-window dummy through every block)."""
    dummy_calls = {"vision.block": not mix.images, "audio.block": not mix.clips}
    return [
        replace(layer, ops=layer.ops + ATTENTION_CALL_OPS) if dummy_calls.get(layer.name) else layer
        for layer in encoder
    ]


def _encoder_items(
    args: OmniModelArgs, encoder: list[Layer], mix: _SequenceMix, frames: float
) -> tuple[float, EncoderItems]:
    """The longest item's encoder work in mean samples' (r times the mean length: linear work x r, attention's
    x r^2), and the items as the `omni` layout balances them; nothing without items."""
    items = mix.images + mix.clips
    if not items:
        return 0.0, EncoderItems()
    v, a = args.vision, args.audio
    quad = quadratic_share(encoder)
    r, modality = max(
        (m.max / m.mean, key) for key, m in mix.modalities.items() if key in ("image", "audio") and m.mean
    )
    # an image's length is its patches, a clip's its mel frames (the threshold's tokens)
    count, tokens, heads = (
        (mix.images, mix.patches / mix.images, v.n_heads)
        if modality == "image"
        else (mix.clips, frames / mix.clips, a.n_heads)
    )
    described = EncoderItems(
        "vision" if modality == "image" else "audio",
        count,
        tokens,
        heads,
        quad,
        1 / items,
        4.0 * (mix.patches * v.patch_dim + frames * a.n_mels),
        _item_lengths(mix.modalities[modality]),
    )
    return ((1 - quad) * r + quad * r * r) / items, described

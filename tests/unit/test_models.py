"""Model v0: shapes, isolation of documents/images/clips, causality, encoder anchoring, init, varlen attention."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from omni_core.common.batch import PackedBatch
from omni_core.common.tokenizer import AUDIO_ID, VOCAB_SIZE
from omni_core.models.args import VisionArgs
from omni_core.models.attention import (
    block_mask_attention,
    flex_document_attention,
    masked_matmul_attention,
    varlen_attention,
)
from omni_core.models.flavors import FLAVORS, get_flavor
from omni_core.models.omni import OmniModel, build_model
from omni_core.models.llm import LLM
from omni_core.models.projector import spatial_merge
from omni_core.models.vision import VisionEncoder
from tests.helpers.models import MIXED_DOCS, N_MELS, PATCH_DIM, PATCH_SIZE, make_batch


@pytest.fixture
def model() -> OmniModel:
    return build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)


def test_output_shapes(model: OmniModel) -> None:
    batch = make_batch(MIXED_DOCS)
    assert model(batch).shape == (batch.input_ids.shape[0], VOCAB_SIZE)
    assert model.vision(batch.image_patches, batch.image_grids).shape == (12, 64)
    assert model.audio(batch.audio_mels, batch.audio_frames).shape == (16 // 2 + 8 // 2, 64)


def test_debug_flavor_size_and_registry() -> None:
    args = get_flavor("debug", patch_size=4, n_mels=40)
    assert args.vision.patch_dim == 48 and args.audio.n_mels == 40
    assert FLAVORS["debug"].vision.patch_dim == PATCH_DIM  # the registry entry itself is untouched
    assert 1_000_000 <= OmniModel(args).num_params() <= 2_000_000
    with pytest.raises(ValueError, match="known flavors: debug"):
        get_flavor("nope", patch_size=PATCH_SIZE, n_mels=N_MELS)


def assert_isolated(model: OmniModel, batch: PackedBatch, perturb, doc_tokens: slice) -> None:
    """After `perturb(batch)`, the logits of `doc_tokens` changed and every other token's are bit-identical."""
    with torch.no_grad():
        before = model(batch)
        perturb(batch)
        after = model(batch)
    others = torch.ones(before.shape[0], dtype=torch.bool)
    others[doc_tokens] = False
    assert torch.equal(after[others], before[others])
    assert not torch.allclose(after[doc_tokens], before[doc_tokens])


def shift_tokens(tokens: slice):
    def perturb(batch: PackedBatch) -> None:
        batch.input_ids[tokens] = (batch.input_ids[tokens] + 1) % 256

    return perturb


def test_documents_are_isolated(model: OmniModel) -> None:
    # Both directions: causal attention alone already hides a later document from an earlier one.
    docs = [[("text", 12)], [("text", 9)]]
    assert_isolated(model, make_batch(docs), shift_tokens(slice(0, 12)), slice(0, 12))
    assert_isolated(model, make_batch(docs), shift_tokens(slice(12, 21)), slice(12, 21))


@torch.no_grad()
def test_attention_is_causal_within_a_document(model: OmniModel) -> None:
    batch = make_batch([[("text", 16)]])
    before = model(batch)
    batch.input_ids[10] = (batch.input_ids[10] + 1) % 256
    after = model(batch)
    assert torch.equal(after[:10], before[:10])
    assert not torch.allclose(after[10:], before[10:])


@torch.no_grad()
def test_rope_uses_the_batch_position_ids(model: OmniModel) -> None:
    batch = make_batch([[("text", 10)]])
    logits = model(batch)
    batch.position_ids += 100  # RoPE sees only distances: a constant shift changes nothing
    torch.testing.assert_close(model(batch), logits, rtol=0, atol=1e-5)
    batch.position_ids *= 2  # doubled distances must change the output
    assert not torch.allclose(model(batch), logits, atol=1e-3)


def test_images_are_isolated(model: OmniModel) -> None:
    # doc 1: 3 text + image 1 (4 patches) + 3 text; doc 2: image 2 (6 patches) + 4 text.
    docs = [[("text", 3), ("image", (2, 2)), ("text", 3)], [("image", (2, 3)), ("text", 4)]]

    def brighten(patches: slice):
        def perturb(batch: PackedBatch) -> None:
            batch.image_patches[patches] += 1.0

        return perturb

    assert_isolated(model, make_batch(docs), brighten(slice(0, 4)), slice(0, 10))
    assert_isolated(model, make_batch(docs), brighten(slice(4, 10)), slice(10, 20))


def test_audio_clips_are_isolated(model: OmniModel) -> None:
    # doc 1: 3 text + clip 1 (12 frames -> 6 tokens) + 3 text; doc 2: clip 2 (8 frames -> 4 tokens) + 4 text.
    docs = [[("text", 3), ("audio", 12), ("text", 3)], [("audio", 8), ("text", 4)]]

    def louder(frames: slice):
        def perturb(batch: PackedBatch) -> None:
            batch.audio_mels[frames] += 1.0

        return perturb

    assert_isolated(model, make_batch(docs), louder(slice(0, 12)), slice(0, 12))
    assert_isolated(model, make_batch(docs), louder(slice(12, 20)), slice(12, 20))


def test_placeholder_count_mismatch_names_both_counts(model: OmniModel) -> None:
    batch = make_batch([[("text", 4), ("image", (2, 2))]])
    batch.input_ids[-1] = 0  # 3 image placeholders left for 4 image embeddings
    with pytest.raises(ValueError, match="3 image placeholder tokens .* produced 4 embeddings"):
        model(replace(batch, layout=None))  # the layout read again from the edited tensors
    text_only = make_batch([[("text", 6)]])
    text_only.input_ids[2:4] = AUDIO_ID  # audio placeholders, but no clip in the batch
    with pytest.raises(ValueError, match="2 audio placeholder tokens .* produced 0 embeddings"):
        model(replace(text_only, layout=None))


def test_audio_frames_must_subsample_to_audio_tokens(model: OmniModel) -> None:
    with pytest.raises(ValueError, match="multiple of 2"):
        model.audio(torch.randn(9, N_MELS), torch.tensor([9]))


def test_text_only_batch_runs_encoders_on_dummies_with_zero_gradients(model: OmniModel) -> None:
    batch = make_batch([[("text", 8)], [("text", 5)]])
    logits = model(batch)
    assert logits.shape == (13, VOCAB_SIZE) and torch.isfinite(logits).all()
    logits.sum().backward()
    encoders = [*model.vision.parameters(), *model.audio.parameters(), *model.projectors.parameters()]
    assert all(p.grad is not None and not p.grad.any() for p in encoders)
    assert all(p.grad is not None for p in model.llm.parameters())


def test_gradients_reach_encoders_and_projectors(model: OmniModel) -> None:
    batch = make_batch(MIXED_DOCS)
    logits = model(batch)
    torch.nn.functional.cross_entropy(logits, batch.labels, ignore_index=-100).backward()
    for prefix in ("vision.", "audio.", "projectors.image.", "projectors.audio."):
        params = [(name, p) for name, p in model.named_parameters() if name.startswith(prefix)]
        assert params
        for name, p in params:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_init_is_deterministic_per_seed() -> None:
    first = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=7).state_dict()
    again = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=7).state_dict()
    other = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=8).state_dict()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["llm.output.weight"], other["llm.output.weight"])
    assert torch.equal(first["llm.norm.weight"], torch.ones(128))


def test_meta_device_build_then_init_matches_build_model() -> None:
    with torch.device("meta"):
        model = OmniModel(get_flavor("debug", patch_size=PATCH_SIZE, n_mels=N_MELS))
    model.to_empty(device="cpu")
    model.init_weights(3)
    reference = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=3).state_dict()
    assert all(torch.equal(tensor, reference[name]) for name, tensor in model.state_dict().items())


def dense_reference(q, k, v, cu_seqlens, causal):
    """Plain softmax attention under an explicit block-diagonal (and causal) mask."""
    total, heads, head_dim = q.shape
    doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), torch.diff(cu_seqlens))
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool).tril()
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attention_matches_dense_masked_reference(causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 5, 12, 13, 20], dtype=torch.int32)  # includes an empty document
    q = torch.randn(20, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(20, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(20, 2, 8, generator=gen, dtype=torch.float64)
    out = varlen_attention(q, k, v, cu_seqlens, causal=causal)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu_seqlens, causal), rtol=0, atol=1e-6)
    # The implementations we benchmark (flex_attention: forward only, it has no backward on CPU).
    for alternative in (block_mask_attention, masked_matmul_attention, flex_document_attention):
        torch.testing.assert_close(alternative(q, k, v, cu_seqlens, causal), out, rtol=0, atol=1e-6)
    assert torch.equal(varlen_attention(q, k, v, cu_seqlens.tolist(), causal=causal), out)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q, k, v, torch.tensor([0, 5, 19]), causal=causal)


@torch.no_grad()
def test_flex_attention_llm_matches_sdpa() -> None:
    args = get_flavor("debug", patch_size=PATCH_SIZE, n_mels=N_MELS).llm
    sdpa, flex = LLM(args), LLM(replace(args, attention="flex"))
    flex.load_state_dict(sdpa.state_dict())
    ids, positions = torch.randint(0, 256, (40,)), torch.cat([torch.arange(25), torch.arange(15)])
    cu_seqlens = torch.tensor([0, 25, 40], dtype=torch.int32)
    expected = sdpa(sdpa.embed(ids), positions, cu_seqlens)
    torch.testing.assert_close(flex(flex.embed(ids), positions, cu_seqlens), expected, rtol=0, atol=1e-5)


def test_spatial_merge_concatenates_windows_and_pads_edges() -> None:
    features = torch.arange(3 * 4 * 2, dtype=torch.float32).view(12, 2)  # one 3 x 4 grid, dim 2
    merged = spatial_merge(features, torch.tensor([[3, 4]]), 2)
    assert merged.shape == (2 * 2, 4 * 2)  # ceil(3/2) x ceil(4/2) tokens of 2 x 2 x dim
    grid = features.view(3, 4, 2)
    torch.testing.assert_close(merged[1], torch.cat([grid[0, 2], grid[0, 3], grid[1, 2], grid[1, 3]]))
    torch.testing.assert_close(merged[2], torch.cat([grid[2, 0], grid[2, 1], torch.zeros(4)]))  # padded row


@torch.no_grad()
def test_absolute_positions_resample_to_any_grid() -> None:
    vit = VisionEncoder(VisionArgs(patch_dim=PATCH_DIM, pos_embed="absolute", max_grid=4))
    assert torch.equal(vit.positions(4, 4), vit.pos_embed.weight)  # native grid: the table itself
    assert vit.positions(3, 7).shape == (21, 64)  # other grids, larger ones too, are interpolated
    grids = torch.tensor([[2, 3], [6, 5]])
    assert vit(torch.randn(36, PATCH_DIM), grids).shape == (36, 64)


@torch.no_grad()
def test_video_frames_go_through_the_vit_then_merge_in_time(model: OmniModel) -> None:
    frames = [torch.randn(6, PATCH_DIM) for _ in range(3)]  # 3 frames of 2 x 3 patches; temporal_merge = 2
    grid = torch.tensor([[2, 3]])
    per_frame = [model.vision(frame, grid) for frame in frames]
    video = model.vision.forward_video(torch.cat(frames), torch.tensor([[3, 2, 3]]), temporal_merge=2)
    torch.testing.assert_close(video, torch.cat([(per_frame[0] + per_frame[1]) / 2, per_frame[2]]))
    embeds = model.encode_video(torch.cat(frames), torch.tensor([[3, 2, 3]]))
    torch.testing.assert_close(embeds, model.projectors["image"](video))

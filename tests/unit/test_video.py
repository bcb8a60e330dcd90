"""Video as a modality of its own: a clip's sampled frames go to `video_patches` / `video_grids`, its merged
embeddings to VIDEO_ID placeholders (`batch.video_tokens`), the profiler counts it next to images and audio."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from omni_core.common.batch import MODALITY_IDS, video_tokens
from omni_core.common.tokenizer import BOS_ID, EOS_ID, IMAGE_ID, VIDEO_ID
from omni_core.data.dataset import ManifestDataset, open_dataset
from omni_core.data.dataset_location import MANIFEST
from omni_core.data.image import frame_indices, patchify
from omni_core.data.loader import PackedLoader
from omni_core.data.profile import profile_dataset
from omni_core.data.profile_result import DatasetProfile
from omni_core.data.sample import SPATIAL_MERGE, TEMPORAL_MERGE
from omni_core.models.omni import build_model
from omni_core.recipe.data_sections import DataConfig
from tests.helpers.data_sources import records
from tests.helpers.models import MIXED_DOCS, N_MELS, PATCH_SIZE, VIDEO_DOCS, make_batch
from tests.helpers.recipes import build_recipe


def clip_manifest(folder: Path, frames: int) -> list[Image.Image]:
    """A JSONL manifest of one 24 x 16 px GIF of `frames` frames (2 x 3 patches of 8 px) and its caption."""
    images = [Image.new("RGB", (24, 16), (k * 30, 255 - k * 30, 0)) for k in range(frames)]
    out = io.BytesIO()
    images[0].save(out, "GIF", save_all=True, append_images=images[1:], duration=1000)
    (folder / "clip.gif").write_bytes(out.getvalue())
    record = {"id": "v", "segments": [{"type": "video", "path": "clip.gif", "width": 24, "height": 16,
                                       "num_frames": frames}, {"type": "text", "text": "ok."}]}
    (folder / MANIFEST).write_text(json.dumps(record) + "\n")
    return images


def test_a_video_packs_to_its_merged_placeholders_and_its_sampled_frames(tmp_path):
    images = clip_manifest(tmp_path, 7)
    cfg = DataConfig(source="jsonl", path=str(tmp_path), video_max_frames=5, seq_len=32)  # one clip a batch
    dataset = ManifestDataset(tmp_path, cfg)
    (record,) = records(dataset)
    assert (TEMPORAL_MERGE, SPATIAL_MERGE) == (2, 1)  # the debug flavors'
    tokens = 3 * 2 * 3  # 5 sampled frames -> 3 merged (the last alone), each 2 x 3
    assert (record.video_items, record.video_frames, record.video_patches, record.video_llm) == (1, 5, 30, tokens)
    assert record.tokens == 2 + tokens + 3 and record.vision_tokens == 30 and record.image_items == 0

    batch = next(iter(PackedLoader(dataset, cfg, "train", seed=0)))
    assert batch.input_ids[: tokens + 5].tolist() == [BOS_ID, *[VIDEO_ID] * tokens, *b"ok.", EOS_ID]
    assert batch.video_grids.tolist() == [[5, 2, 3]] and batch.image_grids.shape == (0, 2)
    sampled = [patchify(images[k].convert("RGB"), PATCH_SIZE, cfg.video_frame_patches)[0]
               for k in frame_indices(7, 5)]
    torch.testing.assert_close(batch.video_patches, torch.cat(sampled), atol=0.02, rtol=0)  # GIF's palette
    assert (batch.loss_modality[: tokens + 5] == MODALITY_IDS["video"]).all() and IMAGE_ID not in batch.input_ids
    assert (batch.labels[: tokens] == -100).all() and batch.labels[tokens] == ord("o")


@pytest.mark.parametrize("source", ["synthetic", "dynamic"])
def test_synthetic_clips_over_the_frame_budget_embed_on_the_debug_flavor(tmp_path, source):
    """Clips longer than video_max_frames: the written and the on-the-fly source both sample the frames the
    token rule counts, and the model anchors exactly as many embeddings."""
    recipe = build_recipe(tmp_path, {
        "experiment.name": "v", "experiment.seed": 3, "data.source": source, "data.seq_len": 256,
        "data.video_max_frames": 5, "data.synthetic": {
            "num_samples": 24, "mix": {"video": 0.5, "image": 0.5}, "video_frames": {"min": 4, "max": 9}}})
    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    loader = PackedLoader(open_dataset(recipe), recipe.data, "train", seed=0)
    for _, batch in zip(range(3), loader):
        grids = batch.video_grids.tolist()
        assert grids and all(1 <= f <= 5 for f, _, _ in grids)
        assert len(batch.video_patches) == sum(f * r * c for f, r, c in grids)
        assert int((batch.input_ids == VIDEO_ID).sum()) == sum(video_tokens(*g, 2, 1) for g in grids)
        with torch.no_grad():
            embeds = model.embed(batch)
            expected = model.encode_video(batch.video_patches, batch.video_grids)
        assert torch.equal(embeds[batch.input_ids == VIDEO_ID], expected)


@torch.no_grad()
def test_embed_anchors_encode_video_rows_at_the_video_placeholders():
    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    batch = make_batch(VIDEO_DOCS + MIXED_DOCS)
    embeds = model.embed(batch)
    videos = model.encode_video(batch.video_patches, batch.video_grids)
    assert videos.shape[0] == 2 * 2 * 3 + 1 * 3 * 2  # (3, 2, 3) -> 2 merged frames; (2, 3, 2) -> 1
    assert torch.equal(embeds[batch.input_ids == VIDEO_ID], videos)
    assert torch.equal(embeds[batch.input_ids < 256], model.llm.embed(batch.input_ids[batch.input_ids < 256]))
    batch.input_ids[batch.input_ids == VIDEO_ID] = 0
    with pytest.raises(ValueError, match="0 video placeholder tokens .* produced 18 embeddings"):
        model.embed(replace(batch, layout=None))  # the layout read again from the edited tensors


def test_gradients_reach_the_vision_encoder_from_video_alone():
    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    batch = make_batch(VIDEO_DOCS)
    logits = model(batch)
    torch.nn.functional.cross_entropy(logits, batch.labels, ignore_index=-100).backward()
    for prefix in ("vision.layers.", "projectors.image."):
        assert all(p.grad.abs().sum() > 0 for name, p in model.named_parameters() if name.startswith(prefix))
    assert model.train_flops(batch) > model.train_flops(make_batch([[("text", 7)], [("text", 5)]]))


def test_the_profile_counts_videos_next_to_images_and_audio(tmp_path):
    recipe = build_recipe(tmp_path, {
        "experiment.name": "p", "experiment.seed": 4, "data.seq_len": 512, "data.video_max_frames": 6,
        "data.synthetic": {"num_samples": 40, "mix": {"text": 0.2, "image": 0.3, "audio": 0.2, "video": 0.3},
                           "video_frames": {"min": 4, "max": 9}}})
    profile, _ = profile_dataset(recipe, tmp_path / "profile")
    samples = [json.loads(line) for line in (Path(recipe.data_dir()) / MANIFEST).read_text().splitlines()]
    clips = [s["segments"][0] for s in samples if s["modality"] == "video"]
    grids = [(min(c["num_frames"], 6), -(-c["height"] // 8), -(-c["width"] // 8)) for c in clips]  # <= 16 patches
    video = profile.media["video"]
    assert (video.items, video.frames) == (len(clips), sum(f for f, _, _ in grids))
    assert video.encoder_tokens == sum(f * r * c for f, r, c in grids)
    assert video.llm_tokens == sum(video_tokens(*g, 2, 1) for g in grids) < video.encoder_tokens
    assert profile.modalities["video"].tokens == video.llm_tokens + sum(len(s["segments"][1]["text"]) + 2
                                                                       for s in samples if s["modality"] == "video")
    counts = {kind: sum(s["modality"] == kind for s in samples) for kind in ("image", "audio")}
    assert {kind: profile.media[kind].items for kind in counts} == counts
    assert profile.media["image"].llm_tokens == profile.media["image"].encoder_tokens  # a placeholder per patch
    assert DatasetProfile.from_json(profile.to_json()) == profile
    older = json.loads(profile.to_json())
    del older["media"]  # a profile written before media were counted still loads
    assert DatasetProfile.model_validate(older).media == {}


def test_evaluation_splits_a_batch_into_documents_with_their_own_videos():
    from omni_core.common.tokenizer import BYTE_TOKENIZER
    from omni_core.runtime.generate import answer_documents, documents

    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    batch = make_batch(MIXED_DOCS[:1] + VIDEO_DOCS)
    docs = list(
        documents(batch, BYTE_TOKENIZER, lambda rows, cols: rows * cols, lambda *grid: video_tokens(*grid, 2, 1))
    )
    assert [d.video_grids.tolist() for d in docs] == [[], [[3, 2, 3]], [[2, 3, 2]]]
    assert torch.equal(torch.cat([d.video_patches for d in docs]), batch.video_patches)
    assert len(answer_documents(model, docs[2:], BYTE_TOKENIZER, 2, 1000, 1)) == 1  # prompted to its last VIDEO_ID
    prompt = int((docs[2].input_ids == VIDEO_ID).nonzero()[-1]) + 1
    decoded, _ = answer_documents(model, docs[2:], BYTE_TOKENIZER, 8, prompt, 1)[0]
    assert decoded == ""  # never past training's seq_len

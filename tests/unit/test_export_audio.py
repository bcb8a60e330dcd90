"""`hf_export_audio`: an omni audio + LLM model built from tiny pretrained parts with Qwen2-Audio's pool and
projector (`model.audio_pool: 2`, `model.audio_projector: linear`), exported as a Qwen2-Audio directory, loads in
transformers (`Qwen2AudioForConditionalGeneration`, `Qwen2AudioProcessor`) and gives omni's logits for a
conversation with a clip that fills the extractor's chunk, inputs made by the exported processor; what
Qwen2-Audio cannot express is refused by name; the token rule agrees between the data, the model and the
processor."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from flows.cli import main
from omni_core.common.batch import MODALITY_IDS, PackedBatch, audio_tokens
from omni_core.common.tokenizer import HFTokenizer
from omni_core.data.sample import KIND_CODE, Segments, measure
from omni_core.data.tower_processors import TowerInputs, WhisperFeatures
from omni_core.models import hf_import
from omni_core.models.hf_export import ExportRefused
from omni_core.models.hf_export_audio import export_qwen2_audio
from omni_core.models.omni import OmniModel
from omni_core.models.pretrained import omni_args
from omni_core.recipe import load_recipe
from tests.helpers.hf_parts import write_audio, write_llm
from tests.helpers.models import N_MELS, PATCH_SIZE
from tests.unit.test_export import ALIGN, align_overrides, train_and_export

RATE = 16000
CHUNK_S = 1  # the test extractor's chunk: 100 feature frames, the encoder's 50 positions, 25 LLM tokens


def parts(root: Path, kind: str = "qwen2", tied: bool = False) -> tuple[Path, Path]:
    return write_llm(root / "llm", kind=kind, tied=tied), write_audio(root / "audio", chunk_length=CHUNK_S)


def qwen2_audio_ready(llm: Path, audio: Path, **changes: object) -> OmniModel:
    """The model a recipe with these pretrained parts and Qwen2-Audio's pool and projector builds, filled from
    the files (the projectors: torch's default init, biases nonzero)."""
    vocab = HFTokenizer.from_pretrained(llm).vocab_size
    args, found = omni_args(
        "debug", {"llm": str(llm), "audio": str(audio)}, patch_size=PATCH_SIZE, n_mels=N_MELS, vocab_size=vocab
    )
    args = replace(args, audio=replace(args.audio, pool=2), audio_projector="linear")
    model = OmniModel(replace(args, **changes))
    for part, where in found.items():
        hf_import.load_safetensors(getattr(model, part), where.directory, where.layout, where.prefix)
    return model.eval()


def audio_batch(ids: torch.Tensor, mels: torch.Tensor, tokenizer: HFTokenizer) -> PackedBatch:
    """One conversation with one clip of `mels` [frames, n_mels], as the loader packs it."""
    n = ids.numel()
    return PackedBatch(
        input_ids=ids,
        labels=torch.full_like(ids, -100),
        position_ids=torch.arange(n),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
        loss_modality=torch.full_like(ids, MODALITY_IDS["text"]),
        image_patches=torch.zeros(0, 3 * PATCH_SIZE * PATCH_SIZE),
        image_grids=torch.zeros(0, 2, dtype=torch.long),
        audio_mels=mels,
        audio_frames=torch.tensor([mels.shape[0]]),
        video_patches=torch.zeros(0, 3 * PATCH_SIZE * PATCH_SIZE),
        video_grids=torch.zeros(0, 3, dtype=torch.long),
        num_samples=1,
        tokenizer=tokenizer,
    )


def a_clip(seconds: float) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.sin(2 * np.pi * 1234 * t)).astype(np.float32)


def logit_gap(model: OmniModel, out: Path, llm: Path, audio: Path, seconds: float = CHUNK_S) -> float:
    """The largest |transformers' logit - omni's| of the exported directory for a conversation with a clip of
    `seconds`, inputs made by the exported processor (its features checked against omni's to 1e-5 and its
    audio token count against the token rule)."""
    from transformers import Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor

    processor = Qwen2AudioProcessor.from_pretrained(out)
    exported = Qwen2AudioForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "\nwhat sound is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a tone"}]},
    ]
    text = processor.apply_chat_template(messages)
    assert "<audio>\nwhat sound is this?<|im_end|>" in text
    wave = a_clip(seconds)
    inputs = processor(text=text, audio=wave, sampling_rate=RATE, return_tensors="pt")

    tokenizer = HFTokenizer.from_pretrained(llm)
    ids = inputs["input_ids"][0]
    features = WhisperFeatures.from_pretrained(audio)
    mels = features.features(torch.from_numpy(wave))
    assert int((ids == tokenizer.placeholder_ids["audio"]).sum()) == audio_tokens(mels.shape[0], 2)
    theirs_mels = inputs["input_features"][0].T
    torch.testing.assert_close(mels, theirs_mels[: mels.shape[0]], atol=1e-5, rtol=0)
    with torch.no_grad():
        theirs = exported(**inputs).logits[0]
        mine = model.eval()(audio_batch(ids, mels, tokenizer))
    assert mine.shape == theirs.shape
    return float((mine - theirs).abs().max())


@pytest.mark.parametrize(("kind", "tied"), [("qwen2", False), ("qwen2", True), ("llama", False)])
def test_exported_qwen2_audio_gives_omnis_logits(tmp_path: Path, kind: str, tied: bool) -> None:
    llm, audio = parts(tmp_path / "parts", kind=kind, tied=tied)
    model = qwen2_audio_ready(llm, audio)
    out = export_qwen2_audio(model, llm, audio, tmp_path / "export")
    assert logit_gap(model, out, llm, audio) <= 1e-4


def test_a_clip_shorter_than_the_chunk_differs_only_through_the_stems_padding(tmp_path: Path) -> None:
    """transformers' conv stem reads the log-mel of the chunk's padding after a shorter clip, omni's reads zeros
    (the export's documented convention): the logits differ, measurably but boundedly. The figure is printed
    for the report (pytest -s)."""
    llm, audio = parts(tmp_path / "parts")
    model = qwen2_audio_ready(llm, audio)
    out = export_qwen2_audio(model, llm, audio, tmp_path / "export")
    gap = logit_gap(model, out, llm, audio, seconds=0.6)  # 60 frames of the chunk's 100
    print(f"max |logit difference| for a 0.6 s clip in a 1 s chunk: {gap:.3e}")
    assert 1e-4 < gap < 1.0


def test_the_token_rule_agrees_between_data_model_and_processor(tmp_path: Path) -> None:
    """For clips of an even number L of feature frames: `measure` (the data's rule, with the recipe's pool),
    omni's encoder with pool 2 and Qwen2AudioProcessor give the same number of LLM audio tokens."""
    from transformers import WhisperFeatureExtractor

    llm, audio = parts(tmp_path / "parts")
    model = qwen2_audio_ready(llm, audio)
    towers = TowerInputs(audio=WhisperFeatures.from_pretrained(audio), audio_pool=2)
    only_audio = ["model.pretrained.llm=null", "model.pretrained.vision=null", "model.audio_pool=2"]
    recipe = load_recipe(ALIGN, [*align_overrides(tmp_path, {"audio": str(audio)}), *only_audio])
    extractor = WhisperFeatureExtractor.from_pretrained(audio)
    for frames in (2, 4, 6, 8, 30, 62, 100):
        samples = np.array([frames * 160])
        sizes = measure(_one_clip(samples), 1, recipe.data, towers=towers)
        mask = extractor(a_clip(frames * 160 / RATE), sampling_rate=RATE, return_attention_mask=True)
        valid = int(mask["attention_mask"].sum())
        processor_rule = (((valid - 1) // 2 + 1) - 2) // 2 + 1
        with torch.no_grad():
            rows = model.audio(torch.zeros(frames, N_MELS), [frames]).shape[0]
        assert valid == frames
        assert int(sizes.tokens[0]) - 2 == processor_rule == rows == frames // 4, frames
        assert int(sizes.audio_tokens[0]) == frames // 2  # the encoder's cost: tokens before the pool
    assert TowerInputs.of_recipe(recipe) == towers


def _one_clip(samples: np.ndarray) -> Segments:
    """A sample made of one clip of `samples` samples at 16 kHz (no text)."""
    zeros = np.zeros(1, dtype=np.int64)
    kind = np.array([KIND_CODE["audio"]])
    return Segments(zeros, kind, zeros, zeros, samples, np.array([RATE]), zeros, zeros)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"pool": 1}, "audio pool=1: Qwen2-Audio averages pairs"),
        ({"audio_projector": "mlp"}, "audio_projector='mlp': Qwen2-Audio's projector is one Linear"),
        ({"norm_eps": 1e-6}, "audio norm_eps=1e-06"),
    ],
)
def test_what_qwen2_audio_cannot_express_is_refused_by_name(tmp_path: Path, change: dict, named: str) -> None:
    llm, audio = parts(tmp_path / "parts")
    model = qwen2_audio_ready(llm, audio)
    audio_changes = {k: v for k, v in change.items() if k != "audio_projector"}
    args = replace(model.args, audio=replace(model.args.audio, **audio_changes))
    model = OmniModel(replace(args, **{k: v for k, v in change.items() if k == "audio_projector"}))
    with pytest.raises(ExportRefused, match=named):
        export_qwen2_audio(model, llm, audio, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_an_extractor_chunk_other_than_the_encoders_is_refused(tmp_path: Path) -> None:
    from transformers import WhisperFeatureExtractor

    llm, audio = parts(tmp_path / "parts")
    WhisperFeatureExtractor(feature_size=N_MELS, chunk_length=2).save_pretrained(audio)
    with pytest.raises(ExportRefused, match=r"a chunk of 200 feature frames is not the encoder's .* = 100"):
        export_qwen2_audio(qwen2_audio_ready(llm, audio), llm, audio, tmp_path / "export")


def qwen2_audio_overrides(root: Path, llm: Path, audio: Path) -> list[str]:
    """The shipped alignment stage on the audio parts, with Qwen2-Audio's pool and projector, 1 s clips."""
    return [
        *align_overrides(root, {"llm": str(llm), "audio": str(audio)}),
        "model.pretrained.vision=null",
        "model.audio_pool=2",
        "model.audio_projector=linear",
        "data.synthetic.mix={audio: 1.0}",
        f"data.synthetic.audio_ms.min={CHUNK_S * 1000}",
        f"data.synthetic.audio_ms.max={CHUNK_S * 1000}",
    ]


def test_omni_export_writes_a_trained_audio_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint as the trainer saves it (two alignment steps with Qwen2-Audio's pool and projector),
    exported by the command line from its checkpoint folder; the same recipe without the options, or with a
    vision tower too, is refused by name."""
    llm, audio = parts(tmp_path / "parts")
    settings = qwen2_audio_overrides(tmp_path, llm, audio)
    model, checkpoint, printed = train_and_export(tmp_path, settings, capsys)
    assert f"to {tmp_path / 'export'} (Qwen2AudioForConditionalGeneration)" in printed
    assert model.args.audio.pool == 2 and model.args.audio_projector == "linear"
    assert logit_gap(model, tmp_path / "export", llm, audio) <= 1e-4
    overrides = [f"--set={o}" for o in settings]

    refused = tmp_path / "refused"
    with_vision = [*overrides, f"--set=model.pretrained.vision={llm}"]
    assert main(["export", str(ALIGN), checkpoint, "--to", str(refused), *with_vision]) == 2
    assert "a model with a vision tower and an audio encoder has no transformers class" in capsys.readouterr().err
    assert not refused.exists()


def test_the_audio_options_keep_the_hashes_of_recipes_without_them(tmp_path: Path) -> None:
    base = align_overrides(tmp_path, {})
    plain, pooled = load_recipe(ALIGN, base), load_recipe(ALIGN, [*base, "model.audio_pool=2"])
    assert "audio_pool" not in plain.model.model_dump() and pooled.model.model_dump()["audio_pool"] == 2
    assert plain.training_hash() != pooled.training_hash()
    assert load_recipe(ALIGN, [*base, "model.audio_pool=1"]).training_hash() == plain.training_hash()


def test_the_recipes_projector_kinds_are_the_models() -> None:
    from typing import get_args

    from omni_core.models.args import PROJECTOR_KINDS
    from omni_core.recipe.model_sections import ModelConfig

    assert get_args(ModelConfig.model_fields["audio_projector"].annotation) == PROJECTOR_KINDS


def test_the_counts_follow_the_linear_projector_and_the_pool() -> None:
    from omni_core.models.flavors import get_flavor
    from omni_core.models.flops import omni_params, omni_train_flops

    args = get_flavor("debug", patch_size=PATCH_SIZE, n_mels=N_MELS)
    qwen2_audio = replace(args, audio=replace(args.audio, pool=2), audio_projector="linear")
    model = OmniModel(qwen2_audio)
    assert model.num_params() == omni_params(qwen2_audio)["total"]
    dim, llm = args.audio.dim, args.llm.dim
    # the audio MLP's second layer (llm x llm, bias) is gone
    assert omni_params(args)["projectors"] - omni_params(qwen2_audio)["projectors"] == llm * llm + llm
    # 100 frames: 50 encoder tokens, 25 after the pool, each through one dim x llm Linear instead of the MLP
    mlp, linear = (
        omni_train_flops(a, [64], audio_frames=[100]) for a in (args, replace(args, audio_projector="linear"))
    )
    pooled = omni_train_flops(qwen2_audio, [64], audio_frames=[100])
    assert mlp - linear == 3 * 2 * 50 * llm * llm
    assert linear - pooled == 3 * 2 * 25 * dim * llm


def test_generation_finds_each_documents_pooled_clips() -> None:
    """`generate.documents` counts a clip's placeholders with the model's pool: each document gets its own
    clips and frames (pool 1 would give the first document one clip and the second the next)."""
    from omni_core.common.tokenizer import BYTE_TOKENIZER
    from omni_core.models.flavors import get_flavor
    from omni_core.runtime.generate import documents
    from tests.helpers.models import make_batch
    from tests.ranks.test_export_options_ranks import pooled

    two_clips, one_clip = [("text", 3), ("audio", 10), ("audio", 10), ("text", 2)], [("audio", 10), ("text", 4)]
    batch = pooled(make_batch([two_clips, one_clip]), seed=0)
    docs = list(documents(batch, BYTE_TOKENIZER, lambda r, c: r * c, lambda f, r, c: f * r * c, audio_pool=2))
    assert [d.audio_frames.tolist() for d in docs] == [[20, 20], [20]]
    assert [d.audio_mels.shape[0] for d in docs] == [40, 20]
    args = get_flavor("debug", patch_size=PATCH_SIZE, n_mels=N_MELS)
    model = OmniModel(replace(args, audio=replace(args.audio, pool=2))).eval()
    with torch.no_grad():  # each prompt's clip fills its placeholders
        for doc in docs:
            assert model(doc.with_tokens(doc.input_ids, BYTE_TOKENIZER)).shape[0] == doc.input_ids.numel()


def test_a_pooled_encoder_is_not_saved_as_a_whisper_encoder(tmp_path: Path) -> None:
    from omni_core.models.args import AudioArgs
    from omni_core.models.audio import AudioEncoder

    with pytest.raises(ValueError, match="a WhisperEncoder has no pooling, this encoder pools 2"):
        hf_import.save_pretrained(AudioEncoder(AudioArgs(pool=2)), tmp_path / "whisper")
    assert not (tmp_path / "whisper").exists()


@pytest.mark.parametrize(("kind", "pool"), [("mlp", 1), ("linear", 2)])
def test_the_estimator_prices_the_audio_projector_the_model_builds(tmp_path: Path, kind: str, pool: int) -> None:
    """Qwen2-Audio's options reach the estimator: the audio projector's parameters are the model's (one Linear
    under `linear`) and, on profiled audio data, it runs on the pooled tokens."""
    from omni_core.data.dataset import open_dataset
    from omni_core.data.flops import FlopModel
    from omni_core.data.profile import profile_source
    from omni_core.data.synthetic import ensure_dataset
    from omni_core.estimator.omni_workloads import omni_workload
    from omni_core.models.flavors import get_flavor
    from tests.helpers.recipes import build_recipe

    recipe = build_recipe(tmp_path, {"data.synthetic.num_samples": 16, "data.synthetic.mix": {"audio": 1.0}})
    ensure_dataset(recipe)
    profile = profile_source(open_dataset(recipe), recipe.data, 1, FlopModel.for_recipe(recipe))
    base = get_flavor("debug", patch_size=recipe.data.patch_size, n_mels=recipe.data.n_mels)

    def audio_projector(pooled: int):
        args = replace(base, audio=replace(base.audio, pool=pooled), audio_projector=kind)
        layers = omni_workload(args, seq_len=recipe.data.seq_len, global_batch=2, profile=profile).encoder
        return OmniModel(args), next(layer for layer in layers if layer.name == "projector.audio")

    model, projector = audio_projector(pool)
    assert projector.params == sum(p.numel() for p in model.projectors["audio"].parameters())
    assert projector.flops > 0 and projector.flops * pool == pytest.approx(audio_projector(1)[1].flops)

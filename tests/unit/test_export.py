"""`hf_export`: an omni vision + LLM model built from tiny pretrained parts, exported as a LLaVA directory, loads
in transformers (`LlavaForConditionalGeneration`, `LlavaProcessor`) and gives omni's logits for the same
conversation with an image, inputs made by the exported processor; what LLaVA cannot express is refused by name."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from flows.cli import main
from omni_core.common.batch import MODALITY_IDS, PackedBatch
from omni_core.common.tokenizer import HFTokenizer
from omni_core.data.tower_processors import SiglipImageProcessing
from omni_core.models import hf_import
from omni_core.models.hf_export import ExportRefused, export_llava
from omni_core.models.omni import OmniModel
from omni_core.models.pretrained import omni_args
from omni_core.recipe import load_recipe
from omni_core.runtime.checkpoint import latest_checkpoint
from omni_core.runtime.ckpt_store import LocalStore
from omni_core.runtime.evaluate import load_model
from omni_core.runtime.trainer import train
from tests.helpers.hf_parts import write_llm, write_vision
from tests.helpers.models import N_MELS, PATCH_SIZE
from tests.helpers.runtime import CPU, RecordingTracker

ALIGN = Path(__file__).resolve().parents[2] / "recipes" / "mllm_align.yaml"
IMAGE_SIDE = 8 * PATCH_SIZE  # write_vision's image_size: an 8 x 8 patch grid, 64 image tokens


def parts(root: Path, kind: str = "qwen2", tied: bool = False, side: int = IMAGE_SIDE) -> tuple[Path, Path]:
    from transformers import SiglipImageProcessor

    llm, vision = write_llm(root / "llm", kind=kind, tied=tied), write_vision(root / "vision")
    SiglipImageProcessor(size={"height": side, "width": side}).save_pretrained(vision)
    return llm, vision


def llava_ready(llm: Path, vision: Path, **changes: object) -> OmniModel:
    """The model a recipe with these pretrained parts builds, with LLaVA's feature layer, filled from the files
    (the projectors: torch's default init, biases nonzero)."""
    vocab = HFTokenizer.from_pretrained(llm).vocab_size
    args, found = omni_args(
        "debug", {"llm": str(llm), "vision": str(vision)}, patch_size=PATCH_SIZE, n_mels=N_MELS, vocab_size=vocab
    )
    args = replace(args, vision=replace(args.vision, final_norm=False), spatial_merge=1, projector_mult=1)
    model = OmniModel(replace(args, **changes))
    for part, where in found.items():
        hf_import.load_safetensors(getattr(model, part), where.directory, where.layout, where.prefix)
    return model.eval()


def omni_batch(ids: torch.Tensor, patches: torch.Tensor, grid: tuple[int, int], tokenizer: HFTokenizer) -> PackedBatch:
    n = ids.numel()
    return PackedBatch(
        input_ids=ids,
        labels=torch.full_like(ids, -100),
        position_ids=torch.arange(n),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
        loss_modality=torch.full_like(ids, MODALITY_IDS["text"]),
        image_patches=patches,
        image_grids=torch.tensor([grid]),
        audio_mels=torch.zeros(0, N_MELS),
        audio_frames=torch.zeros(0, dtype=torch.long),
        video_patches=torch.zeros(0, patches.shape[1]),
        video_grids=torch.zeros(0, 3, dtype=torch.long),
        num_samples=1,
        tokenizer=tokenizer,
    )


def assert_same_logits(model: OmniModel, out: Path, llm: Path, vision: Path) -> None:
    """transformers' logits of the exported directory equal omni's to 1e-4 (fp32) for a conversation with an
    image, inputs made by the exported processor."""
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    processor = LlavaProcessor.from_pretrained(out)
    exported = LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nwhat colour is the box?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "the box is red"}]},
    ]
    text = processor.apply_chat_template(messages)
    assert "<image>\nwhat colour is the box?<|im_end|>" in text
    image = Image.new("RGB", (37, 23), (200, 30, 40))
    image.paste((20, 90, 220), (5, 4, 20, 18))
    inputs = processor(text=text, images=image, return_tensors="pt")

    tokenizer = HFTokenizer.from_pretrained(llm)
    ids = inputs["input_ids"][0]
    assert int((ids == tokenizer.placeholder_ids["image"]).sum()) == (IMAGE_SIDE // PATCH_SIZE) ** 2
    ours = SiglipImageProcessing.from_pretrained(vision)
    torch.testing.assert_close(torch.from_numpy(ours.pixels(image)), inputs["pixel_values"][0], atol=1e-5, rtol=0)
    patches, grid = ours.patches(image, PATCH_SIZE)
    with torch.no_grad():
        theirs = exported(**inputs).logits[0]
        mine = model.eval()(omni_batch(ids, patches, grid, tokenizer))
    assert mine.shape == theirs.shape
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("kind", "tied", "inline_template"), [("qwen2", False, False), ("qwen2", True, True), ("llama", False, False)]
)
def test_exported_llava_gives_omnis_logits(tmp_path: Path, kind: str, tied: bool, inline_template: bool) -> None:
    llm, vision = parts(tmp_path / "parts", kind=kind, tied=tied)
    if inline_template:  # the template in tokenizer_config.json, as older checkpoints keep it
        config = json.loads((llm / "tokenizer_config.json").read_text())
        config["chat_template"] = (llm / "chat_template.jinja").read_text()
        (llm / "tokenizer_config.json").write_text(json.dumps(config))
        (llm / "chat_template.jinja").unlink()
    model = llava_ready(llm, vision)
    assert_same_logits(model, export_llava(model, llm, vision, tmp_path / "export"), llm, vision)


def align_overrides(root: Path, found: dict[str, str]) -> list[str]:
    """The shipped alignment stage, two steps on synthetic data, on the tiny parts `found`."""
    return [
        *(f"model.pretrained.{part}={folder}" for part, folder in found.items()),
        f"experiment.output_dir={root}",
        "data.source=synthetic",
        f"data.path={root / 'data'}",
        "data.format=auto",
        "data.media_root=''",
        "data.synthetic.num_samples=16",
        "data.seq_len=256",
        f"data.patch_size={PATCH_SIZE}",
        f"data.n_mels={N_MELS}",
        "parallel.nproc=1",
        "train.steps=2",
        "train.warmup_steps=1",
        "train.ckpt_every=0",
        f"train.ckpt_dir={root / 'mllm_align'}",
    ]


def train_and_export(
    root: Path, settings: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[OmniModel, str, str]:
    """Two alignment steps under `settings`, then `omni export` of the checkpoint folder (its newest step) to
    root/export: the trained model, its checkpoint and what the command printed."""
    align = load_recipe(ALIGN, settings)
    train(align, CPU, tracker=RecordingTracker(), log=lambda _: None)
    out = root / "export"
    overrides = [f"--set={o}" for o in settings]
    assert main(["export", str(ALIGN), str(root / "mllm_align"), "--to", str(out), *overrides]) == 0
    printed = capsys.readouterr().out
    assert f"to {out}" in printed
    checkpoint = latest_checkpoint(LocalStore(root / "mllm_align"))
    assert checkpoint is not None
    return load_model(align, checkpoint)[0], checkpoint, printed


def test_omni_export_writes_a_trained_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint as the trainer saves it (two alignment steps of the shipped stage, LLaVA's feature layer),
    exported by the command line from its checkpoint folder (the newest step)."""
    llm, vision = parts(tmp_path / "parts")
    found = {"llm": str(llm), "vision": str(vision)}
    settings = [*align_overrides(tmp_path, found), "model.vision_final_norm=false", "model.pretrained.audio=null"]
    model, checkpoint, _ = train_and_export(tmp_path, settings, capsys)
    assert_same_logits(model, tmp_path / "export", llm, vision)
    overrides = [f"--set={o}" for o in settings]

    unset = [o for o in overrides if "vision_final_norm" not in o and "pretrained.audio" not in o]
    norm_on = [*unset, "--set=model.vision_final_norm=true", "--set=model.pretrained.audio=null"]
    assert main(["export", str(ALIGN), checkpoint, "--to", str(tmp_path / "refused"), *norm_on]) == 2
    assert "vision final_norm=True" in capsys.readouterr().err
    with_audio = [*unset, "--set=model.vision_final_norm=false", f"--set=model.pretrained.audio={llm}"]
    assert main(["export", str(ALIGN), checkpoint, "--to", str(tmp_path / "refused"), *with_audio]) == 2
    assert "a model with a vision tower and an audio encoder has no transformers class" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"spatial_merge": 2}, "spatial_merge=2"),
        ({"projector_mult": 2}, "projector hidden width 128 != LLM dim 64"),
        ({"vision_final_norm": True}, "vision final_norm=True"),
        ({"vision_pos_embed": "factorized"}, "vision pos_embed='factorized'"),
    ],
)
def test_what_llava_cannot_express_is_refused_by_name(tmp_path: Path, change: dict, named: str) -> None:
    llm, vision = parts(tmp_path / "parts")
    vision_changes = {k.removeprefix("vision_"): v for k, v in change.items() if k.startswith("vision_")}
    model = llava_ready(llm, vision, **{k: v for k, v in change.items() if not k.startswith("vision_")})
    if vision_changes:
        model = OmniModel(replace(model.args, vision=replace(model.args.vision, **vision_changes)))
    with pytest.raises(ExportRefused, match=named):
        export_llava(model, llm, vision, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_a_processor_size_other_than_the_towers_is_refused(tmp_path: Path) -> None:
    llm, vision = parts(tmp_path / "parts", side=IMAGE_SIDE // 2)
    with pytest.raises(ExportRefused, match=r"preprocessor_config\.json: size .* is not the tower's image_size 64"):
        export_llava(llava_ready(llm, vision), llm, vision, tmp_path / "export")


@pytest.mark.parametrize(
    ("unset", "named"),
    [("vision", "the recipe names vision from no folder"), ("llm", "the recipe names llm from no folder")],
)
def test_a_recipe_without_the_llava_parts_is_refused(tmp_path: Path, unset: str, named: str) -> None:
    from omni_core.runtime.export import export_checkpoint

    llm, vision = parts(tmp_path / "parts")
    found = {"llm": str(llm), "vision": str(vision)}
    recipe = load_recipe(
        ALIGN, [*align_overrides(tmp_path, found), "model.pretrained.audio=null", f"model.pretrained.{unset}=null"]
    )
    with pytest.raises(ExportRefused, match=named):  # before any checkpoint is looked for
        export_checkpoint(recipe, str(tmp_path / "no_checkpoint"), tmp_path / "export")


@pytest.mark.parametrize("listed", [None, "<|endoftext|>"])
def test_exported_generation_stops_at_the_tokenizers_eos(tmp_path: Path, listed: str | None) -> None:
    """transformers' generate stops where omni trained replies to end (the tokenizer's EOS), beside whatever
    the base checkpoint's generation_config.json lists; an LLM without one gets it too."""
    from transformers import GenerationConfig

    llm, vision = parts(tmp_path / "parts")
    tokenizer = HFTokenizer.from_pretrained(llm)
    (llm / "generation_config.json").unlink(missing_ok=True)
    if listed is not None:
        other = tokenizer.backend.token_to_id(listed)
        (llm / "generation_config.json").write_text(json.dumps({"eos_token_id": other, "temperature": 0.7}))
    out = export_llava(llava_ready(llm, vision), llm, vision, tmp_path / "export")
    config = GenerationConfig.from_pretrained(out)
    expected = [tokenizer.eos_id] if listed is None else [other, tokenizer.eos_id]
    assert config.eos_token_id == (expected[0] if len(expected) == 1 else expected)
    assert config.pad_token_id == tokenizer.pad_id and (listed is None or config.temperature == 0.7)

"""`model.pretrained` settings omni cannot honour are refused before launch (`preflight.check_launch`, which
`omni recipe check` runs), each naming the recipe field and the file and key or tensor at fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_core.recipe import RecipeError
from omni_core.runtime.preflight import check_launch
from tests.helpers.hf_parts import write_audio, write_llm, write_vision
from tests.helpers.recipes import build_recipe


def problems(tmp_path: Path, overrides: dict) -> str:
    with pytest.raises(RecipeError) as error:
        check_launch(build_recipe(tmp_path, overrides))
    return str(error.value)


def edit_config(folder: Path, **changes: object) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return path


def test_a_missing_folder_and_a_missing_config_are_named(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    found = problems(tmp_path, {"model.pretrained.vision": str(tmp_path / "absent"),
                                "model.pretrained.audio": str(tmp_path / "empty")})
    assert f"model.pretrained.vision: {tmp_path / 'absent'}: no such folder" in found
    assert f"model.pretrained.audio: {tmp_path / 'empty' / 'config.json'}: no config.json" in found


def test_a_config_key_omni_cannot_honour_is_named(tmp_path: Path) -> None:
    config = edit_config(write_llm(tmp_path / "llm"), attention_bias=True)
    found = problems(tmp_path, {"model.pretrained.llm": str(tmp_path / "llm")})
    assert f"model.pretrained.llm: {config}: attention_bias=True" in found


def test_tensors_that_do_not_fit_the_config_are_named(tmp_path: Path) -> None:
    edit_config(write_vision(tmp_path / "vit"), intermediate_size=64)  # the files hold 96-wide MLPs
    found = problems(tmp_path, {"model.pretrained.vision": str(tmp_path / "vit")})
    assert f"model.pretrained.vision: {tmp_path / 'vit'} does not fit the siglip layout" in found
    assert "'encoder.layers.0.mlp.fc1.weight' has shape (96, 48), expected (64, 48)" in found


def test_inputs_the_data_settings_do_not_make_are_named(tmp_path: Path) -> None:
    write_vision(tmp_path / "vit")
    write_audio(tmp_path / "whisper")
    found = problems(tmp_path, {"model.pretrained.vision": str(tmp_path / "vit"), "data.patch_size": 16,
                                "model.pretrained.audio": str(tmp_path / "whisper"), "data.n_mels": 80})
    assert "model.pretrained.vision:" in found and "has patch_size 8, but data.patch_size is 16" in found
    assert "model.pretrained.audio:" in found and "has num_mel_bins 32, but data.n_mels is 80" in found


def test_an_llm_without_its_tokenizer_is_named(tmp_path: Path) -> None:
    (write_llm(tmp_path / "llm") / "tokenizer.json").unlink()
    assert "model.pretrained.llm:" in problems(tmp_path, {"model.pretrained.llm": str(tmp_path / "llm")})


def test_good_parts_pass(tmp_path: Path) -> None:
    write_llm(tmp_path / "llm")
    check_launch(build_recipe(tmp_path, {"model.pretrained.llm": str(tmp_path / "llm")}))


def test_the_plan_is_checked_against_the_pretrained_llm(tmp_path: Path) -> None:
    """The flavor's LLM (debug: untied) would take pp=2; the pretrained one's tied head cannot be split from it."""
    write_llm(tmp_path / "llm", tied=True)
    found = problems(tmp_path, {"model.pretrained.llm": str(tmp_path / "llm"), "parallel.nproc": 2, "parallel.pp": 2})
    assert "parallel: plan dp1-pp2 does not fit the model: pp=2 would put the tied embedding" in found
    assert f"(model {tmp_path / 'llm'}, 2 ranks)" in found


def test_a_model_familys_own_placeholders(tmp_path: Path) -> None:
    """model.placeholders names the tokens a model family's vocabulary and chat template already use for media
    (here <|endoftext|> stands for images): those ids are the placeholders, only the others are added; a
    token that would serve twice is named before launch, and placeholders without a pretrained LLM at load."""
    from omni_core.common.tokenizer import HFTokenizer, tokenizer_for

    llm = str(write_llm(tmp_path / "llm"))
    recipe = build_recipe(tmp_path, {"model.pretrained.llm": llm, "model.placeholders": {"image": "<|endoftext|>"}})
    tokenizer = tokenizer_for(recipe)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.added_tokens == ("<audio>", "<video>")
    assert tokenizer.placeholder_ids["image"] == tokenizer.backend.token_to_id("<|endoftext|>")
    assert recipe.training_hash() != build_recipe(tmp_path, {"model.pretrained.llm": llm}).training_hash()
    assert "placeholders" not in build_recipe(tmp_path, {}).model.model_dump()  # older hashes stand
    found = problems(tmp_path, {"model.pretrained.llm": llm, "model.placeholders": {"audio": "<|im_end|>"}})
    assert "model.placeholders: placeholder tokens" in found and "must differ" in found
    with pytest.raises(RecipeError, match="placeholders: tokens of a pretrained LLM's vocabulary"):
        build_recipe(tmp_path, {"model.placeholders": {"image": "<x>"}})

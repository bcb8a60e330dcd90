"""The LLM's own tokenizer (`common.tokenizer.HFTokenizer`) and chat rendering (`data.chat`): the same token ids
as transformers' apply_chat_template, the loss mask on the assistant replies alone, placeholder tokens added past
the base vocabulary, and errors that name the file and field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from omni_core.common.tokenizer import BYTE_TOKENIZER, BOS_ID, EOS_ID, IMAGE_ID, HFTokenizer, tokenizer_for
from omni_core.data.chat import render_conversation
from tests.helpers.hf_tokenizer import write_tokenizer
from tests.helpers.recipes import build_recipe

CONVERSATION = [
    {"role": "system", "content": "You are a box describer."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the box?"}]},
    {"role": "assistant", "content": "It is red."},
    {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "and this tone?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "do mi la. héllo"}]},
    {"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "and these?"}]},
    {"role": "assistant", "content": "a blue square moves left."},
]
REPLIES = ("It is red.", "do mi la. héllo", "a blue square moves left.")
END_OF_TURN = {"chatml": "<|im_end|>\n", "llama": "<|eot_id|>"}
BASE_VOCAB = 400  # what tests.helpers.hf_tokenizer trains


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        (style, image): write_tokenizer(root / f"{style}-{image}", style, with_image=image)
        for style in END_OF_TURN
        for image in (False, True)
    }


def transformers_ids(folder: Path, added: tuple[str, ...], messages: list, add_generation_prompt: bool) -> list[int]:
    """transformers' ids for the conversation, its tokenizer given omni's added placeholders (as an export writes
    them)."""
    reference = AutoTokenizer.from_pretrained(folder)
    reference.add_tokens([AddedToken(token, special=True, normalized=False) for token in added])
    ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("style", sorted(END_OF_TURN))
@pytest.mark.parametrize("image_in_vocab", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_ids_equal_transformers_and_mask_covers_the_replies(folders, style, image_in_vocab, add_generation_prompt):
    folder = folders[style, image_in_vocab]
    tokenizer = HFTokenizer.from_pretrained(folder)
    # with the generation prompt, the conversation ends on the user's last turn: two replies to train on
    messages = CONVERSATION[:-1] if add_generation_prompt else CONVERSATION
    rendered = render_conversation(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    assert rendered.ids == transformers_ids(folder, tokenizer.added_tokens, messages, add_generation_prompt)
    trained = [token for token, keep in zip(rendered.ids, rendered.trainable, strict=True) if keep]
    replies = REPLIES[:2] if add_generation_prompt else REPLIES
    assert tokenizer.decode(trained, skip_special_tokens=False) == "".join(r + END_OF_TURN[style] for r in replies)
    for kind, count in (("image", 2), ("audio", 1), ("video", 1)):
        assert rendered.ids.count(tokenizer.placeholder_ids[kind]) == count
    everything = render_conversation(
        tokenizer, messages, train_on_prompt=True, add_generation_prompt=add_generation_prompt
    )
    assert all(everything.trainable) and everything.ids == rendered.ids


def test_placeholders_added_past_the_base_vocabulary(folders):
    lacking = HFTokenizer.from_pretrained(folders["chatml", False])
    assert lacking.added_tokens == ("<image>", "<audio>", "<video>")
    assert sorted(lacking.placeholder_ids.values()) == [BASE_VOCAB, BASE_VOCAB + 1, BASE_VOCAB + 2]
    assert lacking.vocab_size == BASE_VOCAB + 3
    having = HFTokenizer.from_pretrained(folders["chatml", True])
    assert having.added_tokens == ("<audio>", "<video>") and having.placeholder_ids["image"] < BASE_VOCAB
    assert {having.placeholder_ids["audio"], having.placeholder_ids["video"]} == {BASE_VOCAB, BASE_VOCAB + 1}
    qwen_audio = HFTokenizer.from_pretrained(folders["chatml", True], placeholders={"audio": "<|AUDIO|>"})
    assert qwen_audio.added_tokens == ("<|AUDIO|>", "<video>") and qwen_audio.encode("<|AUDIO|>") == [BASE_VOCAB]
    with pytest.raises(ValueError, match="placeholder tokens for \\['speech'\\]"):
        HFTokenizer.from_pretrained(folders["chatml", True], placeholders={"speech": "<s>"})
    with pytest.raises(ValueError, match="must differ from each other and from the named special tokens"):
        HFTokenizer.from_pretrained(folders["chatml", True], placeholders={"audio": "<image>"})
    with pytest.raises(ValueError, match="must differ from each other and from the named special tokens"):
        HFTokenizer.from_pretrained(folders["chatml", True], placeholders={"video": "<|im_end|>"})


def test_special_tokens_and_padding(folders):
    chatml, llama = (HFTokenizer.from_pretrained(folders[style, False]) for style in ("chatml", "llama"))
    assert chatml.bos_id is None and chatml.pad_id == chatml.eos_id == chatml.encode("<|im_end|>")[0]
    assert llama.bos_id == llama.encode("<|begin_of_text|>")[0] and llama.pad_id != llama.eos_id
    assert chatml.template_tokens == {"eos_token": "<|im_end|>"}
    text = "héllo <image> café?"
    ids, offsets = chatml.encode_with_offsets(text)
    assert ids == chatml.encode(text) and chatml.lengths([text, "", "a b"]) == [len(ids), 0, len(chatml.encode("a b"))]
    assert "".join(text[a:b] for a, b in offsets).replace(" ", "") == text.replace(" ", "")
    assert chatml.decode(ids) == "héllo  café?" and chatml.decode(ids, skip_special_tokens=False) == text


def test_byte_tokenizer_keeps_its_ids():
    text = "héllo"
    assert BYTE_TOKENIZER.encode(text) == list(text.encode()) and BYTE_TOKENIZER.lengths([text, "ab"]) == [6, 2]
    ids, offsets = BYTE_TOKENIZER.encode_with_offsets(text)
    assert ids == BYTE_TOKENIZER.encode(text) and offsets[1] == offsets[2] == (1, 2)
    assert BYTE_TOKENIZER.decode([BOS_ID, *b"hi", IMAGE_ID, EOS_ID]) == "hi"
    assert BYTE_TOKENIZER.decode([BOS_ID, *b"hi", IMAGE_ID], skip_special_tokens=False) == "<bos>hi<image>"
    with pytest.raises(ValueError, match="byte tokenizer: no chat template \\(tokenizer_config.json's `chat_template`"):
        render_conversation(BYTE_TOKENIZER, CONVERSATION)


def test_tokenizer_for_the_recipe(folders):
    recipe = build_recipe()
    assert tokenizer_for(recipe) is BYTE_TOKENIZER
    folder = str(folders["llama", False])
    pretrained = recipe.model.pretrained.model_copy(update={"llm": folder})  # model_copy: the validator refuses it
    with_llm = recipe.model_copy(update={"model": recipe.model.model_copy(update={"pretrained": pretrained})})
    chosen = tokenizer_for(with_llm)
    assert isinstance(chosen, HFTokenizer) and chosen.name == folder and chosen.vocab_size == BASE_VOCAB + 3


def copy_of(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "tok"
    shutil.copytree(folder, target)
    return target


def edit_config(folder: Path, **changes) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def test_chat_template_from_the_config_string_or_list(folders, tmp_path):
    folder = copy_of(folders["chatml", False], tmp_path)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    edit_config(folder, chat_template=template)
    assert HFTokenizer.from_pretrained(folder).chat_template == template
    edit_config(folder, chat_template=[{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}])
    tokenizer = HFTokenizer.from_pretrained(folder)
    assert render_conversation(tokenizer, CONVERSATION).ids == transformers_ids(
        folder, tokenizer.added_tokens, CONVERSATION, False
    )
    edit_config(folder, chat_template=[{"name": "tool_use", "template": "x"}])
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template lists \\['tool_use'\\] but none"):
        HFTokenizer.from_pretrained(folder)
    edit_config(folder, chat_template=None)
    with pytest.raises(ValueError, match="no chat template \\(tokenizer_config.json's `chat_template`"):
        render_conversation(HFTokenizer.from_pretrained(folder), CONVERSATION)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"eos_token": 5}, "tokenizer_config.json: eos_token must be a token string or an AddedToken object"),
        ({"bos_token": {"lstrip": False}}, "tokenizer_config.json: bos_token must be a token string"),
        ({"eos_token": None}, "tokenizer_config.json: eos_token is missing"),
        ({"pad_token": "<nope>"}, "tokenizer_config.json: pad_token '<nope>' is not a token of tokenizer.json"),
        ({"added_tokens_decoder": {"x": {"content": "<a>"}}}, "tokenizer_config.json: added_tokens_decoder\\['x'\\]"),
        ({"added_tokens_decoder": {"7": {"content": "<|im_end|>"}}}, "added_tokens_decoder\\[7\\] is '<\\|im_end\\|>'"),
        ({"chat_template": 3}, "tokenizer_config.json: chat_template must be a string or a list"),
    ],
)
def test_malformed_config_fields_are_named(folders, tmp_path, changes, message):
    folder = copy_of(folders["chatml", False], tmp_path)
    if "chat_template" in changes:
        (folder / "chat_template.jinja").unlink()
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        HFTokenizer.from_pretrained(folder)


def test_missing_and_unreadable_files_are_named(folders, tmp_path):
    folder = copy_of(folders["chatml", False], tmp_path)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not JSON"):
        HFTokenizer.from_pretrained(folder)
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json: missing"):
        HFTokenizer.from_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizers file"):
        HFTokenizer.from_pretrained(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json: missing"):
        HFTokenizer.from_pretrained(folder)


def test_declared_added_token_is_added_at_its_id(folders, tmp_path):
    folder = copy_of(folders["chatml", False], tmp_path)
    edit_config(folder, added_tokens_decoder={str(BASE_VOCAB): {"content": "<|tool|>", "special": True}})
    tokenizer = HFTokenizer.from_pretrained(folder)
    assert tokenizer.encode("<|tool|>") == [BASE_VOCAB] and tokenizer.placeholder_ids["image"] == BASE_VOCAB + 1
    assert tokenizer.added_tokens == ("<image>", "<audio>", "<video>")  # the checkpoint's own token is not omni's


def test_templates_that_cannot_be_masked_or_lose_media_are_refused(folders, tmp_path):
    tokenizer = HFTokenizer.from_pretrained(folders["chatml", False])
    with pytest.raises(ValueError, match="1 image parts, but the chat template and its text give 2 image placeholder"):
        render_conversation(tokenizer, [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                      "text": "<image> hi"}]}])
    folder = copy_of(folders["chatml", False], tmp_path)
    (folder / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}")  # the last message alone
    text_only = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "It is red."}]
    with pytest.raises(ValueError, match="up to message 1 differently from the start of the whole conversation"):
        render_conversation(HFTokenizer.from_pretrained(folder), text_only)
    (folder / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="chat template failed on 3 messages: roles must alternate"):
        render_conversation(HFTokenizer.from_pretrained(folder), CONVERSATION[:3])


def test_reasoning_fields_and_generation_tags_render_as_transformers_renders_them(folders, tmp_path):
    folder = copy_of(folders["chatml", False], tmp_path)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}"
        "{% if m.reasoning_content %}{{ 'think: ' + m.reasoning_content + '\\n' }}{% endif %}"
        "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tokenizer = HFTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "what colour?"}, {"role": "assistant", "content": "red.", "thinking": "hmm"}]
    rendered = render_conversation(tokenizer, messages)
    assert rendered.ids == transformers_ids(folder, tokenizer.added_tokens, messages, False)
    trained = [token for token, keep in zip(rendered.ids, rendered.trainable, strict=True) if keep]
    assert tokenizer.decode(trained, skip_special_tokens=False) == "think: hmm\nred.<|im_end|>\n"

"""Tiny pretrained-LLM tokenizers for the tests, built offline: a byte-level BPE trained with `tokenizers` on a few
kilobytes of generated text, saved by transformers (`PreTrainedTokenizerFast.save_pretrained`) with a Qwen2-like
ChatML chat template or a Llama-3-like one, with or without `<image>` in its vocabulary."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = ("the red green blue circle square box is on a white black image sound what colour shape moves left "
         "right describe this picture please answer question you are helpful assistant it tone do mi so la yes no "
         "héllo café").split()

# Qwen2-VL's template, with omni's placeholder strings; a default system prompt when none is given.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'audio' %}{{ '<audio>' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama-3.1's shape: BOS from the special-token variables, a dated system header (strftime_now), roles checked
# with raise_exception, media parts before the text.
LLAMA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{ 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' + system | trim + '<|eot_id|>' }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('Unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}"
    "{% for part in message['content'] | selectattr('type', 'in', ['image', 'audio', 'video']) %}"
    "{{ '<' + part['type'] + '>' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] | trim }}"
    "{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

STYLES = {
    # special tokens of the vocabulary, and what tokenizer_config.json names (no pad: it pads with EOS)
    "chatml": (("<|endoftext|>", "<|im_start|>", "<|im_end|>"), {"eos_token": "<|im_end|>"}, CHATML),
    "llama": (
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"},
        LLAMA,
    ),
}


def corpus(size: int = 6000, seed: int = 0) -> list[str]:
    """Lines of random words, about `size` characters in all."""
    rng = random.Random(seed)
    lines, total = [], 0
    while total < size:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + rng.choice([".", "?", "!\n"])
        lines.append(line)
        total += len(line)
    return lines


def write_tokenizer(folder: Path, style: str = "chatml", with_image: bool = False, template: bool = True) -> Path:
    """A trained byte-level BPE saved as transformers saves a checkpoint's tokenizer, into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, named, chat_template = STYLES[style]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[*specials, *(["<image>"] if with_image else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **named)
    if template:
        fast.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return folder

"""Greedy generation with a KV cache (`runtime.generate`, `LLM.forward_cached`): the same tokens as re-running
the whole model for every token (fp32, CPU), dense and with a sliding window, with grouped-query attention and
media prompts; batched prompts of different lengths decode as they do alone; decoding stops at a stop token.
Answers are located in conversations by their targets and scored on normalised words."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omni_core.common.batch import video_tokens
from omni_core.common.tokenizer import BYTE_TOKENIZER, EOS_ID, HFTokenizer
from omni_core.data.dataset import ManifestDataset
from omni_core.data.loader import PackedLoader
from omni_core.models.flops import merged_grid
from omni_core.models.kv_cache import KVCache
from omni_core.models.omni import OmniModel, build_model
from omni_core.recipe.data_sections import DataConfig
from omni_core.runtime.evaluate import eval_device, task_scores
from omni_core.runtime.generate import (
    Document,
    answer_documents,
    answer_exact_match,
    answer_start,
    answer_token_f1,
    documents,
    greedy_generate,
    greedy_recompute,
    stop_ids,
)
from tests.helpers.conversations import write_llava
from tests.helpers.hf_tokenizer import write_tokenizer
from tests.helpers.models import MERGES, MIXED_DOCS, N_MELS, PATCH_SIZE, VIDEO_DOCS, make_batch
from tests.helpers.recipes import build_recipe

BUDGET = 10


def tiny_model(**llm_changes) -> OmniModel:
    args = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0).args
    model = OmniModel(dataclasses.replace(args, llm=dataclasses.replace(args.llm, **llm_changes)))
    model.init_weights(3)
    return model.eval()


def held_out_documents() -> list[Document]:
    """Documents with images, audio, video and text alone, of different lengths."""
    batch = make_batch([*MIXED_DOCS, *VIDEO_DOCS, [("text", 9)]], seed=5)
    return list(documents(batch, BYTE_TOKENIZER, lambda rows, cols: rows * cols, lambda *g: video_tokens(*g, *MERGES)))


def prompt_length(doc: Document, cut: int = 2) -> int:
    """All but the last `cut` tokens, but all of the media (a prompt never splits an image)."""
    media = (doc.input_ids > 255).nonzero()
    return max(len(doc.input_ids) - cut, int(media[-1]) + 1 if len(media) else 1)


def prompt(doc: Document, start: int):
    return doc.with_tokens(doc.input_ids[:start], BYTE_TOKENIZER)


MODELS = {
    "dense-gqa": {},
    "window": {"sliding_window": 4, "full_attention_layers": 1},
    "multi-query": {"n_kv_heads": 1, "sliding_window": 6},
    "multi-head": {"n_kv_heads": 4},
}


@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
def test_cached_tokens_equal_full_recompute(changes):
    model = tiny_model(**changes)
    generated = set()
    for doc in held_out_documents():
        start = prompt_length(doc)
        stop = stop_ids(BYTE_TOKENIZER)  # a generated placeholder would ask the recompute for media
        expected = greedy_recompute(model, doc, start, BUDGET, stop, BYTE_TOKENIZER)
        assert greedy_generate(model, [prompt(doc, start)], [BUDGET], stop) == [expected]
        generated |= set(expected)
    assert len(generated) > 2, generated  # a model that says one token everywhere would prove little


@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
@torch.no_grad()
def test_cached_logits_equal_the_packed_forward(changes):
    """Prefill then three one-token steps give the logits of the training forward over the whole document (the
    documents are longer than the windows, so the window's edge is crossed in both phases)."""
    model = tiny_model(**changes)
    for doc in held_out_documents():
        whole = doc.input_ids
        expected = model(doc.with_tokens(whole, BYTE_TOKENIZER))
        start = prompt_length(doc, 3)
        cache = KVCache(torch.zeros(1, dtype=torch.long))
        steps = [model.llm.forward_cached(model.embed(prompt(doc, start))[None], cache)[0]]
        steps.extend(model.llm.forward_cached(model.llm.embed(token.view(1, 1)), cache)[0] for token in whole[start:])
        torch.testing.assert_close(torch.cat(steps), expected, atol=1e-5, rtol=1e-5)


def test_batched_prompts_of_different_lengths_decode_as_alone():
    model = tiny_model(sliding_window=5, full_attention_layers=2)
    docs = held_out_documents()
    starts = [prompt_length(doc, 1 + i % 3) for i, doc in enumerate(docs)]
    budgets = [BUDGET - i for i in range(len(docs))]
    alone = [greedy_generate(model, [prompt(d, s)], [b], frozenset())[0] for d, s, b in zip(docs, starts, budgets)]
    together = greedy_generate(model, [prompt(d, s) for d, s in zip(docs, starts)], budgets, frozenset())
    assert together == alone
    assert [len(tokens) for tokens in together] == budgets


def test_decoding_stops_before_a_stop_token():
    model = tiny_model()
    doc = held_out_documents()[0]
    start = prompt_length(doc)
    free = greedy_generate(model, [prompt(doc, start)], [BUDGET], frozenset())[0]
    third = free[2]
    stopped = greedy_generate(model, [prompt(doc, start)], [BUDGET], frozenset({third}))[0]
    assert stopped == free[: free.index(third)]
    assert greedy_recompute(model, doc, start, BUDGET, frozenset({third}), BYTE_TOKENIZER) == stopped


def test_stop_tokens_are_eos_and_the_end_of_turn(tmp_path: Path):
    assert stop_ids(BYTE_TOKENIZER) == frozenset(range(256, BYTE_TOKENIZER.vocab_size))
    assert EOS_ID in stop_ids(BYTE_TOKENIZER)
    tokenizer = HFTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok"))
    stops = stop_ids(tokenizer)
    assert tokenizer.eos_id in stops
    assert tokenizer.backend.token_to_id("<|im_end|>") in stops
    assert not stops & set(tokenizer.encode("the red circle is on a white box"))


def test_the_answer_of_a_conversation_is_its_last_reply():
    ids = torch.arange(100, 112)
    labels = torch.full_like(ids, -100)
    labels[2:4] = ids[3:5]  # a first reply: tokens 3 and 4
    labels[7:11] = ids[8:12]  # the last one: tokens 8 to 11
    doc = Document("image", ids, labels, *[torch.zeros(0)] * 6)
    # a template: targets mark the replies
    chat = SimpleNamespace(chat_template="{{ messages }}", placeholder_ids={}, eos_id=-1)
    assert answer_start(doc, chat) == 8
    assert answer_start(dataclasses.replace(doc, labels=torch.full_like(ids, -100)), chat) is None
    labels[9] = -100  # token 10 untrained: the document's EOS (11) stands apart, and is no answer of its own
    ending = SimpleNamespace(chat_template="{{ messages }}", placeholder_ids={}, eos_id=int(ids[11]))
    assert answer_start(doc, ending) == 8
    caption = held_out_documents()[0]  # byte tokenizer: the caption after the last placeholder
    assert answer_start(caption, BYTE_TOKENIZER) == int((caption.input_ids > 255).nonzero()[-1]) + 1


def test_answers_are_scored_on_normalised_words():
    assert answer_exact_match(" The  Red\ncircle ", "the red circle") == 1.0
    assert answer_exact_match("red circle", "the red circle") == 0.0
    assert answer_token_f1("red circle", "the red circle") == pytest.approx(2 * 1.0 * (2 / 3) / (1 + 2 / 3))
    assert answer_token_f1("blue", "the red circle") == 0.0
    assert answer_token_f1("", "") == 1.0 and answer_token_f1("", "red") == 0.0


@pytest.mark.parametrize("style", ["chatml", "llama"])
def test_held_out_conversations_are_answered_and_scored(tmp_path: Path, style: str):
    """LLaVA conversations through the loader with a pretrained tokenizer: each document is prompted up to its
    last reply (the generation prompt included), the reference is that reply, decoding stops at the template's
    end of turn, and the task scores carry the answer metrics."""
    tokenizer = HFTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok", style))
    llava = write_llava(tmp_path / "data", 6)
    cfg = DataConfig(source="jsonl", seq_len=1024, heldout_fraction=0.01)
    batch = next(iter(PackedLoader(ManifestDataset(llava["json"], cfg, tokenizer), cfg, "train")))
    args = build_model("debug", patch_size=cfg.patch_size, n_mels=cfg.n_mels, seed=0).args
    model = OmniModel(dataclasses.replace(args, llm=dataclasses.replace(args.llm, vocab_size=tokenizer.vocab_size)))
    model.init_weights(1)
    merge = args.spatial_merge
    docs = list(
        documents(
            batch,
            tokenizer,
            lambda rows, cols: math.prod(merged_grid(rows, cols, merge)),
            lambda *grid: video_tokens(*grid, args.temporal_merge, merge),
        )
    )
    assert len(docs) == batch.num_samples > 1
    for doc in docs:
        start = answer_start(doc, tokenizer)
        assert start is not None
        prompt_text = tokenizer.decode(doc.input_ids[:start].tolist(), skip_special_tokens=False)
        assert prompt_text.endswith(("<|im_start|>assistant\n", "<|start_header_id|>assistant<|end_header_id|>\n\n"))
    pairs = answer_documents(model.eval(), docs, tokenizer, max_new=6, max_len=cfg.seq_len, batch_size=4)
    last_replies = {record["conversations"][-1]["value"] for record in json.loads(llava["json"].read_text())}
    assert len(pairs) == len(docs) and {reference.strip() for _, reference in pairs} <= last_replies
    score = task_scores({"image": pairs})["image"]
    assert score.samples == len(docs) and 0 <= score.answer_token_f1 <= 1 and 0 <= score.answer_exact_match <= 1
    perfect = task_scores({"image": [(reference.upper(), reference) for _, reference in pairs]})["image"]
    assert perfect.answer_exact_match == perfect.answer_token_f1 == 1.0 and perfect.exact_match == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where there is no CUDA device")
def test_evaluation_on_cuda_without_a_gpu_is_refused_by_name(tmp_path: Path):
    assert eval_device(build_recipe(tmp_path)) == torch.device("cpu")  # auto: the CPU here
    with pytest.raises(ValueError, match=r"eval\.device=cuda"):
        eval_device(build_recipe(tmp_path, {"eval.device": "cuda"}))

"""Greedy answers to held-out documents, decoded with a KV cache: the task metric of evaluation.

A byte-tokenizer document is `BOS, placeholders..., caption bytes..., EOS`: the prompt runs to the last
placeholder and the caption is the reference (on the synthetic data each caption word is an attribute of the
input, so word accuracy is attribute accuracy). A conversation's document marks its targets in `labels` (the
assistant replies): the prompt runs to where the last reply starts, which is the conversation up to its last
user turn with the generation prompt (`data.chat` locates replies by rendering exactly that), and the reply is
the reference.

Generation embeds each prompt with its media once, prefills all prompts of a batch in one forward (left-padded,
`KVCache`) and then decodes one token per step for all of them, on the model's device.

Works on `PackedBatch` alone: a batch is split into its documents by `cu_seqlens`, and each document's
images, clips and videos are found by counting its placeholders, so nothing here depends on the data source.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omni_core.common.batch import MODALITY_IDS, PackedBatch, audio_tokens
from omni_core.common.tokenizer import HFTokenizer, Tokenizer
from omni_core.models.kv_cache import KVCache
from omni_core.models.omni import OmniModel

MODALITY_NAMES = {index: name for name, index in MODALITY_IDS.items()}


@dataclass
class Document:
    modality: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    image_patches: torch.Tensor
    image_grids: torch.Tensor
    audio_mels: torch.Tensor
    audio_frames: torch.Tensor
    video_patches: torch.Tensor
    video_grids: torch.Tensor

    def with_tokens(self, ids: torch.Tensor, tokenizer: Tokenizer) -> PackedBatch:
        """`ids` (a prefix of this document, maybe extended by decoding) as a one-document batch with all of
        the document's encoder inputs."""
        return PackedBatch(
            input_ids=ids,
            labels=torch.full_like(ids, -100),
            position_ids=torch.arange(len(ids)),
            cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32),
            loss_modality=torch.full_like(ids, MODALITY_IDS[self.modality]),
            image_patches=self.image_patches,
            image_grids=self.image_grids,
            audio_mels=self.audio_mels,
            audio_frames=self.audio_frames,
            video_patches=self.video_patches,
            video_grids=self.video_grids,
            num_samples=1,
            tokenizer=tokenizer,
        )


def documents(
    batch: PackedBatch,
    tokenizer: Tokenizer,
    tokens_per_image: Callable[[int, int], int],
    tokens_per_video: Callable[[int, int, int], int],
    audio_pool: int = 1,
) -> Iterator[Document]:
    """The batch's real documents, each with its own images, clips and videos (padding documents are skipped);
    `audio_pool`: the model's (`AudioArgs.pool`), which sets a clip's placeholders."""
    bounds = batch.cu_seqlens.tolist()
    placeholder = tokenizer.placeholder_ids
    image, patch, clip, frame, video, video_patch = 0, 0, 0, 0, 0, 0
    for doc, (start, end) in enumerate(itertools.pairwise(bounds)):
        ids = batch.input_ids[start:end]
        n_images, n_audio_tokens = int((ids == placeholder["image"]).sum()), int((ids == placeholder["audio"]).sum())
        first_image, first_patch = image, patch
        while n_images > 0:
            rows, cols = batch.image_grids[image].tolist()
            n_images -= tokens_per_image(rows, cols)
            patch, image = patch + rows * cols, image + 1
        first_clip, first_frame = clip, frame
        while n_audio_tokens > 0:
            frames = int(batch.audio_frames[clip])
            n_audio_tokens -= audio_tokens(frames, audio_pool)
            frame, clip = frame + frames, clip + 1
        first_video, first_video_patch, n_video_tokens = video, video_patch, int((ids == placeholder["video"]).sum())
        while n_video_tokens > 0:
            frames, rows, cols = batch.video_grids[video].tolist()
            n_video_tokens -= tokens_per_video(frames, rows, cols)
            video_patch, video = video_patch + frames * rows * cols, video + 1
        if doc in batch.layout.padding_docs:
            continue
        yield Document(
            MODALITY_NAMES[int(batch.loss_modality[start])],
            ids,
            batch.labels[start:end],
            batch.image_patches[first_patch:patch],
            batch.image_grids[first_image:image],
            batch.audio_mels[first_frame:frame],
            batch.audio_frames[first_clip:clip],
            batch.video_patches[first_video_patch:video_patch],
            batch.video_grids[first_video:video],
        )


def answer_start(doc: Document, tokenizer: Tokenizer) -> int | None:
    """Where the answer to generate starts in `doc` (its prompt's length); None for a document with nothing to
    answer (a text-only caption document, a conversation without targets)."""
    if tokenizer.chat_template is None:  # a caption after its media
        media = torch.isin(doc.input_ids, torch.tensor(list(tokenizer.placeholder_ids.values()))).nonzero()
        return int(media[-1]) + 1 if len(media) else None
    targets = ((doc.labels != -100).nonzero().flatten() + 1).tolist()  # labels[i] is token i + 1
    if len(targets) > 1 and targets[-2] != targets[-1] - 1 and int(doc.input_ids[targets[-1]]) == tokenizer.eos_id:
        targets.pop()  # the document's EOS, after a template whose end of turn carries no target next to it
    if not targets:
        return None
    start = targets[-1]
    while targets and targets[-1] == start:  # back over the last reply's contiguous run
        targets.pop()
        start -= 1
    return start + 1


def stop_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """EOS and every special token: the template's end of turn (`<|im_end|>`) is one, and no answer holds one."""
    if isinstance(tokenizer, HFTokenizer):
        decoder = tokenizer.backend.get_added_tokens_decoder()
        special = {int(token_id) for token_id, token in decoder.items() if token.special}
    else:  # the byte tokenizer: its ids above the bytes decode to nothing
        special = {i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == ""}
    return frozenset(special | {tokenizer.eos_id})


@torch.no_grad()
def greedy_generate(
    model: OmniModel, prompts: list[PackedBatch], budgets: list[int], stop: frozenset[int]
) -> list[list[int]]:
    """Greedy continuations of one-document `prompts`, at most `budgets[i]` tokens each, ending before a `stop`
    token: prompts embedded (media encoded) once, prefilled together, then one cached step per token."""
    if not prompts:
        return []
    device = next(model.parameters()).device
    embeds = [model.embed(prompt.to(device)) for prompt in prompts]
    longest = max(len(e) for e in embeds)
    cache = KVCache(torch.tensor([longest - len(e) for e in embeds], device=device))
    padded = torch.stack([F.pad(e, (0, 0, longest - len(e), 0)) for e in embeds])
    logits = model.llm.forward_cached(padded, cache)[:, -1]
    out: list[list[int]] = [[] for _ in prompts]
    done = [budget <= 0 for budget in budgets]
    while not all(done):
        tokens = logits.argmax(-1)
        for row, token in enumerate(tokens.tolist()):  # one host read per step for the whole batch
            if not done[row]:
                done[row] = token in stop
                if not done[row]:
                    out[row].append(token)
                    done[row] = len(out[row]) >= budgets[row]
        if not all(done):
            logits = model.llm.forward_cached(model.llm.embed(tokens[:, None]), cache)[:, 0]
    return out


@torch.no_grad()
def greedy_recompute(
    model: OmniModel, doc: Document, start: int, budget: int, stop: frozenset[int], tokenizer: Tokenizer
) -> list[int]:
    """What `greedy_generate` computes, by re-running the whole model (encoders included) for every token:
    the reference its cache is tested and benchmarked against."""
    device = next(model.parameters()).device
    generated: list[int] = []
    ids = doc.input_ids[:start]
    for _ in range(budget):
        token = int(model(doc.with_tokens(ids, tokenizer).to(device))[-1].argmax())
        if token in stop:
            break
        generated.append(token)
        ids = torch.cat([ids, ids.new_tensor([token])])
    return generated


def answer_documents(
    model: OmniModel, docs: list[Document], tokenizer: Tokenizer, max_new: int, max_len: int, batch_size: int
) -> list[tuple[str, str]]:
    """(decoded, reference) for each of `docs` that has an answer, generated `batch_size` prompts at a time;
    prompt and answer stay within `max_len` tokens (training's sequence length)."""
    starts = [(doc, start) for doc in docs if (start := answer_start(doc, tokenizer)) is not None]
    stop = stop_ids(tokenizer)
    pairs = []
    for first in range(0, len(starts), batch_size):
        chunk = starts[first : first + batch_size]
        prompts = [doc.with_tokens(doc.input_ids[:start], tokenizer) for doc, start in chunk]
        budgets = [min(max_new, max_len - start) for _, start in chunk]
        for (doc, start), ids in zip(chunk, greedy_generate(model, prompts, budgets, stop), strict=True):
            pairs.append((tokenizer.decode(ids), tokenizer.decode(doc.input_ids[start:].tolist())))
    return pairs


def word_accuracy(decoded: str, reference: str) -> float:
    """Share of reference words reproduced at their position."""
    ref, got = reference.split(), decoded.split()
    return sum(a == b for a, b in zip(ref, got, strict=False)) / max(len(ref), 1)


def normalised_words(text: str) -> list[str]:
    """Lower-case words, whitespace collapsed: answers are compared on these."""
    return re.sub(r"\s+", " ", text).strip().lower().split()


def answer_exact_match(decoded: str, reference: str) -> float:
    return float(normalised_words(decoded) == normalised_words(reference))


def answer_token_f1(decoded: str, reference: str) -> float:
    """F1 of the normalised words shared by answer and reference (SQuAD's token F1)."""
    got, ref = normalised_words(decoded), normalised_words(reference)
    if not got or not ref:
        return float(got == ref)
    common = sum((Counter(got) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(ref)
    return 2 * precision * recall / (precision + recall)

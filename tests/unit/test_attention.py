"""Attention over packed documents (omni_core/models/attention.py): every path against a dense fp64 reference,
forward and backward where the path has a backward on CPU (GQA, sliding windows, padding documents, an empty
document); the varlen path's call (one per layer, int32 offsets, host max length, padding left out) through a
stand-in for the CUDA kernel, and the real kernel where CUDA is; choosing a path (auto, the recipe's refusals);
no host reads; compiled blocks that never recompile for a new layout."""

from __future__ import annotations

import itertools
import re
from typing import get_args

import pytest
import torch
from torch import nn

from omni_core.common.batch import BatchLayout
from omni_core.models import attention
from omni_core.models.args import ATTENTION_KINDS, LLMArgs, VarlenSupport, attention_problem
from omni_core.models.attention import (
    DocumentAttention,
    flash_varlen_attention,
    flex_document_attention,
    sdpa_document_attention,
    set_attention,
    varlen_attention,
)
from omni_core.models.documents import PackedDocuments
from omni_core.models.llm import LLM
from omni_core.recipe.model_sections import ModelConfig

# 7 documents over 40 tokens: an empty one (index 1), two padding ones side by side (3, 4), one longer than the
# window below (the last, 14 tokens), one of a single token (5).
OFFSETS = (0, 9, 9, 15, 19, 23, 24, 26, 40)
PADDING = frozenset({3, 4})
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def dense_reference(q, k, v, docs: PackedDocuments, causal: bool, window: int | None = None) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) + mask) V with every rule written out as a [T, T] mask; padding rows are 0."""
    doc = torch.repeat_interleave(torch.arange(len(docs.offsets) - 1), torch.tensor(docs.offsets).diff())
    position = torch.arange(q.shape[0])
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= position[None, :] <= position[:, None]
    if window is not None:
        mask &= position[:, None] - position[None, :] < window
    mask &= ~torch.isin(doc, torch.tensor(sorted(docs.padding), dtype=torch.long))[:, None]
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)  # fully masked rows -> 0
    return torch.einsum("hqk,khd->qhd", probs, v)


def packed_qkv(tokens: int = OFFSETS[-1], kv_heads: int = KV_HEADS, dtype=torch.float64, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(tokens, kv_heads, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in range(2))
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v)]


def forward_backward(attend, q, k, v, *args):
    """Output and q/k/v gradients of `attend` against a fixed random output gradient."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = attend(*leaves, *args)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype).to(out.device))
    return [out.detach(), *(x.grad for x in leaves)]


def assert_all_close(actual, expected, atol: float) -> None:
    for name, a, b in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=name)


CASES = [(causal, window, kv) for causal, window, kv in itertools.product((True, False), (None, 4), (KV_HEADS, HEADS))]
CASES = [case for case in CASES if case[0] or case[1] is None]  # a window is causal


@pytest.mark.parametrize("causal, window, kv_heads", CASES)
def test_sdpa_loop_matches_the_reference_forward_and_backward(causal, window, kv_heads):
    docs = PackedDocuments(OFFSETS, PADDING)
    q, k, v = packed_qkv(kv_heads=kv_heads)
    expected = forward_backward(dense_reference, q, k, v, docs, causal, window)
    assert_all_close(forward_backward(sdpa_document_attention, q, k, v, docs, causal, window), expected, 1e-10)
    padding_rows = slice(OFFSETS[3], OFFSETS[5])
    assert not expected[0][padding_rows].any() and expected[0][OFFSETS[2] : OFFSETS[3]].abs().sum() > 0


@pytest.mark.parametrize("causal, window, kv_heads", CASES)
def test_flex_matches_the_reference_forward(causal, window, kv_heads):
    # flex_attention has no backward on CPU (the recipe check refuses it there)
    docs = PackedDocuments(OFFSETS, PADDING)
    q, k, v = (x.detach() for x in packed_qkv(kv_heads=kv_heads))
    out = flex_document_attention(q, k, v, docs, causal, window)
    torch.testing.assert_close(out, dense_reference(q, k, v, docs, causal, window), rtol=0, atol=1e-10)


class VarlenStandIn:
    """`varlen_attn` as the CUDA kernel computes it (the dense reference over its cu_seqlens and window), taking
    the arguments the installed torch's signature has; records what each call got."""

    def __init__(self, support: VarlenSupport):
        self.support, self.calls = support, []

    def __call__(self, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **options):
        expected = {"window_size"} if self.support.windows else {"is_causal"}
        assert expected <= options.keys() <= expected | ({"enable_gqa"} if self.support.gqa else set())
        assert k.shape[1] == q.shape[1] or options.get("enable_gqa")
        self.calls.append({"cu": cu_seq_q, "max": (max_q, max_k), "tokens": q.shape[0], **options})
        left, right = options.get("window_size", (-1, 0 if options.get("is_causal") else -1))
        docs = PackedDocuments.of(cu_seq_q)
        return dense_reference(q, k, v, docs, causal=right == 0, window=None if left < 0 else left + 1)


SUPPORTS = [VarlenSupport(True, True), VarlenSupport(True, False), VarlenSupport(False, False)]  # by torch version


@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("causal, window, kv_heads", CASES)
def test_varlen_makes_one_call_without_padding(monkeypatch, support, causal, window, kv_heads):
    stand_in = VarlenStandIn(support)
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", stand_in)
    monkeypatch.setattr(attention, "varlen_support", lambda: support)
    docs = PackedDocuments(OFFSETS, PADDING)
    q, k, v = packed_qkv(kv_heads=kv_heads)
    if window is not None and not support.windows:
        with pytest.raises(ValueError, match="no window_size"):
            flash_varlen_attention(q, k, v, docs, causal, window)
        return
    actual = forward_backward(flash_varlen_attention, q, k, v, docs, causal, window)
    assert_all_close(actual, forward_backward(dense_reference, q, k, v, docs, causal, window), 1e-10)
    (call,) = stand_in.calls  # one call for all documents
    # no padding, no empty document
    assert call["cu"].dtype == torch.int32 and call["cu"].tolist() == [0, 9, 15, 16, 18, 32]
    assert call["max"] == (14, 14) and call["tokens"] == 32
    if support.windows:
        assert call["window_size"] == (-1 if window is None else window - 1, 0 if causal else -1)
    assert call.get("enable_gqa", False) == (support.gqa and kv_heads != HEADS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen_attn (FlashAttention) runs on CUDA only")
@pytest.mark.parametrize("window", [None, 4])
def test_varlen_kernel_matches_the_sdpa_loop_on_cuda(window):
    docs = PackedDocuments(OFFSETS, PADDING)
    q, k, v = packed_qkv(dtype=torch.bfloat16, device="cuda")
    assert attention.resolve_attention("auto", q, window is not None) == "varlen"
    expected = forward_backward(sdpa_document_attention, q, k, v, docs, True, window)
    actual = forward_backward(varlen_attention, q, k, v, docs, True, window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), actual, expected):
        error = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        assert error < 2e-2, (name, error)  # bf16 keeps 8 bits: both kernels round alike to about 1% of the scale


def test_auto_takes_the_sdpa_loop_on_cpu_and_an_explicit_varlen_is_refused():
    q, k, v = packed_qkv()
    assert attention.resolve_attention("auto", q) == "sdpa"
    with pytest.raises(ValueError, match="model.attention=varlen: varlen .* runs on CUDA GPUs only"):
        varlen_attention(q, k, v, OFFSETS, True, kind="varlen")
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the 40 tokens"):
        varlen_attention(q, k, v, [0, 5, 39], True)


@pytest.mark.parametrize("kind, device, dtype, support, head_dims, window, problem", [
    ("auto", "cpu", "float32", None, (12,), True, None),
    ("sdpa", "cuda", "float32", None, (12,), True, None),
    ("flex", "cuda", "bfloat16", None, (64,), True, None),
    ("flex", "cpu", "float32", None, (64,), False, "flex_attention has no backward on cpu"),
    ("varlen", "cpu", "bfloat16", VarlenSupport(True, True), (64,), False, "CUDA GPUs only"),
    ("varlen", "cuda", "bfloat16", None, (64,), False, "this torch has no torch.nn.attention.varlen"),
    ("varlen", "cuda", "float32", VarlenSupport(True, True), (64,), False, "bfloat16 or float16, not float32"),
    ("varlen", "cuda", "bfloat16", VarlenSupport(True, True), (64, 12, 320), False, r"not \[12, 320\]"),
    ("varlen", "cuda", "bfloat16", VarlenSupport(False, False), (64,), True, "no window_size"),
    ("varlen", "cuda", "bfloat16", VarlenSupport(False, False), (64,), False, None),
    ("dense", "cuda", "bfloat16", None, (64,), False, "must be one of auto, sdpa, flex, varlen"),
])
def test_attention_problem(kind, device, dtype, support, head_dims, window, problem):
    found = attention_problem(kind, device, dtype, support, head_dims, window)
    assert found is None if problem is None else found is not None and re.search(problem, found), found


def test_the_recipe_offers_the_models_kinds_and_refuses_what_cannot_run_here(tmp_path):
    from omni_core.recipe import RecipeError
    from omni_core.runtime.preflight import check_launch
    from tests.helpers.recipes import build_recipe

    assert get_args(ModelConfig.model_fields["attention"].annotation) == ATTENTION_KINDS
    with pytest.raises(RecipeError, match="model.attention"):
        build_recipe(tmp_path, {"model.attention": "dense"})
    for kind, message in [("varlen", "runs on CUDA GPUs only"), ("flex", "no backward on cpu")]:
        with pytest.raises(RecipeError, match=f"model.attention: .*{message}"):
            check_launch(build_recipe(tmp_path, {"model.attention": kind}))
    check_launch(build_recipe(tmp_path, {"model.attention": "sdpa"}))
    same = build_recipe(tmp_path, {"model.attention": "sdpa"}).training_hash() == build_recipe(tmp_path).training_hash()
    assert same  # how attention runs does not make another model


def tiny_llm(**options) -> LLM:
    torch.manual_seed(0)
    return LLM(LLMArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, **options))


def layout(offsets, padding=()) -> BatchLayout:
    return BatchLayout(tuple(offsets), (), (), (), 0, 0, {}, tuple(padding))


def llm_inputs(offsets):
    ids = torch.randint(0, 64, (offsets[-1],), generator=torch.Generator().manual_seed(offsets[-1]))
    positions = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(offsets)])
    return ids, positions, torch.tensor(offsets, dtype=torch.int32)


def test_the_llm_reads_no_tensor_on_the_host_given_the_layout_and_skips_padding():
    from omni_core.runtime.sync_count import count_host_syncs

    llm = tiny_llm(sliding_window=4, full_attention_layers=1)
    ids, positions, cu_seqlens = llm_inputs(OFFSETS)
    with count_host_syncs() as syncs:
        out = llm(llm.embed(ids), positions, cu_seqlens, layout(OFFSETS, PADDING))
        out.sum().backward()
    assert syncs.total == 0, syncs.by_site
    with torch.no_grad():  # documents never mix: attending the padding or not changes no other row
        attended = llm(llm.embed(ids), positions, cu_seqlens)
    real = torch.ones(OFFSETS[-1], dtype=torch.bool)
    real[OFFSETS[3] : OFFSETS[5]] = False
    torch.testing.assert_close(out[real], attended[real], rtol=0, atol=1e-6)


def test_set_attention_reaches_every_attention_of_the_model():
    from omni_core.models.omni import build_model
    from tests.helpers.models import N_MELS, PATCH_SIZE

    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    modules = [m for m in model.modules() if isinstance(m, DocumentAttention)]
    assert {type(m).__name__ for m in modules} == {"Attention", "EncoderAttention"}
    assert all(m.kind == "auto" for m in modules)
    set_attention(model, "flex")
    assert all(m.kind == "flex" for m in modules)


def test_compiled_blocks_compile_once_for_every_layout_and_token_count():
    """Inductor (gcc is here) on a 2-block LLM and a 1-block encoder (which hands its offsets as a list): the
    first batch compiles, three more with other documents, padding and token counts compile nothing, and every
    one matches the eager model."""
    from omni_core.models.attention import EncoderBlock
    from omni_core.parallel.parallelize import apply_compile, compiled_graphs

    compiled, eager = tiny_llm(), tiny_llm()
    encoders = [EncoderBlock(32, 4, 2.0) for _ in range(2)]
    encoders[1].load_state_dict(encoders[0].state_dict())
    holder = nn.Module()
    holder.llm, holder.vision = compiled, nn.Module()
    holder.vision.layers = nn.ModuleList(encoders[:1])
    apply_compile(holder)  # type: ignore[arg-type]  # what it reads of an OmniModel: `llm` and `vision`
    counts = []
    for offsets, padding in [
        ((0, 10, 40, 64), (2,)),
        ((0, 5, 6, 50, 90, 100), ()),
        ((0, 77), ()),
        ((0, 3, 4, 9, 33, 48), (3, 4)),
    ]:
        ids, positions, cu_seqlens = llm_inputs(offsets)
        results = []
        for llm, encoder in ((compiled, holder.vision.layers[0]), (eager, encoders[1])):
            llm.zero_grad()
            out = llm(llm.embed(ids), positions, cu_seqlens, layout(offsets, padding))
            encoded = encoder(out.detach()[:, :32], list(offsets))
            (out.square().mean() + encoded.square().mean()).backward()
            results.append((out.detach(), encoded.detach(), llm.tok_embeddings.weight.grad))
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-5)
        counts.append(compiled_graphs())
    assert counts[0] > 0 and counts[1:] == counts[:1] * 3, counts

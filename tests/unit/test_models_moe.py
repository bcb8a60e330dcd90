"""MoE routing and aux loss, and no information flow across packed documents, images or clips (gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.models.omni import OmniModel, build_model
from omni_core.models.args import MoEArgs
from omni_core.models.feed_forward import MoE, load_balancing_loss
from tests.helpers.models import N_MELS, PATCH_SIZE, make_batch


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over the k largest router logits, weighted sum of those experts (+ shared)."""
    out = []
    for token in x:
        logits = moe.router(token)
        top = logits.topk(moe.args.top_k).indices
        weights = logits[top].softmax(dim=0)
        y = sum(w * moe.experts[str(int(e))](token) for w, e in zip(weights, top))
        out.append(y + (moe.shared_expert(token) if moe.shared_expert is not None else 0))
    return torch.stack(out)


@pytest.mark.parametrize("shared", [False, True])
def test_every_token_reaches_exactly_k_experts(shared: bool) -> None:
    torch.manual_seed(0)
    moe = MoE(16, 24, MoEArgs(num_experts=4, top_k=2, shared_expert=shared))
    x = torch.randn(33, 16)
    x[:, 0] = 3.0
    with torch.no_grad():
        moe.router.weight[0, 0] = 10.0  # skew: every token prefers expert 0, which must still take them all
    seen = []
    hook = moe.experts.register_forward_hook(lambda mod, inp, out: seen.append(inp[1].tolist()))
    out = moe(x)
    hook.remove()
    _, experts, weights = moe.route(x)
    assert sum(seen[0]) == 33 * 2 and max(seen[0]) == 33  # T * k assignments, the favourite takes every token
    assert all(len(set(row)) == 2 for row in experts.tolist())  # k distinct experts per token
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(33))
    torch.testing.assert_close(out, naive_moe(moe, x), rtol=0, atol=1e-5)


def test_load_balancing_loss_by_hand() -> None:
    # One token, router probabilities (0.5, 0.3, 0.2), top-2: it fills slots of experts 0 and 1, so
    # f = (1/2, 1/2, 0), P = (0.5, 0.3, 0.2): loss = E * sum f * P = 3 * (0.25 + 0.15) = 1.2
    moe = MoE(3, 4, MoEArgs(num_experts=3, top_k=2))
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(3))
    moe(torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]]))
    assert moe.aux_loss.item() == pytest.approx(1.2)
    # Perfectly balanced: 2 tokens, each certain of a different expert, k = 1 -> 2 * (1/2 * 1/2 * 2) = 1
    probs = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert load_balancing_loss(probs, torch.tensor([[0], [1]]), 2).item() == pytest.approx(1.0)


def test_model_exposes_the_weighted_aux_loss() -> None:
    model = build_model("debug-moe", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    batch = make_batch([[("text", 12)], [("text", 9), ("image", (2, 2))]])
    logits = model(batch)
    layers = [layer.moe.aux_loss for layer in model.llm.layers.values()]
    coef = model.args.llm.moe.aux_loss_coef
    torch.testing.assert_close(model.aux_loss, coef * torch.stack(layers).sum())
    (logits.logsumexp(-1).mean() + model.aux_loss).backward()
    assert all(layer.moe.router.weight.grad.abs().sum() > 0 for layer in model.llm.layers.values())
    dense = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    dense(batch)
    assert dense.aux_loss.item() == 0.0


@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_no_gradient_crosses_packed_documents(flavor: str) -> None:
    """d(outputs of one document) / d(inputs of another) is exactly zero: text embeddings, image patches and
    mel frames alike, from an earlier document to a later one and back."""
    model: OmniModel = build_model(flavor, patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)
    # doc 0: 4 text + image (2x2) + audio (8 frames -> 4 tokens) + 3 text = 15 tokens;
    # doc 1: 5 text + image (2x3) + audio (6 frames -> 3 tokens) = 14 tokens.
    docs = [[("text", 4), ("image", (2, 2)), ("audio", 8), ("text", 3)], [("text", 5), ("image", (2, 3)), ("audio", 6)]]
    batch = make_batch(docs)
    tokens, patches, frames = [slice(0, 15), slice(15, 29)], [slice(0, 4), slice(4, 10)], [slice(0, 8), slice(8, 14)]
    embeds = []

    def keep_grad(module, inputs, out):
        out.retain_grad()
        embeds.append(out)

    model.llm.tok_embeddings.register_forward_hook(keep_grad)
    for target in (0, 1):
        batch.image_patches.requires_grad_(True).grad = None
        batch.audio_mels.requires_grad_(True).grad = None
        model(batch)[tokens[target]].square().sum().backward()
        other = 1 - target
        grads = [(embeds[-1].grad, tokens), (batch.image_patches.grad, patches), (batch.audio_mels.grad, frames)]
        for grad, parts in grads:
            assert torch.count_nonzero(grad[parts[other]]) == 0
            assert torch.count_nonzero(grad[parts[target]]) > 0


def test_grouped_experts_match_one_call_per_expert_forward_and_backward() -> None:
    """The grouped GEMM over stacked weights (the default) against the fallback's one call per expert, with an
    expert left without tokens: outputs and every gradient equal, the idle expert's gradient zero."""
    torch.manual_seed(0)
    experts = MoE(16, 24, MoEArgs(num_experts=4, top_k=2)).experts
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(16, 16)
    grad = torch.randn(16, 16)
    results = []
    for run in (experts, experts.per_expert):
        rows = x.clone().requires_grad_()
        experts.zero_grad()
        run(rows, counts).backward(grad)
        results.append((rows.grad, {name: p.grad.clone() for name, p in experts.named_parameters()}))
    (grouped_x, grouped), (loop_x, loop) = results
    torch.testing.assert_close(grouped_x, loop_x)
    for name, value in grouped.items():
        torch.testing.assert_close(value, loop[name], msg=name)
    assert all(grouped[f"1.{w}.weight"].abs().sum() == 0 for w in ("w1", "w2", "w3"))


def test_moe_routes_without_reading_the_host() -> None:
    from omni_core.runtime.sync_count import count_host_syncs

    moe = MoE(16, 24, MoEArgs(num_experts=4, top_k=2, shared_expert=True))
    x = torch.randn(20, 16, requires_grad=True)
    with count_host_syncs() as counter:
        (moe(x).sum() + moe.aux_loss).backward()
    assert counter.total == 0, counter.summary()

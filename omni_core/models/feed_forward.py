"""The LLM's feed-forward layers: the gated FFN and a mixture of such experts with its load-balancing loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omni_core.models.args import MoEArgs

GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class FeedForward(nn.Module):
    """Gated FFN: w2(act(w1 x) * w3 x), SwiGLU with the default silu."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.act = GATE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def load_balancing_loss(
    probs: torch.Tensor, experts: torch.Tensor, num_experts: int, sequence_group=None
) -> torch.Tensor:
    """Switch Transformer auxiliary loss, E * sum_e f_e * P_e: f_e is the share of the T*k routing slots that
    went to expert e, P_e the mean router probability of e. Equals 1 under perfectly uniform routing.

    `sequence_group`: ranks that hold parts of the same sequences (context parallelism). Their routing
    statistics are summed (the probabilities through a differentiable all-reduce), so every rank gets the
    loss of the whole sequence, as one process would."""
    counts = torch.bincount(experts.flatten(), minlength=num_experts).to(probs.dtype)
    prob_sums = probs.sum(dim=0)
    tokens = torch.tensor([float(probs.shape[0])], dtype=probs.dtype, device=probs.device)
    if sequence_group is not None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol  # differentiable: backward sums the gradients

        dist.all_reduce(counts, group=sequence_group)
        dist.all_reduce(tokens, group=sequence_group)
        prob_sums = funcol.all_reduce(prob_sums, "sum", sequence_group)
    return num_experts * torch.dot(counts / (tokens * experts.shape[-1]), prob_sums / tokens)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (+ optional shared expert). Every token reaches its k experts: no capacity
    factor, no dropping. `aux_loss` holds the last forward's load-balancing loss (unweighted).

    `experts` is keyed by the global expert index, so that an expert-parallel rank can keep only its own
    experts while every parameter keeps its global name (`experts.<e>.w1.weight`): checkpoints then reshard
    between plans. The forward runs the experts present."""

    def __init__(self, dim: int, hidden: int, args: MoEArgs, activation: str = "silu"):
        super().__init__()
        self.args = args
        self.router = nn.Linear(dim, args.num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): FeedForward(dim, hidden, activation) for e in range(args.num_experts)})
        shared_hidden = args.shared_hidden or hidden
        self.shared_expert = FeedForward(dim, shared_hidden, activation) if args.shared_expert else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_expert and args.shared_gate else None
        self.aux_loss: torch.Tensor | None = None
        self.sequence_group = None  # set under context parallelism, see load_balancing_loss

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> router probabilities [T, E], chosen experts [T, k], their weights [T, k]: the chosen probabilities,
        renormalised to sum 1 (a softmax over the k chosen logits, as Mixtral) unless `args.renormalize` is off."""
        probs = self.router(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.args.top_k, dim=-1)
        return probs, experts, weights / weights.sum(dim=-1, keepdim=True) if self.args.renormalize else weights

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output (gated under `shared_gate`), zeros without one: what routing adds to."""
        if self.shared_expert is None:
            return torch.zeros_like(x)
        out = self.shared_expert(x)
        return out if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, experts, weights = self.route(x)
        self.aux_loss = load_balancing_loss(probs, experts, self.args.num_experts, self.sequence_group)
        out = self.shared(x)
        for e, expert in self.experts.items():
            token, slot = torch.where(experts == int(e))
            # Every expert runs, even on no tokens, so all of them are in the autograd graph on every rank.
            y = expert(x[token]) * weights[token, slot, None].to(x.dtype)
            out = out.index_add(0, token, y)
        return out

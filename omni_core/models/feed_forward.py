"""The LLM's feed-forward layers: the gated FFN and a mixture of such experts with its load-balancing loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

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


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routing slots per expert (long [num_experts]) of the chosen experts `experts` [T, k], on their device.
    Not `bincount`: on CUDA it reads the largest index on the host (a sync) to size its output."""
    flat = experts.flatten()
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(
    probs: torch.Tensor, experts: torch.Tensor, num_experts: int, sequence_group=None
) -> torch.Tensor:
    """Switch Transformer auxiliary loss, E * sum_e f_e * P_e: f_e is the share of the T*k routing slots that
    went to expert e, P_e the mean router probability of e. Equals 1 under perfectly uniform routing.

    `sequence_group`: ranks that hold parts of the same sequences (context parallelism). Their routing
    statistics are summed (the probabilities through a differentiable all-reduce), so every rank gets the
    loss of the whole sequence, as one process would."""
    counts = expert_counts(experts, num_experts).to(probs.dtype)
    prob_sums = probs.sum(dim=0)
    tokens = probs.new_full((1,), float(probs.shape[0]))  # made on the device: no host-to-device copy
    if sequence_group is not None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol  # differentiable: backward sums the gradients

        dist.all_reduce(counts, group=sequence_group)
        dist.all_reduce(tokens, group=sequence_group)
        prob_sums = funcol.all_reduce(prob_sums, "sum", sequence_group)
    return num_experts * torch.dot(counts / (tokens * experts.shape[-1]), prob_sums / tokens)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...]) -> bool:
    """Whether `F.grouped_mm` (torch 2.11 and later: both read) multiplies expert groups for these operands
    without reading their offsets on the host. On CUDA only its CUTLASS path does: bf16 on sm90/sm100 (else it
    loops over `offs.cpu()`, a sync per call). On the CPU, any float dtype. Rows must be 16-byte multiples
    (`dims`). Elsewhere `Experts` falls back to one call per expert (`Experts.per_expert`)."""
    if any(d * dtype.itemsize % 16 for d in dims):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` [N, in] grouped by `offsets` (int32 ends), group g times `weights[g]` [out, in] transposed."""
    return F.grouped_mm(x, weights.transpose(-2, -1), offs=offsets)


class Experts(nn.Module):
    """The routed experts, keyed by global index (`experts.<e>.w1.weight`), run together over token rows
    sorted by expert: one grouped GEMM per projection over the experts' weights stacked at forward time, the
    groups delimited by offsets on the device, so no host read of how many tokens each expert got.

    A module of its own, so that FSDP can shard the experts apart from their block (expert parallelism). It
    holds them as a dict does, not as an nn.ModuleDict: torch 2.11's fully_shard refuses every ModuleDict, also
    one with a forward (2.12 takes those)."""

    def __init__(self, experts: dict[str, FeedForward], activation: str):
        super().__init__()
        for key, expert in experts.items():
            self.add_module(key, expert)
        self.act = GATE_ACTIVATIONS[activation]

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, key: str) -> nn.Module:
        return cast(nn.Module, self._modules[key])

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def values(self) -> list[nn.Module]:
        return [cast(nn.Module, expert) for expert in self._modules.values()]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows `x` [N, dim] sorted by expert, `counts[j]` of them for the j-th expert held -> [N, dim].
        Every expert is in the autograd graph, also on no rows: its gradient is then zero."""
        experts = [cast(FeedForward, expert) for expert in self.values()]
        first = experts[0]
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else first.w1.weight.dtype
        )
        dims = (first.w1.in_features, first.w1.out_features)
        if not grouped_mm_supported(x.device, dtype, dims):
            return self.per_expert(x, counts)
        offsets = counts.cumsum(0).to(torch.int32)
        w1, w2, w3 = (torch.stack([getattr(e, name).weight for e in experts]).to(dtype) for name in ("w1", "w2", "w3"))
        rows = x.to(dtype)
        hidden = self.act(grouped_mm(rows, w1, offsets)) * grouped_mm(rows, w3, offsets)
        return grouped_mm(hidden, w2, offsets)

    def per_expert(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The fallback without a grouped GEMM: one call per expert, on the rows its host-read count cuts (one
        host read per layer)."""
        chunks = x.split(counts.tolist())
        return torch.cat([expert(chunk) for expert, chunk in zip(self.values(), chunks, strict=True)])


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
        self.experts = Experts(
            {str(e): FeedForward(dim, hidden, activation) for e in range(args.num_experts)}, activation
        )
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
        # (token, slot) assignments sorted by expert (stably: by token within an expert).
        order = experts.flatten().argsort(stable=True)
        token = order // self.args.top_k
        y = self.experts(x[token], expert_counts(experts, self.args.num_experts))
        return out.index_add(0, token, (y * weights.flatten()[order, None].to(y.dtype)).to(out.dtype))

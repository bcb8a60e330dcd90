"""How a Cell's GPUs are shared out before the plan search prices anything: the pipeline depths it tries and,
for the `disaggregated` layout, how many GPUs the encoders get beside the LLM's.

Under `coupled` and `omni` every GPU of the Cell runs the LLM: a power-of-two Cell, split into pipeline stages
of equal rank counts, takes power-of-two depths.

Under `disaggregated` the search offers what DistTrain's orchestration chooses among (Zhang et al., SIGCOMM'25,
arXiv 2408.04275, §4 "disaggregated model orchestration": the GPU counts of the modality encoder and of the LLM
backbone, and each one's parallelism, are the variables of one minimisation of the training step's time, their
sum bounded by the cluster's GPUs, each part within its memory):

- the encoders' GPUs are counted in GPUs, not nodes (DistTrain's own runs are not whole 8-GPU nodes: 1,172
  GPUs for its 72B model, abstract); a part's time in its model falls as the part gets GPUs, so the best
  allocation leaves none idle: the encoders take every GPU the LLM leaves (`disaggregated_splits`);
- the LLM backbone is Megatron-LM's 3D parallelism (DistTrain is built on Megatron-LM, §6), so Megatron-LM's
  rules hold: TP inside a node; every pipeline stage the same number of layers, interleaved chunks too
  (`get_num_layers_to_build`: num_layers divisible by the pipeline size; `megatron_splits_layers`); data
  parallelism dividing the global batch with the micro-batch (its micro-batch calculator refuses the rest:
  no uneven batches over DP ranks, which the search's `search_plans` already requires of every plan).

So a Cell of 64 GPUs running a 36-layer LLM on a global batch of 32 can give the LLM 48 GPUs (pp3 x 16) and
the encoders 16, which k/8 splits of whole nodes with power-of-two depths never reached. Every split is one
the runtime runs: `disaggregated` takes any `encoders.ranks` >= 1 (the world's last ranks, `ParallelPlan.
encoder_ranks`) and any pipeline depth up to the layers (`parallel.pipeline.balance_layers`); a Cell of several
nodes keeps each LSSP group inside a node (`node_aligned`).
"""

from __future__ import annotations

import math

from omni_core.common.plan import ENCODER_KEYS, EncoderLayout, EncoderPlan, ParallelPlan
from omni_core.estimator.workloads import Workload


def powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def disaggregates(workload: Workload, layout: EncoderLayout) -> bool:
    """Whether `layout` gives the workload's encoders GPUs of their own (a text-only job has nothing to encode:
    its plans keep every GPU for the LLM)."""
    return layout == "disaggregated" and bool(workload.items.count)


def pipeline_depths(workload: Workload, num_gpus: int, layout: EncoderLayout = "omni") -> list[int]:
    """The LLM's pipeline depths the search tries on a Cell of `num_gpus`: powers of two up to the layers, or
    under `disaggregated` Megatron-LM's: every divisor of the layers that leaves the encoders a GPU."""
    layers = workload.shape.n_layers
    if disaggregates(workload, layout):
        return [p for p in divisors(layers) if p < num_gpus]
    return [p for p in powers_of_two(num_gpus) if p <= layers]


def disaggregated_splits(workload: Workload, num_gpus: int, pp: int, model_parallel: int) -> list[int]:
    """The encoder GPU counts of a `disaggregated` Cell of `num_gpus` whose LLM runs `pp` stages: the Cell less
    each LLM GPU count pp x (TP x CP: powers of two up to `model_parallel`, the most the search tries) x DP
    (a divisor of the global batch), ascending."""
    sizes = {pp * m * dp for m in powers_of_two(model_parallel) for dp in divisors(workload.global_batch)}
    return sorted(num_gpus - llm for llm in sizes if llm < num_gpus)


def megatron_splits_layers(plan: ParallelPlan, n_layers: int) -> bool:
    """Whether Megatron-LM builds `plan`'s pipeline: the same number of layers on every stage and chunk."""
    return n_layers % (plan.pp * plan.virtual_stages) == 0


def node_aligned(encoders: EncoderPlan, llm_ranks: int) -> bool:
    """Whether the encoders' LSSP groups, consecutive runs from the first encoder rank (`parallel.lssp.
    lssp_group_ranks`) after `llm_ranks` LLM ranks, each start on a multiple of their size: inside a node
    (a power-of-two group of at most a node's GPUs), as the search prices them."""
    return all(llm_ranks % encoders.spec(key).lssp == 0 for key in ENCODER_KEYS)

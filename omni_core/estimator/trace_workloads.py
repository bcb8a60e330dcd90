"""The Crius trace's models as workloads: trace names such as `bert__1.3B`, `moe__10B` and `wide_resnet__2B`
at the shapes of the Alpa benchmark suite, with the precision, optimizer and rematerialisation of its jobs."""

from __future__ import annotations

import re
from dataclasses import replace
from functools import cache

from omni_core.estimator.cnn_workloads import wide_resnet
from omni_core.estimator.lm_workloads import transformer
from omni_core.estimator.workloads import Workload

# Alpa benchmark suite shapes (README of shared/data): (hidden, layers, heads) and MoE (hidden, layers, experts).
# The jobs are Alpa's benchmark cases (alpa/benchmark/alpa): GPT in fp16 with AdamW; MoE in fp16 with
# Adafactor, 16 heads, FFN 8 x hidden, every other layer a GShard MoE over expert groups of 2,048 tokens
# (suite_*_moe.py, alpa/model/moe.py); Wide-ResNet in fp32 with SGD + momentum, which XLA runs on TF32 tensor
# cores where the GPU has them (JAX's default matmul precision); all with rematerialisation (use_remat=True).
# Their state per parameter (alpa-projects/alpa b8078a9, benchmark/alpa/benchmark_one_case_gpt_bert.py and
# _moe.py create_train_state, alpa/model/model_util.py TrainState; the Crius artifact's own trainers,
# sjtu-epcc/arena runtime/crius_worker/jax/trainer/*.py with utils.py TrainState2, are the same): the fp16
# jobs keep fp16 weights, an fp32 master copy (use_master_copy) from which the optimizer's fp32 states are
# made, and gradients of the fp16 weights, so fp16 (`grad_precision`); no dynamic loss scale
# (dynamic_scale=None). GPT: 2 + 2 + 4 + 8 (AdamW) = 16 bytes; MoE: 2 + 2 + 4 + Adafactor's factored moments;
# Wide-ResNet (fp32, no master copy): 4 + 4 + 4 (momentum). Under Alpa's data parallelism the master copy and
# the optimizer states are sharded over the replicas (prefer_reduce_scatter): `policies.sia_artifact`.
GPT_SPECS = {
    "760M": (1536, 24, 16),
    "1.3B": (2048, 24, 32),
    "2.6B": (2560, 32, 32),
    "6.7B": (4096, 32, 32),
    "15B": (5120, 48, 40),
    "39B": (8192, 48, 64),
}
MOE_SPECS = {
    "690M": (768, 8, 16),
    "1.3B": (768, 16, 16),
    "2.4B": (1024, 16, 16),
    "10B": (1536, 16, 32),
    "27B": (2048, 16, 48),
    "70B": (2048, 32, 64),
}
WRESNET_SPECS = {
    "250M": (50, 160, 2),
    "500M": (50, 224, 2),
    "1B": (50, 320, 2),
    "2B": (50, 448, 2),
    "4B": (50, 640, 2),
    "6.8B": (50, 320, 16),
    "13B": (101, 320, 16),
}
_TRACE_NAME = re.compile(r"^(?P<family>bert|gpt|moe|wide_resnet)__(?P<size>[0-9.]+[MB])$")


@cache
def trace_workload(model: str, global_batch: int) -> Workload:
    """`bert__1.3B` (GPT-style, seq 1024, vocab 51200), `moe__10B` (GShard MoE, seq 1024, vocab 32000, top-2,
    expert group 2048), `wide_resnet__2B` (image 224, fp32) -> the Workload at that global batch."""
    match = _TRACE_NAME.match(model)
    if not match:
        raise ValueError(f"unknown trace model {model!r}: expected bert__<size>, moe__<size> or wide_resnet__<size>")
    family, size = match["family"], match["size"]
    specs = {"bert": GPT_SPECS, "gpt": GPT_SPECS, "moe": MOE_SPECS, "wide_resnet": WRESNET_SPECS}[family]
    if size not in specs:
        raise ValueError(f"unknown trace model {model!r}: {family} sizes are {', '.join(specs)}")
    if family in ("bert", "gpt"):
        dim, layers, heads = specs[size]
        gpt = transformer(
            model,
            n_layers=layers,
            dim=dim,
            heads=heads,
            vocab=51200,
            seq_len=1024,
            global_batch=global_batch,
            tied=True,
            precision="fp16",
            recompute=True,
        )
        return replace(gpt, grad_precision="fp16")
    if family == "moe":
        dim, layers, experts = specs[size]
        moe = transformer(
            model,
            n_layers=layers,
            dim=dim,
            heads=16,
            vocab=32000,
            seq_len=1024,
            global_batch=global_batch,
            experts=experts,
            top_k=2,
            ffn=8 * dim,
            moe_every=2,
            expert_group=2048,
            precision="fp16",
            optimizer="adafactor",
            recompute=True,
            tied=True,
        )
        return replace(moe, grad_precision="fp16")
    depth, channels, width = specs[size]
    return wide_resnet(
        model, depth=depth, base_channels=channels, width_factor=width, global_batch=global_batch, recompute=True
    )

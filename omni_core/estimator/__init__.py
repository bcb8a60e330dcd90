"""Crius-style performance estimation, torch-free: per-layer cost model, Cells and plan search. The GPU
catalogue it prices is `omni_core.common.catalog`; calibration and validation, which run the runtime, are
`omni_core.measure`.

    workloads   Layer / Workload: what the cost model prices, per sample
    transformer_layers  the layers of the transformer workloads: block (dense, MoE), embedding, head, ViT,
                projector
    lm_workloads, cnn_workloads, omni_workloads, trace_workloads, paper_workloads   the builders: dense and MoE
                transformers, Wide-ResNet, OmniModel flavors (document lengths from a DatasetProfile), the
                Crius trace's models, MegaScale-Omni's A-D
    cost        estimate_step(workload, gpu, plan, options) -> Estimate (step time, peak memory, or the reason),
                the encoders where plan.encoders puts them; composed of terms (its inputs), memory, stage,
                pipeline, encoders and communication
    search      Cells, the plan search inside each (encoder layouts as plan variants), CellTable (the stage's
                typed result)
    layouts     omni / coupled / disaggregated encoder placement compared, each with its own best plan
    oracle      ThroughputOracle (the scheduler's interface) and CellOracle (memoised)
    calibration the stored micro-profile of a device type (spec + Efficiency) and its digest
    recipe_cells a recipe's jobs and cluster -> CellTable (+ figure): `omni estimate`, flows/estimate.py; a
                recipe's plans predicted on this machine (predicted_step_times)
"""

from omni_core.common.catalog import GpuCatalog, GpuSpec
from omni_core.estimator.cost import Efficiency, Estimate, Options, estimate_step
from omni_core.estimator.lm_workloads import transformer
from omni_core.estimator.omni_workloads import omni_workload
from omni_core.estimator.oracle import CellOracle, ThroughputOracle
from omni_core.estimator.paper_workloads import paper_workload
from omni_core.estimator.search import CellTable, best_for_gpus, build_cell_table, search_cell
from omni_core.estimator.trace_workloads import trace_workload
from omni_core.estimator.workloads import Workload

__all__ = [
    "CellOracle",
    "CellTable",
    "Efficiency",
    "Estimate",
    "GpuCatalog",
    "GpuSpec",
    "Options",
    "ThroughputOracle",
    "Workload",
    "best_for_gpus",
    "build_cell_table",
    "estimate_step",
    "omni_workload",
    "paper_workload",
    "search_cell",
    "trace_workload",
    "transformer",
]

"""From probe measurements to what the cost model prices with: the catalogue entry with the measured peaks and
links, and an `Efficiency` relative to it (so `cost.estimate_step` is unchanged), from a kernel profile
(`with_compute`), a collectives probe (`with_links`) or a ranks probe (`with_ranks`, or its stored summary:
`with_ranks_summary`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.communication import collective_time, ring_volume
from omni_core.estimator.cost import Efficiency
from omni_core.measure.probe_device import CPU_PROBES, ProbeDevice
from omni_core.measure.sampling import fit_line
from omni_core.measure.wrapper_probes import PROBE_DIM


def fit_collective(kind: str, times: dict[int, float], world: int) -> tuple[float, float]:
    """(alpha seconds per step, beta bytes/s) of one collective from its times per buffer size, by the ring
    model of `communication.collective_time` (a p2p exchange: one step moving the whole buffer)."""
    steps, volume = ring_volume(kind, world)
    alpha_steps, inv_beta = fit_line([volume * b for b in times], list(times.values()))
    return alpha_steps / steps, 1 / inv_beta if inv_beta > 0 else 1e12


def _fsdp_unit_collectives(fits: dict[str, tuple[float, float]], world: int) -> float:
    """Seconds of the collectives inside one unit of the FSDP wrapper probe (two all-gathers and a
    reduce-scatter of a PROBE_DIM Linear over `world` ranks), by the fitted links."""
    nbytes = 4.0 * (PROBE_DIM * PROBE_DIM + PROBE_DIM)

    def seconds(kind: str) -> float:
        alpha, beta = fits[kind]
        return collective_time(kind, nbytes, world, beta, alpha)

    return 2 * seconds("all_gather") + seconds("reduce_scatter")


def with_links(
    spec: GpuSpec, eff: Efficiency, collectives: dict[str, dict[int, float]], world: int
) -> tuple[GpuSpec, Efficiency, dict[str, tuple[float, float]]]:
    """`spec` and `eff` with the links a collectives probe measured on `world` ranks of one node, and the
    fits: all-reduce gives the link's alpha and beta, the other kinds factors of them."""
    fits = {kind: fit_collective(kind, times, world) for kind, times in collectives.items()}
    return *with_fitted_links(spec, eff, fits), fits


def with_fitted_links(
    spec: GpuSpec, eff: Efficiency, fits: dict[str, tuple[float, float]]
) -> tuple[GpuSpec, Efficiency]:
    """`spec` and `eff` with fitted links ((alpha, beta) per kind, `with_links`)."""
    base_alpha, base_beta = fits["all_reduce"]
    spec = replace(spec, intra_bw=base_beta, intra_lat=base_alpha)
    eff = replace(
        eff,
        collectives=tuple(
            (kind, a / base_alpha if base_alpha else 1.0, b / base_beta)
            for kind, (a, b) in fits.items()
            if kind != "all_reduce"
        ),
    )
    return spec, eff


def with_ranks(
    spec: GpuSpec, eff: Efficiency, ranks: dict[str, Any], world: int
) -> tuple[GpuSpec, Efficiency, dict[str, Any]]:
    """`spec` and `eff` with the links and the runtime's wrapper costs a ranks probe
    (`rank_probes.profile_ranks`) measured on `world` ranks, and their summary (`with_ranks_summary` applies one
    again)."""
    fits = {kind: fit_collective(kind, times, world) for kind, times in ranks["collectives"].items()}
    summary = {
        "collectives": {kind: {"alpha_s": a, "beta_bytes_s": b} for kind, (a, b) in fits.items()},
        "wrappers": ranks["wrappers"],
        "memory_share": ranks["memory_share"],
        "straggle": ranks["straggle"],
        "link_cpu_share": ranks["link_cpu_share"],
    }
    return *with_ranks_summary(spec, eff, summary, world), summary


def with_ranks_summary(
    spec: GpuSpec, eff: Efficiency, summary: dict[str, Any], world: int
) -> tuple[GpuSpec, Efficiency]:
    """`spec` and `eff` with a ranks probe's summary (`with_ranks`; as a validation report stores it). An FSDP
    unit's cost is kept without its collectives (`stage.fsdp_seconds` prices those per plan, by the size of its
    shard and replica groups)."""
    fits = {kind: (fit["alpha_s"], fit["beta_bytes_s"]) for kind, fit in summary["collectives"].items()}
    spec, eff = with_fitted_links(spec, eff, fits)
    wrappers = summary["wrappers"]
    eff = replace(
        eff,
        dtensor_s=wrappers["dtensor"],
        dtensor_group_s=wrappers["dtensor_group"],
        fsdp_unit_s=max(0.0, wrappers["fsdp_unit"] - _fsdp_unit_collectives(fits, world)),
        fsdp_tensor_s=wrappers["fsdp_tensor"],
        tp_module_s=wrappers["tp"],
        pp_microbatch_s=wrappers["pp"],
        shared_memory=max(1.0, summary["memory_share"]),
        straggle=max(1.0, summary["straggle"]),
        link_cpu_share=summary["link_cpu_share"],
    )
    return spec, eff


def with_compute(spec: GpuSpec, compute: dict[str, float], at: ProbeDevice = CPU_PROBES) -> tuple[GpuSpec, Efficiency]:
    """The catalogue entry with the peaks a kernel profile (`kernels.profile_compute`) measured on `at`, and the
    Efficiency relative to it (links and wrappers keep the catalogue's and default values). CPU attention
    computes whole score matrices; a GPU's fused kernels skip the causal half."""
    peak = compute["matmul_flops"]
    measured = replace(spec, fp32_flops=peak, bf16_flops=peak, fp16_flops=peak, mem_bw=compute["mem_bw"])
    eff = replace(
        Efficiency(),
        matmul=1.0,
        attention=compute["attn_flops"] / peak,
        memory=1.0,
        link=1.0,
        op_overhead_s=compute["op_s"],
        attn_call_s=compute["attn_call_s"],
        matmul_bw=compute["matmul_bw"],
        elementwise_bw=compute.get("elementwise_bw", 0.0),  # absent from profiles made before it was
        score_s=compute["score_s"],
        attention_full=at.device == "cpu",
        tensor_s=compute["tensor_s"],
        tensor_group_s=compute["tensor_group_s"],
        optimizer_bytes_per_param=compute["optimizer_bytes_per_param"],
    )
    return measured, eff

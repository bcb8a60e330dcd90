"""The estimator's sharding stages: memory per stage as each runtime allocates it, the collectives per stage, and
the plan search choosing ZeRO where whole parameters fit and FSDP where they do not."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.estimator import published
from omni_core.estimator.cost import Efficiency, Options, estimate_step
from omni_core.estimator.lm_workloads import transformer
from omni_core.estimator.memory import param_state_bytes
from omni_core.estimator.search import search_cell
from omni_core.estimator.stage import SHARDING_COLLECTIVES, zero_seconds
from omni_core.estimator.terms import PlanTerms

CATALOG = GpuCatalog()
A100 = CATALOG["a100-80gb"]
MEGATRON = Efficiency(zero_master_sharded=True, zero_reduce_in_backward=True)


def gpt(name: str, layers: int, dim: int, precision: str = "bf16"):
    return transformer(name, n_layers=layers, dim=dim, heads=dim // 128, kv_heads=dim // 128, ffn=4 * dim,
                       gated=False, bias=True, vocab=51200, seq_len=2048, global_batch=512, precision=precision)


def terms(plan: str, eff: Efficiency = Efficiency(), precision: str = "bf16") -> PlanTerms:
    return PlanTerms.of(gpt("gpt-1.3b", 24, 2048, precision), A100, ParallelPlan.parse(plan), Options(), eff, 8)


@pytest.mark.parametrize("plan,omni,megatron", [
    # bf16 AdamW: 2-byte weights, fp32 master (4), fp32 gradients (4), two fp32 states (8); 8 shard ranks
    ("dp8", 18 / 8, 18 / 8),
    ("dp8z2", 2 + 4 + 4 + 8 / 8, 2 + 4 / 8 + 12 / 8),  # omni: gradients whole until after the backward
    ("dp8z1", 2 + 4 + 4 + 8 / 8, 2 + 4 + 12 / 8),  # Megatron's distributed optimizer: master with the states
    ("dp8z0", 18, 18),
])
def test_state_bytes_per_parameter_are_what_each_stage_and_runtime_hold(plan, omni, megatron):
    assert param_state_bytes(terms(plan), 8) == pytest.approx(omni)
    assert param_state_bytes(terms(plan, MEGATRON), 8) == pytest.approx(megatron)


def test_fp32_training_has_no_master_copy_to_shard():
    assert param_state_bytes(terms("dp8z1", precision="fp32"), 8) == pytest.approx(4 + 4 + 8 / 8)


def test_zero_collectives_are_the_stage_s_kinds_once_per_step_and_exposed_in_omni_s_runtime():
    """ZeRO-1: the gradients all-reduced, fp32 parameters all-gathered; ZeRO-2: reduce-scattered instead;
    replicated: the all-reduce alone; none hidden where the runtime reduces after the backward."""
    params = 1e9
    for plan, kinds in (("dp8z1", ("all_reduce", "all_gather")), ("dp8z2", ("reduce_scatter", "all_gather")),
                        ("dp8z0", ("all_reduce",))):
        t = terms(plan)
        assert tuple(kind for kind, _ in SHARDING_COLLECTIVES[t.plan.sharding]) in (kinds, kinds[::-1])
        moved = {"all_reduce": params * 4, "reduce_scatter": params * 4, "all_gather": params * 4}
        expected = sum(t.net.time(kind, moved[kind], 8, t.rank_span) for kind in kinds)
        times = zero_seconds(t, params)
        assert times.after == pytest.approx(expected)
        assert times.gather == (0.0, 0.0) and times.reduce == (0.0, 0.0) and times.wrappers == 0.0
    t = terms("dp8z2", MEGATRON)  # reduced during the backward (hideable), bf16 weights gathered after the step
    hidden = zero_seconds(t, params)
    assert hidden.after == pytest.approx(t.net.time("all_gather", params * 2, 8, t.rank_span))
    assert sum(hidden.reduce) == pytest.approx(t.net.time("reduce_scatter", params * 4, 8, t.rank_span))


def test_zero_memory_sits_between_fsdp_and_replicated_and_fits_where_fsdp_must():
    w = gpt("gpt-13b", 40, 5120)
    peak = {name: estimate_step(w, A100, ParallelPlan.parse(name), Options(1, True), gpus_per_node=8).peak_mem_bytes
            for name in ("dp8", "dp8z2", "dp8z1", "dp8z0")}
    assert peak["dp8"] < peak["dp8z2"] <= peak["dp8z1"] < peak["dp8z0"]
    assert peak["dp8"] < A100.usable_bytes < peak["dp8z1"]


def test_search_prefers_zero_where_whole_parameters_fit_and_fsdp_where_they_do_not():
    """1.3B on 8 A100s: ZeRO's states fit beside whole parameters and it pays one all-gather per step, FSDP
    two per micro-batch and its units' hooks, so ZeRO wins; 13B: whole parameters do not fit, FSDP is best
    without TP and ZeRO only beside TP."""
    w = gpt("gpt-1.3b", 24, 2048)
    small = search_cell(w, A100, 8, 8, 1, eff=Efficiency())
    assert small.best.plan.sharding in ("zero1", "zero2")
    fsdp = estimate_step(w, A100, replace(small.best.plan, sharding="fsdp"), small.best.options, gpus_per_node=8)
    assert fsdp.fits and fsdp.step_time_s > small.best.step_time_s
    large = search_cell(gpt("gpt-13b", 40, 5120), A100, 8, 8, 1, eff=Efficiency())
    assert large.best.plan.sharding == "fsdp" and large.best.plan.tp == 1
    zero = [e.plan for e in large.runners_up if e.plan.zero]
    assert zero and all(p.tp > 1 for p in zero)


def test_search_tries_no_zero_stage_with_experts_or_own_encoder_layouts():
    from omni_core.estimator.search import candidate_plans

    plans = list(candidate_plans(gpt("gpt-1.3b", 24, 2048), 8, 8, 1))
    assert {p.sharding for p in plans} == {"fsdp", "zero1", "zero2"}
    assert all(p.dp_shard * p.cp > 1 for p in plans if p.zero)
    assert not [p for p in candidate_plans(gpt("gpt-1.3b", 24, 2048), 8, 8, 1, zero=False) if p.zero]
    assert replace(ParallelPlan.parse("dp8z1"), sharding="fsdp").name == "dp8"


@pytest.mark.parametrize("plan,stage,held", [
    ("dp1-pp4", 0, 4), ("dp1-pp4", 3, 1),  # 1F1B: one per stage from this one to the last
    ("dp1-pp4g", 0, 8),  # GPipe: the step's 8
    # interleaved, v=2, 8 micro-batches in rounds of 4: ((v - 1) x 4 + 2 x (pp - 1 - stage) + 1) chunks of 1/v
    ("dp1-pp4v2", 0, (4 + 6 + 1) / 2), ("dp1-pp4v2", 3, (4 + 0 + 1) / 2),
])
def test_activations_in_flight_per_pipeline_schedule_are_the_runtime_s(plan, stage, held):
    from omni_core.estimator.memory import in_flight

    t = PlanTerms.of(gpt("gpt-1.3b", 24, 2048), A100, ParallelPlan.parse(plan), Options(64), Efficiency(), 8)
    assert t.micro_batches == 8
    assert in_flight(t, stage) == held


def test_in_flight_matches_torch_pipelining_warmup():
    """The interleaved count is torch's own warm-up (`_get_warmup_ops`, private: checked where it exists)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    warmup = getattr(schedules, "_get_warmup_ops", None)
    if warmup is None:
        pytest.skip("this torch has no _get_warmup_ops")
    from omni_core.estimator.memory import in_flight

    for pp, v, mb in ((4, 2, 64), (8, 3, 16), (4, 4, 128)):
        t = PlanTerms.of(gpt("gpt-1.3b", 24, 2048), A100, ParallelPlan(pp=pp, virtual_stages=v,
                         pp_schedule="Interleaved1F1B"), Options(mb), Efficiency(), 8)
        m = t.micro_batches
        for stage in range(pp):
            assert in_flight(t, stage) == min(warmup(stage, v, m // max(1, m // pp), pp, m) + 1, m * v) / v


TABLE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "published_gpu_training.csv"
MCORE_MFU = {"1.7b": 41, "7.1b": 47, "16b": 49, "32b": 46, "70b": 42, "119b": 43, "177b": 44, "314b": 48, "462b": 47}


def test_megatron_core_rows_are_the_readme_s_shapes_and_bf16_throughputs():
    """Transcribed from a table image, so checked against the table's other columns: each shape has the
    parameter count its row names (GPT with a 131,072-token vocabulary, untied, 4,096 positions, 4h FFN), and
    each TFLOP/s per GPU over the H100's bf16 peak is the MFU it lists (bf16, not FP8, whose peak is twice)."""
    rows = [r for r in published.read_table(TABLE) if r["source"] == "mcore2024"]
    assert len(rows) == len(MCORE_MFU)
    for row in rows:
        size = row["model"].split("-")[1]
        layers, h, v, s = (int(row[k]) for k in ("layers", "hidden", "vocab", "seq_len"))
        params = 12 * layers * h * h + 13 * layers * h + (2 * v + s) * h  # untied embedding and output head
        assert params / 1e9 == pytest.approx(float(size[:-1]), rel=0.05), size  # the labels round (1.75 -> 1.7)
        mfu = 100 * float(row["value"]) * 1e12 / CATALOG["h100"].compute_flops("bf16")
        assert abs(mfu - MCORE_MFU[size]) < 0.6, size  # to the README's rounding (46.5 reads 47 there)


def test_megatron_core_flops_are_its_closed_form():
    """`mcore_flops` for a GPT without grouped queries, FFN 4h: 72 B s l h^2 (1 + s / 6h + V / 12lh)."""
    row = next(r for r in published.read_table(TABLE) if r["model"] == "gpt-177b-v131k")
    b, s, layers, h, v = (int(row[k]) for k in ("global_batch", "seq_len", "layers", "hidden", "vocab"))
    closed = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert published.mcore_flops(row) == pytest.approx(closed)
    assert published.measured_step_s(row) == pytest.approx(closed / (432.8e12 * 2304))


def test_a_row_is_priced_as_its_runtime_and_names_what_it_searched():
    report = published.score(TABLE)
    mcore = [r for r in report["rows"] if r["source"] == "mcore2024"]
    assert all(r["searched"] == ["micro_batch", "vp", "recompute"] and r["runtime"] == "megatron-core" for r in mcore)
    assert all(ParallelPlan.parse(r["plan"]).sharding == "zero1" for r in mcore)
    assert {r["recompute"] for r in mcore} <= {"none", "full"}
    mt_nlg = [r for r in report["rows"] if r["source"] == "smith2022"]
    assert all(r["searched"] == ["micro_batch"] and r["plan"].startswith(("dp8z1", "dp10z1", "dp12z1")) for r in mt_nlg)
    eff = published.row_efficiency(next(r for r in published.read_table(TABLE) if r["source"] == "mcore2024"))
    assert eff.tp_async and eff.zero_master_sharded and eff.zero_gather_in_forward and eff.grad_bytes == 2.0
    assert published.row_efficiency(next(r for r in published.read_table(TABLE) if r["source"] == "torchtitan2024")) \
        == Efficiency()


def test_unknown_runtime_or_sharding_in_the_table_is_refused_by_field(tmp_path):
    lines = TABLE.read_text().splitlines()
    bad = tmp_path / "table.csv"
    bad.write_text("\n".join([lines[0], lines[1].replace(",megatron", ",jax")]) + "\n")
    with pytest.raises(ValueError, match=r"table\.csv:2: runtime='jax'"):
        published.read_table(bad)
    bad.write_text("\n".join([lines[0], lines[-1].replace(",zero1,", ",zero3,")]) + "\n")
    with pytest.raises(ValueError, match=r"table\.csv:2: sharding='zero3'"):
        published.read_table(bad)


def test_async_tp_hides_the_volume_behind_its_matmuls_and_keeps_the_latency():
    from omni_core.estimator.pipeline import stage_sums
    from omni_core.estimator.stage import tp_seconds

    w = gpt("gpt-13b", 40, 5120)
    plan = ParallelPlan.parse("dp1-tp8")
    exposed = PlanTerms.of(w, A100, plan, Options(1), Efficiency(), 8)
    decomposed = PlanTerms.of(w, A100, plan, Options(1), Efficiency(tp_async=True), 8)
    st = stage_sums(w, 1)[0]
    latency = st.tp_colls * (2 / 2) * sum(exposed.net.time(k, 0.0, 8, 8, 0) for k in ("all_gather", "reduce_scatter"))
    assert tp_seconds(exposed, st) > latency
    assert tp_seconds(decomposed, st) == pytest.approx(latency)  # the matmuls outlast the volume
    slow = PlanTerms.of(w, replace(A100, intra_bw=A100.intra_bw / 1000), plan, Options(1), Efficiency(tp_async=True), 8)
    assert tp_seconds(slow, st) > latency  # a link too slow for its matmuls shows what they cannot hide

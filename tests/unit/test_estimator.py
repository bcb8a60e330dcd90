"""Estimator: hand-counted FLOPs and memory, monotonicity, infeasibility with reasons, Cells and the oracle."""

from __future__ import annotations

import os

import itertools
import json
from dataclasses import replace

import pytest

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.cost import Efficiency, Options, estimate_step
from omni_core.estimator.oracle import CellOracle, ThroughputOracle
from omni_core.estimator.search import build_cell_table, candidate_plans, search_cell
from omni_core.estimator.lm_workloads import transformer
from omni_core.estimator.omni_workloads import omni_workload
from omni_core.estimator.paper_workloads import paper_workload
from omni_core.estimator.trace_workloads import trace_workload
from omni_core.estimator.transformer_layers import transformer_block

CATALOG = GpuCatalog()
A100 = CATALOG["a100"]


def test_transformer_block_flops_and_params_match_hand_counts():
    d, tokens = 1024, 2048
    block = transformer_block("b", dim=d, heads=16, kv_heads=16, ffn=4 * d, tokens=tokens, sum_sq=tokens**2,
                              docs=1, causal=True, gated=False, bias=False)
    assert block.params == 12 * d * d + 2 * d  # QKV + O (4 d^2), MLP (8 d^2), two norm weights
    assert block.flops == 2 * tokens * 12 * d * d  # a multiply-add per weight per token
    assert block.attn_flops == 4 * d * tokens**2 / 2  # QK^T and AV, causal half
    # two documents of half the length: half the attention pairs
    split = transformer_block("b", dim=d, heads=16, kv_heads=16, ffn=4 * d, tokens=tokens,
                              sum_sq=2 * (tokens / 2) ** 2, docs=2, causal=True, gated=False, bias=False)
    assert split.attn_flops == block.attn_flops / 2


@pytest.mark.parametrize("name,billions", [("bert__760M", 0.76), ("bert__6.7B", 6.7), ("moe__690M", 0.69),
                                           ("moe__10B", 10), ("wide_resnet__500M", 0.5), ("wide_resnet__6.8B", 6.8)])
def test_trace_models_have_their_named_size(name, billions):
    assert trace_workload(name, 256).params == pytest.approx(billions * 1e9, rel=0.06)


def test_unknown_trace_model_is_refused_by_name():
    with pytest.raises(ValueError, match="bert__3B"):
        trace_workload("bert__3B", 8)
    with pytest.raises(ValueError, match="unknown trace model"):
        trace_workload("resnet50", 8)


def test_model_state_memory_is_the_hand_count_and_shrinks_with_fsdp():
    w = transformer("t", n_layers=4, dim=1024, heads=16, vocab=32000, seq_len=1024, global_batch=64)
    peaks = []
    for shards in (1, 2, 4, 8):
        est = estimate_step(w, A100, ParallelPlan(dp_shard=shards), Options(micro_batch=1), gpus_per_node=8)
        # bf16 weights 2 + fp32 grads 4 + fp32 master 4 + Adam moments 8 = 18 bytes per parameter
        assert est.breakdown["states_gb"] == pytest.approx(w.params * 18 / shards / 1e9)
        peaks.append(est.peak_mem_bytes)
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]


def test_checkpointing_cuts_activation_memory_and_costs_time():
    w = trace_workload("bert__1.3B", 64)
    plain = estimate_step(w, A100, ParallelPlan(dp_shard=8), Options(4), gpus_per_node=8)
    ckpt = estimate_step(w, A100, ParallelPlan(dp_shard=8), Options(4, checkpoint=True), gpus_per_node=8)
    assert ckpt.peak_mem_bytes < plain.peak_mem_bytes and ckpt.step_time_s > plain.step_time_s


def test_faster_links_never_increase_step_time():
    w = trace_workload("moe__10B", 512)
    slow, fast = A100, replace(A100, intra_bw=A100.intra_bw * 4, nic_bw=A100.nic_bw * 4)
    for pp in (1, 2, 4):
        for plan in candidate_plans(w, 32, 4, pp):
            for options in (Options(1), Options(2, checkpoint=True)):
                a = estimate_step(w, slow, plan, options, gpus_per_node=4)
                b = estimate_step(w, fast, plan, options, gpus_per_node=4)
                assert b.step_time_s <= a.step_time_s * (1 + 1e-12), plan.name


def test_infeasible_plans_carry_the_reason():
    w = trace_workload("bert__6.7B", 128)
    oom = estimate_step(w, CATALOG["a10"], ParallelPlan(), Options(1), gpus_per_node=4)
    assert not oom.fits and "out of memory" in oom.reason and "a10" in oom.reason
    odd = estimate_step(w, A100, ParallelPlan(dp_shard=3), Options(1), gpus_per_node=8)
    assert not odd.fits and "global_batch=128" in odd.reason and "dp=3" in odd.reason
    cell = search_cell(w, CATALOG["a10"], 1, 4, 1, eff=Efficiency())
    assert cell.best is None and "out of memory" in cell.reason


def test_a_job_no_cell_can_hold_is_reported_not_dropped():
    jobs = {"huge": trace_workload("moe__70B", 256), "tiny": trace_workload("bert__760M", 128)}
    table = build_cell_table(jobs, CATALOG, {"a10": 2})
    assert [u.job for u in table.unfit] == ["huge"] and "out of memory" in table.unfit[0].reason
    assert {c.job for c in table.cells} == {"tiny"}


def test_cell_table_best_plan_is_a_plan_the_runtime_accepts():
    w = trace_workload("moe__2.4B", 512)
    table = build_cell_table({"moe": w}, CATALOG, {"a100": 16, "v100": 16}, gpus_per_node={"a100": 4})
    assert table.cells and not table.unfit
    for row in table.cells:
        plan = row.parallel_plan()
        plan.check_world(row.num_gpus)
        plan.check_model(w.shape)
        assert plan.pp == row.pp and row.nodes * row.gpus_per_node >= row.num_gpus
        assert row.step_time_s == pytest.approx(w.global_batch / row.samples_per_s)
        assert all(r.step_time_s >= row.step_time_s for r in row.runners_up)
    assert json.loads(table.to_json())["cells"][0].keys() >= {
        "gpu_type", "num_gpus", "nodes", "gpus_per_node", "pp", "plan", "step_time_s", "samples_per_s", "peak_mem_gb"}


def test_more_gpus_give_more_throughput_for_a_large_model():
    w = trace_workload("bert__2.6B", 512)
    rates = [search_cell(w, A100, n, 8, 1, eff=Efficiency()).samples_per_s for n in (8, 16, 32)]
    assert rates == sorted(rates)


def test_oracle_protocol_memoises_and_answers_none_when_nothing_fits():
    oracle = CellOracle(CATALOG, {"a100": 4, "a10": 2})
    assert isinstance(oracle, ThroughputOracle)
    best = oracle.throughput("moe__10B", 512, "a100", 8)
    assert best
    plan = oracle.best_plan("moe__10B", 512, "a100", 8)
    plan.check_world(8)
    searched = oracle.cell("moe__10B", 512, "a100", 8)
    oracle.workload = lambda *_: pytest.fail("a memoised Cell was searched again")
    assert oracle.throughput("moe__10B", 512, "a100", 8) == best and oracle.cell("moe__10B", 512, "a100", 8) is searched
    oracle.workload = None
    assert oracle.throughput("moe__70B", 256, "a10", 1) is None and oracle.best_plan("moe__70B", 256, "a10", 1) is None
    assert oracle.throughput("wide_resnet__2B", 256, "v100", 4) > 0


def test_catalog_overrides_name_unknown_fields_and_need_full_new_types():
    faster = CATALOG.with_overrides({"a100": {"nic_bw": 1e12}})
    assert faster["a100"].nic_bw == 1e12 and CATALOG["a100"].nic_bw != 1e12
    with pytest.raises(ValueError, match="estimate.gpus.a100: unknown field.*nvlink"):
        CATALOG.with_overrides({"a100": {"nvlink": 1.0}})
    with pytest.raises(ValueError, match="estimate.gpus.b200: a new GPU type needs"):
        CATALOG.with_overrides({"b200": {"mem_gb": 192}})
    with pytest.raises(KeyError, match="unknown GPU type 'b300'"):
        CATALOG["b300"]


def test_omni_workload_prices_encoders_from_the_profile():
    from omni_core.models.flavors import get_flavor

    args = get_flavor("debug", patch_size=8, n_mels=32)
    text = omni_workload(args, seq_len=512, global_batch=4)
    # no image or audio in the data: the encoders still run (on a dummy input) and are trained, but compute nothing
    assert text.encoder and sum(l.params for l in text.encoder) > 0 and not sum(l.flops for l in text.encoder)
    assert not text.items.count  # no item to balance or split: the search lays out no encoders (tests/unit/test_layouts)
    w = paper_workload("A", 0.9)
    assert w.encoder and w.encoder_cv > 0 and w.items.encoder == "vision" and w.items.tokens == 1024


def test_omni_estimate_cli_prints_cells_as_json(tmp_path, capsys):
    from flows.cli import main
    from tests.helpers.recipes import write_recipe

    recipe = write_recipe(tmp_path / "r.yaml", {
        "experiment.name": "est", "cluster.node_groups": [{"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4}],
        "jobs": [{"name": "gpt", "model": "bert__760M", "global_batch": 64, "iterations": 10},
                 {"name": "big", "model": "moe__70B", "global_batch": 256, "iterations": 10}],
    }, tmp_path)
    out = tmp_path / "cells.json"
    assert main(["estimate", str(recipe), "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert {c["job"] for c in printed["cells"]} == {"gpt"} and printed["unfit"][0]["job"] == "big"
    assert main(["estimate", str(recipe), "--set", "jobs.0.model=bert__1T"]) == 2
    assert "jobs[0].model" in capsys.readouterr().err


def test_calibration_is_stored_per_device_and_used_by_the_search(tmp_path, monkeypatch):
    from omni_core.estimator.calibration import calibrated, calibration_digest, load_calibration
    from omni_core.measure.calibrate import calibrate

    monkeypatch.setenv("OMNI_CALIBRATION_DIR", str(tmp_path))
    cpu = CATALOG["cpu"]
    assert load_calibration("cpu") is None and calibrated(cpu) == (cpu, Efficiency())
    assert calibration_digest("cpu") == ""
    spec, eff, raw = calibrate(cpu, world=1, repeat=1)
    assert (tmp_path / "cpu.json").exists() and raw["matmul_flops"] > 0
    assert spec.fp32_flops == raw["matmul_flops"] and 0 < eff.attention
    assert eff.elementwise_bw == raw["elementwise_bw"] > 0  # the element-wise probe's rate prices `mem_bytes`
    assert spec.cores == os.cpu_count()  # ranks beyond the host's cores time-share them, as validation prices
    assert calibrated(cpu) == (spec, eff)
    digest = calibration_digest("cpu")
    gpt = transformer("gpt", n_layers=2, dim=256, heads=4, vocab=1000, seq_len=128, global_batch=8)
    table = build_cell_table({"gpt": gpt}, CATALOG, {"cpu": 2})
    assert len(digest) == 12 and table.calibrations == {"cpu": digest}


def test_element_wise_traffic_is_priced_at_the_calibrated_element_wise_rate():
    """A layer's `mem_bytes` take `elementwise_bw` when the calibration measured one, else the memory
    bandwidth x `memory`; matmul operands keep their own rate."""
    from omni_core.estimator.pipeline import Sums
    from omni_core.estimator.stage import device_seconds
    from omni_core.estimator.workloads import Layer

    cpu = CATALOG["cpu"]
    sums = Sums.of([Layer("elementwise", params=0.0, flops=0.0, mem_bytes=6e9)])
    streaming = Efficiency(memory=1.0)
    assert device_seconds(sums, cpu, streaming, "fp32")[0] == pytest.approx(6e9 / cpu.mem_bw)
    assert device_seconds(sums, cpu, replace(streaming, elementwise_bw=2e9), "fp32")[0] == pytest.approx(3.0)


# --- the runtime's plans: executable, split like the runtime, priced with what the runtime does ------------


def _flavor_workload(flavor: str, seq_len: int, batch: int):
    from omni_core.models.flavors import get_flavor

    return omni_workload(get_flavor(flavor, patch_size=8, n_mels=32), seq_len=seq_len, global_batch=batch,
                         precision="fp32")


@pytest.mark.parametrize("flavor", ["debug", "debug-moe", "small"])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_stage_split_is_the_runtimes(flavor, pp):
    """The estimator prices the pipeline split the runtime executes (`parallel.pipeline.balance_layers`)."""
    from omni_core.estimator.pipeline import partition
    from omni_core.models.flavors import get_flavor
    from omni_core.parallel.pipeline import balance_layers, layer_costs

    workload = _flavor_workload(flavor, 256, 8)
    cuts = partition(workload, pp)  # over (embedding, blocks..., head)
    blocks = [b - a for a, b in itertools.pairwise(cuts)]
    blocks[0] -= 1  # the embedding
    blocks[-1] -= 1  # the head
    runtime = balance_layers(layer_costs(get_flavor(flavor, patch_size=8, n_mels=32).llm), pp)
    assert blocks == [len(r) for r in runtime]


def test_a_pipeline_schedule_that_would_refuse_the_micro_batches_is_not_ranked():
    from omni_core.estimator.pipeline import schedule_refusal

    w = trace_workload("bert__1.3B", 8)
    refused = estimate_step(w, A100, ParallelPlan(pp=4), Options(4), gpus_per_node=8)  # 2 micro-batches, 4 stages
    assert not refused.fits and "needs at least 4 micro-batches" in refused.reason
    assert schedule_refusal(ParallelPlan(pp=4, pp_schedule="GPipe"), 2) == ""
    assert "rounds" in schedule_refusal(ParallelPlan(pp=2, pp_schedule="Interleaved1F1B", virtual_stages=2), 5)
    cell = search_cell(w, A100, 8, 8, 4, eff=Efficiency())
    for est in [cell.best, *cell.runners_up]:
        m = w.global_batch // (est.plan.dp * est.options.micro_batch)
        assert not schedule_refusal(est.plan, m)


def test_cell_table_plans_of_a_flavor_pass_the_runtimes_resolve_plan(tmp_path):
    """Every plan a CellTable ranks for a model flavor is one `trainer.resolve_plan` accepts for that model at
    its micro-batch and gradient accumulation (the model's degrees, the pipeline schedule's micro-batches)."""
    from omni_core.runtime.plan_rules import resolve_plan
    from tests.helpers.recipes import build_recipe

    w = _flavor_workload("debug-moe", 256, 16)
    table = build_cell_table({"moe": w}, CATALOG, {"a100": 16}, gpus_per_node={"a100": 8})
    rows = [(row.plan, row.micro_batch, row.num_gpus) for row in table.cells]
    rows += [(r.plan, r.micro_batch, row.num_gpus) for row in table.cells for r in row.runners_up]
    # the tiny model's best plans are ZeRO's (no FSDP unit per micro-batch); its EP plans are checked beside them
    rows += [(p.name, 1, 8) for p in candidate_plans(w, 8, 8, 1) if p.ep > 1]
    plans = [ParallelPlan.parse(p) for p, _, _ in rows]
    assert any(p.ep > 1 for p in plans) and any(p.pp > 1 for p in plans) and any(p.zero for p in plans)
    for name, micro_batch, world in rows:
        plan = ParallelPlan.parse(name)
        recipe = build_recipe(tmp_path, {
            "model.flavor": "debug-moe", "data.seq_len": 256, "data.micro_batch": micro_batch,
            "parallel": {"dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "tp": plan.tp, "pp": plan.pp,
                         "pp_schedule": plan.pp_schedule, "cp": plan.cp, "cp_kind": plan.cp_kind, "ep": plan.ep,
                         "sharding": plan.sharding},
            "train.grad_accum": w.global_batch // (plan.dp * micro_batch),
        })
        assert resolve_plan(recipe, world) == plan


def test_runtime_wrappers_and_shared_cores_are_priced():
    """FSDP units, TP modules and pipeline micro-batches cost what the calibration says; ranks sharing fewer
    cores than they are take at least their total work over the cores."""
    cpu = replace(CATALOG["cpu"], cores=2)
    eff = Efficiency(fsdp_unit_s=0.0, tp_module_s=0.0, pp_microbatch_s=0.0)

    def step(plan, batch=8, **changes):
        return estimate_step(_flavor_workload("debug", 256, batch), cpu, plan, Options(1),
                             gpus_per_node=4, eff=replace(eff, **changes)).step_time_s

    for plan, knob in ((ParallelPlan(dp_shard=2), "fsdp_unit_s"), (ParallelPlan(tp=2, dp_shard=1), "tp_module_s"),
                       (ParallelPlan(pp=2), "pp_microbatch_s")):
        assert step(plan, **{knob: 1e-3}) > step(plan)
    # one sample per rank: four ranks on two cores get half a core each, two ranks a whole one
    assert step(ParallelPlan(dp_shard=4), batch=4) > 1.5 * step(ParallelPlan(dp_shard=2), batch=2)
    # three in lockstep on two cores run in two rounds, as four do (the FSDP collectives of four cost more)
    three, four = step(ParallelPlan(dp_shard=3), batch=3), step(ParallelPlan(dp_shard=4), batch=4)
    assert 0.9 * four < three < four
    # a collective's wait is not work on a core: sharing ranks fill it; ranks with a core each wait anyway
    shared = [step(ParallelPlan(dp_shard=4), batch=4, link_cpu_share=s) for s in (1.0, 0.5)]
    assert shared[1] < shared[0]
    assert step(ParallelPlan(dp_shard=2), batch=2, link_cpu_share=0.5) == step(ParallelPlan(dp_shard=2), batch=2)


def test_validation_cases_cover_every_degree_and_the_runtime_accepts_them(tmp_path):
    from omni_core.measure.cases import case_recipe, validation_cases
    from omni_core.runtime.plan_rules import resolve_plan

    full, quick = validation_cases(False), validation_cases(True)
    assert len({c.plan for c in full}) >= 20 and len(full) >= 25 and {c.world for c in full} == {1, 2, 3, 4}
    for cases in (full, quick):
        plans = [ParallelPlan.parse(c.plan) for c in cases]
        assert all(any(getattr(p, dim) > 1 for p in plans) for dim in ("tp", "pp", "cp", "ep", "dp_shard"))
        assert {p.encoders.layout for p in plans} == {"coupled", "omni", "disaggregated"}
        assert {c.flavor for c in cases} >= {"debug", "small"} and len({c.mix for c in cases}) >= 3
    for case in full + quick:
        assert resolve_plan(case_recipe(case, tmp_path), case.world) == case.parallel_plan


def test_repredict_refuses_what_it_cannot_read(tmp_path):
    """A report lacking its calibrations is named with the missing field, before anything is priced; a GPU
    validation's calibrations (NCCL links without the CPU ranks' wrappers) are refused by name; a row whose
    name is not a case's is named."""
    from omni_core.measure.stored_reports import ReportError, repredicted
    from omni_core.measure.validate import repredict
    from omni_core.measure.validation_report import CaseResult

    stored = tmp_path / "report.json"
    stored.write_text(json.dumps({"mape_pct": 9.0, "validation": []}))
    with pytest.raises(ReportError, match=r"report.json: an estimator_bench report lacks the field 'calibration'"):
        repredicted(stored)
    gpu = [{"kernels": {}, "ranks": {"collectives": {"all_reduce": {"alpha_s": 1e-5, "beta_bytes_s": 1e11}}}}]
    with pytest.raises(ValueError, match="reads CPU validation reports"):
        repredict([], gpu, tmp_path, CATALOG["cpu"])
    row = CaseResult(case="debug-dp1-s256", world=1, flavor="debug", plan="dp1", predicted_s=1.0, measured_s=1.0,
                     measured_cpu_s=1.0, waited_s=0.0, ape_pct=0.0, predicted_rounds_s=[1.0],
                     measured_rounds_s=[1.0], breakdown={"host_s": 0.0})
    with pytest.raises(ValueError, match="'debug-dp1-s256': not a case name"):
        repredict([row], [{"kernels": {}, "ranks": {}}], tmp_path, CATALOG["cpu"])
    stored.write_text(json.dumps({"mape_pct": 9.0, "validation": [row.model_dump()],
                                  "calibration": [{"kernels": {}, "ranks": {}}]}))
    with pytest.raises(ReportError, match=r"report.json: validation row 'debug-dp1-s256': not a case name"):
        repredicted(stored)
    named = row.model_copy(update={"case": "debug-dp1-s256-mb1-ga1-text"})
    with pytest.raises(ValueError, match="a round's calibration holds no kernels for it"):
        repredict([named], [{"kernels": {}, "ranks": {}}], tmp_path, CATALOG["cpu"])


def test_cpu_node_terms_apply_only_where_ranks_share_the_node():
    """Straggling stretches multi-rank steps only (their compute, not the wrappers and links, whose probes ran on
    the ranks together); shared memory bandwidth slows memory-bound work only when several ranks of a CPU
    node (GpuSpec.cores) run at once, never on a GPU."""
    w = _flavor_workload("debug", 256, 4)
    cpu = replace(CATALOG["cpu"], cores=2)
    base = Efficiency()

    def step(gpu, plan: str, eff: Efficiency) -> float:
        parsed = ParallelPlan.parse(plan)
        return estimate_step(w, gpu, parsed, Options(1), gpus_per_node=parsed.world_size, eff=eff).step_time_s

    for gpu in (cpu, CATALOG["a100"]):
        assert step(gpu, "dp1", replace(base, straggle=1.3)) == step(gpu, "dp1", base)
        assert step(gpu, "dp2", base) < step(gpu, "dp2", replace(base, straggle=1.3)) < 1.3 * step(gpu, "dp2", base)
    assert step(cpu, "dp2", replace(base, shared_memory=1.5)) > step(cpu, "dp2", base)
    assert step(cpu, "dp1", replace(base, shared_memory=1.5)) == step(cpu, "dp1", base)
    assert step(CATALOG["a100"], "dp2", replace(base, shared_memory=1.5)) == step(CATALOG["a100"], "dp2", base)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_a_time_shared_pipeline_lies_between_its_critical_path_and_its_total_work(schedule):
    """Simulated pass by pass: with a core per rank it is the schedule's formula, on one core all the work
    one after the other; time spent waiting on a collective needs no core."""
    from omni_core.estimator.pipeline import time_shared_pipeline

    m, pp, t = 4, 3, 0.3
    work = [(t, 0.0)] * pp
    assert time_shared_pipeline(schedule, m, work, 1 / 3, 1, cores=pp) == pytest.approx((m - 1 + pp) * t)
    assert time_shared_pipeline(schedule, m, work, 1 / 3, 1, cores=1) == pytest.approx(m * pp * t)
    two = time_shared_pipeline(schedule, m, work, 1 / 3, 1, cores=2)
    assert max((m - 1 + pp) * t, m * pp * t / 2) <= two + 1e-9 and two < m * pp * t
    waiting = [(0.0, t)] * pp
    assert time_shared_pipeline(schedule, m, waiting, 1 / 3, 1, cores=1) == pytest.approx((m - 1 + pp) * t)

"""The encoders' layouts priced through the plan object (`ParallelPlan.encoders`): omni as the runtime runs it
(three phases, balanced over the world, LSSP for long items, the handoff), coupled, disaggregated; the search's
encoder halves in CellTable names; a recipe's plans predicted on this machine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import EncoderPlan, ParallelPlan
from omni_core.estimator.calibration import runtime_efficiency
from omni_core.estimator.communication import SMALL_MESSAGE_BYTES, Network
from omni_core.estimator.cost import SYNC_COLLECTIVES, Efficiency, Options, estimate_step, llm_only
from omni_core.estimator.encoders import handoff_seconds, long_tokens_threshold
from omni_core.estimator.layouts import compare_layouts
from omni_core.estimator.recipe_cells import plan_overrides, predicted_step_times
from omni_core.estimator.search import CellTable, cell_row, search_cell
from omni_core.estimator.paper_workloads import paper_workload
from omni_core.recipe import override_recipe
from tests.helpers.recipes import build_recipe

H100 = GpuCatalog()["h100"]
CHECKPOINTED = Options(1, checkpoint=True)
DEFAULTS = Efficiency()


def step(workload, plan: str, options: Options = CHECKPOINTED, eff: Efficiency = DEFAULTS):
    return estimate_step(workload, H100, ParallelPlan.parse(plan), options, gpus_per_node=8, eff=eff)


def test_omni_beats_coupled_on_image_heavy_data_at_tp2_pp2_without_filling_bubbles():
    """Coupled encoders run on the two stage-0 ranks of each data shard; omni spreads the step's images over all
    eight. The phased schedule leaves the pipeline's bubbles empty; the joint schedule (the plan's) fills
    `Efficiency.joint_pipeline` of them, which does nothing to coupled plans."""
    w = replace(paper_workload("A", 0.9), global_batch=16, cache={})
    for eff in (Efficiency(), runtime_efficiency(Efficiency())):  # encoders split over TP (Megatron) or replicated
        coupled, omni = step(w, "dp2-tp2-pp2", eff=eff), step(w, "dp2-tp2-pp2+omni.v-fsdp", eff=eff)
        assert coupled.fits and omni.fits and omni.step_time_s < coupled.step_time_s
        assert omni.breakdown["bubble_s"] > 0 and omni.breakdown["encoder_handoff_s"] > 0
        joint = step(w, "dp2-tp2-pp2+omni-joint.v-fsdp", eff=eff)
        assert joint.step_time_s < omni.step_time_s
        assert step(w, "dp2-tp2-pp2+omni-joint.v-fsdp", eff=replace(eff, joint_pipeline=0.0)).breakdown[
            "encoder_s"] >= omni.breakdown["encoder_s"]  # per micro-batch rounds cost operators, nothing hidden


def test_omni_weights_and_handoff_follow_the_plan():
    """Replicated encoder weights cost their states on every rank, FSDP over the world a share; the handoff grows
    with the items' raw inputs."""
    w = replace(paper_workload("A", 0.5), global_batch=16, cache={})
    replicated, sharded = step(w, "dp2-tp2-pp2+omni"), step(w, "dp2-tp2-pp2+omni.v-fsdp")
    assert sharded.peak_mem_bytes < replicated.peak_mem_bytes
    heavier = replace(w, items=replace(w.items, input_bytes=10 * w.items.input_bytes), cache={})
    assert step(heavier, "dp2-tp2-pp2+omni").breakdown["encoder_handoff_s"] > replicated.breakdown["encoder_handoff_s"]


@pytest.fixture(scope="module")
def long_items():
    """Workload C with one image of four samples' encoder work per step: balancing cannot even it out."""
    return replace(paper_workload("C", 0.9), encoder_max_item=4.0, cache={})


def test_lssp_splits_the_items_over_the_specs_threshold_only(long_items):
    threshold = long_tokens_threshold(long_items, 256)
    whole = step(long_items, "dp4-tp8-pp8+omni.v-fsdp")
    split = step(long_items, f"dp4-tp8-pp8+omni.v-sp8-t{threshold}-fsdp")
    assert split.step_time_s < whole.step_time_s and split.peak_mem_bytes < whole.peak_mem_bytes
    assert split.breakdown["encoder_long_item_s"] < whole.breakdown["encoder_long_item_s"]
    # the longest item is under a higher threshold: it runs whole
    assert step(long_items, "dp4-tp8-pp8+omni.v-sp8-t10000000-fsdp").step_time_s == whole.step_time_s
    refused = step(long_items, "dp4-tp8-pp8+omni.v-sp16-t100")
    assert not refused.fits and "does not divide the vision encoder's 40 attention heads" in refused.reason


def test_the_chosen_plan_carries_lssp_as_an_encoder_spec_and_cell_rows_round_trip_it(long_items):
    cell = search_cell(long_items, H100, 256, 8, 8, eff=Efficiency(), layout="omni")
    vision = cell.best.plan.encoders.vision
    assert cell.best.plan.encoders.layout == "omni" and vision.lssp > 1
    assert vision.long_tokens == long_tokens_threshold(long_items, 256)
    row = cell_row("long", cell, "omni")
    assert "+omni.v-sp" in row.plan
    table = CellTable.from_json(CellTable(cells=[row], unfit=[]).to_json())
    assert table.cells[0].parallel_plan() == cell.best.plan == table.cells[0].cell_result().plan
    assert [ParallelPlan.parse(r.plan) for r in table.cells[0].runners_up] == [e.plan for e in cell.runners_up]


def test_disaggregated_is_priced_through_the_plan():
    """The LLM's plan on its ranks and the encoders on theirs side by side, plus the handoff and the step's
    statistics and gradient-norm all-reduces over the whole world (the LLM-only estimate priced its own ranks)."""
    gpu = H100
    w = paper_workload("A", 0.5)
    plan = ParallelPlan.parse("dp4x2-tp2-cp2u+disagg32")
    plan.check_world(64)
    est = estimate_step(w, gpu, plan, Options(1), gpus_per_node=8)
    llm = estimate_step(llm_only(w), gpu, replace(plan, encoders=EncoderPlan()), Options(1), gpus_per_node=8)
    assert est.fits and est.breakdown["llm_s"] == llm.step_time_s
    handoff, encoder_s = est.breakdown["encoder_handoff_s"], est.breakdown["encoder_s"]
    net = Network(gpu, 8, Efficiency().link, Efficiency().collectives)
    world_sync = (net.time("all_reduce", SMALL_MESSAGE_BYTES, 64, 64, SYNC_COLLECTIVES + 1)
                  - net.time("all_reduce", SMALL_MESSAGE_BYTES, 32, 32, SYNC_COLLECTIVES))
    assert world_sync > 0 and est.breakdown["sync_s"] == pytest.approx(llm.breakdown["sync_s"] + world_sync)
    # phased: one after the other
    assert est.step_time_s == pytest.approx(encoder_s + llm.step_time_s + handoff + world_sync)
    joint = ParallelPlan.parse("dp4x2-tp2-cp2u+disagg32-joint")
    micro = w.global_batch // (joint.dp * 1)
    overlapped = estimate_step(w, gpu, joint, Options(1), gpus_per_node=8)
    assert overlapped.step_time_s == pytest.approx(  # DistTrain's: all but one micro-batch of the shorter hidden
        encoder_s + llm.step_time_s - min(encoder_s, llm.step_time_s) * (1 - 1 / micro) + handoff + world_sync)
    best = compare_layouts(w, gpu, 64, 8)["disaggregated"]
    parsed = ParallelPlan.parse(best.plan)
    assert parsed.encoders.layout == "disaggregated" and parsed.world_size == 64 and "on 32 GPUs" in best.detail


def test_the_handoff_prices_every_collective_the_encoder_step_issues():
    """Each step `EncoderStep` gathers the items' metadata (two all-gathers), exchanges inputs once per input
    field (three all-to-alls, empty ones too) and moves the rows out and their gradients back (two): with no
    bytes to move, seven collectives' latencies; inputs and embeddings add their bytes."""
    net, plan, w = Network(H100, 8, 0.8), ParallelPlan.parse("dp4+omni"), paper_workload("A", 0.5)
    latency = net.time("all_gather", SMALL_MESSAGE_BYTES, 4, 4, 2) + net.time("all_to_all", 0.0, 4, 4, 5)
    assert handoff_seconds(w, plan, net, 0.0) == pytest.approx(latency)
    assert handoff_seconds(w, plan, net, 8.0) > handoff_seconds(w, plan, net, 4.0) > latency


def test_disaggregated_encoder_ranks_pay_their_operators_and_their_optimizer():
    """The encoder ranks run the encoders' operators and update their weights like any rank: host seconds per
    operator and per parameter tensor reach the encoder side of the step."""
    from omni_core.estimator.encoders import encoder_sums

    w, plan = paper_workload("A", 0.5), ParallelPlan.parse("dp4x2-tp2-cp2u+disagg32")
    enc = encoder_sums(w)

    def encoder_s(**eff) -> float:
        return estimate_step(w, H100, plan, Options(1), gpus_per_node=8, eff=Efficiency(**eff)).breakdown["encoder_s"]

    base = encoder_s(op_overhead_s=0.0)
    assert encoder_s(op_overhead_s=1e-3) - base >= enc.ops * 1e-3 * 0.999
    assert encoder_s(op_overhead_s=0.0, tensor_s=1e-3) - base == pytest.approx(enc.tensors * 1e-3)


def test_text_only_workloads_lay_out_no_encoders():
    """Without items there is nothing to balance or split: plans keep the default (coupled) encoder half."""
    from omni_core.estimator.omni_workloads import omni_workload
    from omni_core.models.flavors import get_flavor

    text = omni_workload(get_flavor("debug", patch_size=8, n_mels=32), seq_len=256, global_batch=8, precision="fp32")
    cell = search_cell(text, GpuCatalog()["cpu"], 2, 2, 1, eff=Efficiency(), layout="omni")
    assert cell.best.plan.encoders == EncoderPlan() and "+" not in cell.best.plan.name


LAYOUTS = {"experiment.name": "layouts", "experiment.seed": 1, "model.flavor": "debug",
           "data.synthetic.num_samples": 60, "data.synthetic.mix": {"image": 0.8, "text": 0.2}, "data.seq_len": 256,
           "parallel.nproc": 4, "train.grad_accum": 2}


def test_plan_overrides_run_the_plans_encoders():
    recipe = build_recipe(overrides=LAYOUTS)
    for name in ("dp2-tp2+omni.v-sp2-t256-fsdp", "dp1-tp2+disagg2", "dp4"):
        plan = ParallelPlan.parse(name)
        resolved = override_recipe(recipe, plan_overrides(plan, 1, False, 4))
        assert ParallelPlan.from_config(resolved.parallel, plan.world_size) == plan


def test_predicted_step_times_price_a_recipes_plans_on_this_machine(tmp_path, monkeypatch):
    from omni_core.data.dataset import open_dataset
    from omni_core.data.flops import FlopModel
    from omni_core.data.profile import profile_source

    monkeypatch.setenv("OMNI_CALIBRATION_DIR", str(tmp_path / "calibration"))  # the catalogue's cpu
    recipe = build_recipe(tmp_path, {**LAYOUTS, "data.path": tmp_path / "data"})
    data = recipe.data
    flops = FlopModel.for_flavor("debug", patch_size=data.patch_size, n_mels=data.n_mels)
    profile = profile_source(open_dataset(recipe), data, 1, flops)
    plans = [ParallelPlan.parse(n) for n in ("dp1-tp2-pp2", "dp1-tp2-pp2+omni", "dp1-tp2+disagg2")]
    times = predicted_step_times(recipe, plans, profile)
    assert list(times) == [p.name for p in plans] and all(t > 0 for t in times.values())
    assert times["dp1-tp2-pp2+omni"] < times["dp1-tp2-pp2"]  # stage 0's two ranks vs all four
    with pytest.raises(ValueError, match=r"dp4\+omni.v-sp8-t10: encoders.vision.lssp=8 exceeds the 4 encoder ranks"):
        predicted_step_times(recipe, [ParallelPlan.parse("dp4+omni.v-sp8-t10")], profile)


def test_the_search_tries_the_joint_schedule_where_the_runtime_runs_it():
    from omni_core.estimator.search import encoder_schedules, search_cell

    catalog = GpuCatalog()
    assert encoder_schedules(catalog["cpu"]) == ("phased", "joint") and encoder_schedules(H100) == ("phased",)
    w = replace(paper_workload("A", 0.9), global_batch=16, cache={})
    gpu_cell = search_cell(w, H100, 8, 8, 2, eff=Efficiency())
    assert all(not e.plan.encoders.joint for e in [gpu_cell.best, *gpu_cell.runners_up])
    cpu = replace(catalog["cpu"], mem_gb=1e6)  # the paper's model on CPU "devices": priced, not run
    cpu_cell = search_cell(w, cpu, 4, 4, 2, eff=Efficiency())
    names = [e.plan.name for e in [cpu_cell.best, *cpu_cell.runners_up]]
    assert cpu_cell.best.plan.encoders.joint, names  # pp=2: the joint schedule fills the pipeline's bubbles

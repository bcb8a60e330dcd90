"""The `disaggregated` layout's share-out of a Cell (estimator.orchestration): DistTrain's orchestration offers the
encoders any GPU count the LLM leaves, the LLM Megatron-LM's layouts (pipeline depths dividing the layers, data
parallelism dividing the global batch); what the search hands over is a plan the runtime runs."""

from __future__ import annotations

from dataclasses import replace

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.cost import Efficiency
from omni_core.estimator.orchestration import divisors, pipeline_depths
from omni_core.estimator.paper_workloads import paper_workload
from omni_core.estimator.search import best_for_gpus, encoder_variants, search_cell
from omni_core.estimator.workloads import EncoderItems

H100 = GpuCatalog()["h100"]


def test_depths_are_powers_of_two_except_disaggregated_llms_which_divide_their_layers():
    w = paper_workload("A", 0.5)  # a 36-layer LLM
    assert pipeline_depths(w, 64, "omni") == pipeline_depths(w, 64, "coupled") == [1, 2, 4, 8, 16, 32]
    assert pipeline_depths(w, 64, "disaggregated") == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert pipeline_depths(w, 4, "disaggregated") == [1, 2, 3]  # one GPU left for the encoders
    text = replace(w, items=EncoderItems(), cache={})  # nothing to encode: every GPU runs the LLM
    assert pipeline_depths(text, 64, "disaggregated") == pipeline_depths(text, 64, "omni")


def test_the_encoders_get_what_each_megatron_llm_leaves_in_gpus_not_nodes():
    """On 64 GPUs, global batch 32, TP x CP up to 64 (16k-token sequences): every LLM of pp x 2^a x (a divisor
    of 32) GPUs below 64, the encoders the rest; at pp3 48 LLM GPUs (16 for the encoders), at pp9 36 (28 for
    the encoders, three and a half nodes), none of them k/8 of the Cell in whole nodes."""
    w = paper_workload("A", 0.5)
    for pp, expected_llm in ((1, [1, 2, 4, 8, 16, 32]), (3, [3, 6, 12, 24, 48]), (9, [9, 18, 36])):
        splits = [ranks for ranks, _ in encoder_variants(w, "disaggregated", 64, 8, pp=pp)]
        assert sorted(64 - ranks for ranks in splits) == expected_llm
    long_items = replace(w, encoder_max_item=8.0, cache={})  # an image of 8 sequences' encoder work: LSSP pays
    groups = {
        64 - ranks: sorted({e.vision.lssp for e in encoders})
        for ranks, encoders in encoder_variants(long_items, "disaggregated", 64, 8, pp=9)
    }
    # several nodes: an LSSP group starts on a multiple of its size (the encoders from rank 36: 4 ranks, not 8)
    assert groups == {9: [1], 18: [1, 2], 36: [1, 2, 4]}
    one_node = encoder_variants(long_items, "disaggregated", 8, 8, pp=3)
    assert [ranks for ranks, _ in one_node] == [2, 5]  # LLM 6 or 3 GPUs
    assert {e.vision.lssp for e in one_node[1][1]} == {1, 2}  # ranks 3..7 of one node: any group stays inside


def test_every_disaggregated_plan_is_one_megatron_builds_and_the_runtime_runs():
    """Each Cell's plans: the LLM's stages hold equal layers (chunks too), its data parallelism divides the
    global batch, encoders and LLM fill the Cell; the name reads back to the plan the runtime executes."""
    w = paper_workload("A", 0.5)
    layers, found = w.shape.n_layers, []
    for pp in (3, 4, 6):
        cell = search_cell(w, H100, 64, 8, pp, eff=Efficiency(), layout="disaggregated")
        found += [e.plan for e in [cell.best, *cell.runners_up] if e is not None]
    assert {p.pp for p in found} == {3, 4, 6}
    for plan in found:
        assert layers % (plan.pp * plan.virtual_stages) == 0 and w.global_batch % plan.dp == 0
        assert plan.world_size == 64 and plan.encoders.ranks >= 1
        assert ParallelPlan.parse(plan.name) == plan
        plan.check_world(64)
        plan.check_model(w.shape)
    assert 8 not in pipeline_depths(w, 64, "disaggregated")  # 36 layers do not split 8 ways evenly


def test_the_best_disaggregated_cell_is_no_slower_than_the_half_and_half_split():
    """The split the search tried before (half the GPUs each) is among DistTrain's: the best is at least as fast."""
    w = paper_workload("B", 0.5)
    best = best_for_gpus(w, H100, 128, 8, eff=Efficiency(), layout="disaggregated")
    half = search_cell(w, H100, 128, 8, 1, eff=Efficiency(), layout="disaggregated")
    half_best = min(
        (e for e in [half.best, *half.runners_up] if e is not None and e.plan.encoders.ranks == 64),
        key=lambda e: e.step_time_s,
    )
    assert best is not None and best.best is not None and best.best.step_time_s <= half_best.step_time_s
    assert 64 in [ranks for ranks, _ in encoder_variants(w, "disaggregated", 128, 8, pp=1)]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]

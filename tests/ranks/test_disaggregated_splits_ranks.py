"""The `disaggregated` splits DistTrain's orchestration adds to the plan search (estimator.orchestration) on gloo:
an LLM whose pipeline depth is not a power of two, beside its encoders' own rank, trains like one process."""

from __future__ import annotations

from tests.helpers.plans import GRAD_ACCUM, check_plans


def test_a_three_stage_llm_beside_one_encoder_rank_trains_like_one_process(tmp_path):
    """Three LLM stages on ranks 0-2 (the debug model's four layers split 2/1/1), the encoders on rank 3. GPipe:
    the helpers' recipe runs GRAD_ACCUM micro-batches, fewer than 1F1B needs on three stages (the search's
    `pipeline.schedule_refusal` never hands 1F1B fewer)."""
    assert GRAD_ACCUM < 3
    metrics = check_plans(tmp_path, 4, [("debug", "dp1-pp3g+disagg1")])
    assert all(m["bubble_pct"] > 0 for m in metrics["debug", "dp1-pp3g+disagg1"])

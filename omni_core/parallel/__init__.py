"""Parallel layouts applied to a model from outside: `parallelize` (TP -> EP -> CP -> AC -> compile -> FSDP2),
`pipeline` (stages and schedules), `context` (Ulysses and ring attention), `expert` (expert-parallel MoE).
The plan they apply is `omni_core.common.plan.ParallelPlan`."""

"""The scheduler's real-mode tests share a two-job recipe on two CPU slots (this machine's by default) and the
no-double-booking check (the decisions in one process, and the experiment flow that trains the jobs)."""

from __future__ import annotations

from omni_core.scheduler.local import ScheduleRun

# Overrides of tests.helpers.recipes' base: job a (6 steps) placed alone, b (3 steps) arriving a second later.
SCHEDULED = {
    "experiment.name": "sched-test", "experiment.seed": 0,
    "data.synthetic.num_samples": 60, "data.seq_len": 256, "model.flavor": "debug",
    "cluster.name": "local", "cluster.slots": 2,
    "jobs": [{"name": "a", "model": "debug", "global_batch": 2, "iterations": 6},
             {"name": "b", "model": "debug", "global_batch": 2, "iterations": 3, "arrival_s": 1.0}],
    "schedule.policy": "crius", "schedule.segment_steps": 3,
    "train.warmup_steps": 1, "train.log_every": 1, "train.ckpt_every": 0, "train.timeout_s": 300,
    "eval.max_batches": 2, "tracking.flush_every_s": 0.5,
    # a slow link (0.2 GB/s), so that plain data parallelism is clearly the best 2-slot plan (tensor parallelism
    # moves activations in every layer); with the catalogue's placeholder it is within 2% of TP, and the plans the
    # tests expect follow
    "estimate.gpus": {"cpu": {"intra_bw": 2.0e8}},
}  # fmt: skip


def assert_never_double_booked(result: ScheduleRun, slots: int) -> None:
    for s in result.segments:
        held = sum(o.num_gpus for o in result.segments if o.start_s <= s.start_s < o.end_s)
        assert held <= slots, f"{held} slots held at {s.start_s:.2f} s: {result.segments}"

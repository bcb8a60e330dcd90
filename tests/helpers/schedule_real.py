"""The scheduler's real-mode tests share a two-job recipe on two CPU slots (this machine's by default) and the
no-double-booking check (the decisions in one process, and the experiment flow that trains the jobs)."""

from __future__ import annotations

from omni_core.scheduler.local import ScheduleRun

RECIPE = """\
experiment: {{name: sched-test, output_dir: {out}, seed: 0}}
data:
  synthetic: {{num_samples: 60}}
  seq_len: 256
model: {{flavor: debug}}
cluster: {cluster}
jobs:
  - {{name: a, model: debug, global_batch: 2, iterations: 6}}
  - {{name: b, model: debug, global_batch: 2, iterations: 3, arrival_s: {b_arrives}}}
schedule: {{policy: crius, segment_steps: 3}}
train: {{warmup_steps: 1, log_every: 1, ckpt_every: 0, timeout_s: 300}}
eval: {{max_batches: 2}}
tracking: {{flush_every_s: 0.5}}
# a slow link (0.2 GB/s), so that plain data parallelism is clearly the best 2-slot plan (tensor parallelism moves
# activations in every layer); with the catalogue's placeholder it is within 2% of TP, and the plans below follow
estimate: {{gpus: {{cpu: {{intra_bw: 2.0e8}}}}}}
"""


def write_recipe(tmp_path, b_arrives: float = 1.0, cluster: str = "{name: local, slots: 2}", **fields: str):
    path = tmp_path / "recipe.yaml"
    text = RECIPE.format(out=tmp_path / "out", b_arrives=b_arrives, cluster=cluster)
    path.write_text(text + "".join(f"{k}: {v}\n" for k, v in fields.items()))
    return path


def assert_never_double_booked(result: ScheduleRun, slots: int) -> None:
    for s in result.segments:
        held = sum(o.num_gpus for o in result.segments if o.start_s <= s.start_s < o.end_s)
        assert held <= slots, f"{held} slots held at {s.start_s:.2f} s: {result.segments}"

"""The validation's cases: a model flavor under a plan at a sequence length, micro-batch, accumulation and data
mix (`Case`), the recipe the runtime trains for one, and the sets the CPU and GPU validations run."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from omni_core.common.plan import ParallelPlan
from omni_core.measure.probe_device import CPU_PROBES, ProbeDevice

if TYPE_CHECKING:
    from omni_core.recipe import Recipe

MIXES = {
    "text": {"text": 1.0},
    "image": {"text": 0.2, "image": 0.8},
    "audio": {"text": 0.3, "audio": 0.7},
    "mixed": {"text": 0.4, "image": 0.4, "audio": 0.2},
}


@dataclass(frozen=True)
class Case:
    """One validation run: a model flavor under a plan (`ParallelPlan` name; its world size is the number of
    ranks), a packed sequence length, micro-batch, gradient accumulation and data mix."""

    flavor: str
    plan: str
    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    mix: str = "mixed"
    steps: int = 6

    @property
    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan.parse(self.plan)

    @property
    def world(self) -> int:
        return self.parallel_plan.world_size

    @property
    def name(self) -> str:
        return f"{self.flavor}-{self.plan}-s{self.seq_len}-mb{self.micro_batch}-ga{self.grad_accum}-{self.mix}"

    @property
    def global_batch(self) -> int:
        return self.parallel_plan.dp * self.micro_batch * self.grad_accum


def case_recipe(case: Case, root: Path, at: ProbeDevice = CPU_PROBES) -> Recipe:
    """The recipe the runtime trains for a case: its plan, the probed device's dtype (float32 on CPU, bfloat16
    on GPUs), a metric call every step (`measure` saves no checkpoint)."""
    from omni_core.recipe import Recipe

    plan = case.parallel_plan
    backend = "nccl" if at.device == "cuda" else "auto"
    return Recipe.model_validate(
        {
            "experiment": {"name": f"val-{case.mix}-s{case.seq_len}", "output_dir": str(root), "seed": 0},
            "data": {
                "synthetic": {"num_samples": 400, "mix": MIXES[case.mix]},
                "seq_len": case.seq_len,
                "micro_batch": case.micro_batch,
                "path": str(root / "data" / f"{case.mix}"),
            },
            "model": {"flavor": case.flavor},
            "parallel": {"nproc": plan.world_size, "backend": backend, **plan.recipe_fields()},
            "train": {
                "steps": case.steps,
                "grad_accum": case.grad_accum,
                "warmup_steps": 1,
                "log_every": 1,
                "ckpt_every": 0,
                "resume": False,
                "dtype": at.dtype,
                "ckpt_dir": str(root / "ckpt" / case.name),
            },
        }
    )


def validation_cases(quick: bool) -> list[Case]:
    """Plans over world 1-4: DP (FSDP, HSDP), TP, PP (1F1B, interleaved, GPipe), CP (Ulysses, ring), EP and
    their combinations, and the encoders' omni (sharded weights and the joint schedule too) and disaggregated
    layouts beside coupled ones, on the debug, debug-moe and small flavors and four mixes. Quick: 12 short
    cases (5 steps); full: 39, with longer sequences and 10 steps."""
    if quick:
        return [replace(c, steps=5) for c in _quick_cases()]
    return [replace(c, steps=10) for c in _full_cases()]


def _quick_cases() -> list[Case]:
    """One case per mechanism, at short sequences: the quick validation's minute or two."""
    d, moe, small = "debug", "debug-moe", "small"
    return [
        Case(d, "dp1", 256, mix="text"),
        Case(small, "dp1", 64),
        Case(d, "dp2", 256),
        Case(d, "dp1-tp2", 256, mix="audio"),
        Case(d, "dp1-pp2v2", 128, grad_accum=4, mix="image"),
        Case(d, "dp1-cp2r", 256, mix="text"),
        Case(moe, "dp2-ep2", 128),
        Case(d, "dp1-pp3", 128, grad_accum=3),
        Case(d, "dp2-pp2", 128, grad_accum=2),
        Case(moe, "dp2-cp2u-ep2", 128),
        Case(d, "dp2+omni", 256, mix="image"),
        Case(d, "dp1+disagg1", 256, mix="image"),
    ]


def _full_cases() -> list[Case]:
    """The mechanisms at longer sequences, each on more than one flavor, world size or mix."""
    d, moe, small = "debug", "debug-moe", "small"
    return [
        Case(d, "dp1", 256),
        Case(d, "dp1", 512, mix="text"),
        Case(d, "dp1", 512, mix="image"),
        Case(d, "dp1", 256, grad_accum=2, mix="audio"),
        Case(moe, "dp1", 256),
        Case(small, "dp1", 128),
        Case(d, "dp2", 256),
        Case(d, "dp2x1", 256, mix="text"),
        Case(d, "dp1-tp2", 256),
        Case(d, "dp1-pp2", 256, grad_accum=4),
        Case(d, "dp1-pp2v2", 256, grad_accum=4, mix="image"),
        Case(d, "dp1-pp2g", 256, grad_accum=2, mix="text"),
        Case(d, "dp1-cp2u", 512),
        Case(d, "dp1-cp2r", 512, mix="text"),
        Case(moe, "dp2-ep2", 256),
        Case(moe, "dp1-tp2", 256, mix="text"),
        Case(small, "dp1-tp2", 128, mix="text"),
        Case(small, "dp2", 64, mix="image"),
        Case(d, "dp2", 256, micro_batch=2),
        Case(d, "dp3", 256),
        Case(d, "dp1-pp3", 256, grad_accum=3),
        Case(d, "dp3", 256, micro_batch=2, mix="image"),
        Case(d, "dp4", 256, mix="audio"),
        Case(d, "dp2-tp2", 256),
        Case(d, "dp2-pp2", 256, grad_accum=2),
        Case(d, "dp2x2", 256, mix="image"),
        Case(d, "dp2-cp2r", 512),
        Case(moe, "dp2-cp2u-ep2", 256),
        Case(d, "dp1-tp2-cp2u", 512, mix="text"),
        Case(d, "dp1-pp4g", 256, grad_accum=4),
        Case(d, "dp2+omni", 256, mix="image"),
        Case(d, "dp1-tp2+omni", 256, mix="image"),
        Case(d, "dp1-pp2+omni", 256, grad_accum=4),
        Case(d, "dp2-tp2+omni", 256, mix="image"),
        Case(d, "dp1+disagg1", 256, mix="image"),
        Case(d, "dp2+disagg1", 256, mix="image"),
        Case(d, "dp1-tp2+disagg2", 256, mix="image"),
        Case(d, "dp2+omni.v-fsdp.a-fsdp", 256, mix="image"),
        Case(d, "dp1-pp2+omni-joint", 256, grad_accum=4, mix="image"),
    ]


def gpu_validation_cases(gpus: int, quick: bool) -> list[Case]:
    """A dozen plans on one GPU (debug, small, debug-moe and debug-enc flavors at 1-4k tokens, micro-batches
    and accumulation, four mixes), and on 2 and 4 GPUs where there are that many: DP (FSDP), TP, PP and the
    encoders' omni and disaggregated layouts. Quick: four one-GPU cases and one per world size, 6 steps."""
    d, small, moe, enc = "debug", "small", "debug-moe", "debug-enc"
    one = [
        Case(small, "dp1", 2048, mix="text"),
        Case(small, "dp1", 2048, micro_batch=4),
        Case(d, "dp1", 4096),
        Case(moe, "dp1", 2048),
        Case(small, "dp1", 4096, micro_batch=2, mix="image"),
        Case(small, "dp1", 1024, grad_accum=4, mix="audio"),
        Case(d, "dp1", 1024, micro_batch=8, mix="text"),
        Case(enc, "dp1", 2048, mix="image"),
        Case(small, "dp1", 1024, micro_batch=8, mix="mixed"),
        Case(moe, "dp1", 4096, micro_batch=2, mix="text"),
        Case(d, "dp1", 2048, grad_accum=2, mix="audio"),
        Case(small, "dp1", 4096, mix="mixed"),
    ]
    two = [
        Case(small, "dp2", 2048),
        Case(small, "dp1-tp2", 2048, mix="text"),
        Case(small, "dp1-pp2", 2048, grad_accum=4),
        Case(enc, "dp2+omni", 2048, mix="image"),
        Case(enc, "dp1+disagg1", 2048, mix="image"),
    ]
    four = [
        Case(small, "dp4", 2048),
        Case(small, "dp2-tp2", 2048),
        Case(small, "dp1-pp4g", 2048, grad_accum=4),
        Case(enc, "dp2-tp2+omni", 2048, mix="image"),
        Case(enc, "dp4+omni.v-fsdp.a-fsdp", 2048, mix="image"),
    ]
    if quick:
        one, two, four = one[:4], two[:1], four[:1]
    cases = one + two * (gpus >= 2) + four * (gpus >= 4)
    return [replace(c, steps=6 if quick else 10) for c in cases]

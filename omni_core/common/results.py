"""Typed results that stages hand to each other and log to MLflow: JSON in, JSON out, no globals."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict

R = TypeVar("R", bound="Result")


class Result(BaseModel):
    # NaN/inf survive the JSON round trip (e.g. the loss of a run that trained no step)
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls: type[R], text: str) -> R:
        return cls.model_validate_json(text)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # atomic: a reader never sees half a file
        return path

    @classmethod
    def load(cls: type[R], path: str | Path) -> R:
        return cls.from_json(Path(path).read_text())


class TrainResult(Result):
    steps: int
    world_size: int
    plan: str
    initial_loss: float
    final_loss: float  # mean over the last 10 steps
    tokens_per_s: float  # real (non-padding) tokens over all ranks per second of training steps
    samples_per_s: float
    wall_s: float  # seconds in training steps over the whole run (resumes included), checkpoints excluded
    logging_overhead_pct: float  # share of step time spent inside metric-logging calls on rank 0
    mfu_pct: float | None  # model FLOPs / (step time x peak of all ranks' devices); None: peak unknown
    peak_mem_mb: float  # rank 0: peak allocated GPU memory, or peak resident memory on CPU
    checkpoint: str  # directory of the newest complete checkpoint ("" when the run saved none)
    resumed_from_step: int = 0
    launch_step_s: float = 0.0  # seconds in this launch's steps (steps - resumed_from_step of them)
    launch_samples: int = 0  # samples this launch trained on
    mfu_peak: str = ""  # what mfu_pct is relative to: the device, the precision in use, and whence the figure

    @property
    def step_s(self) -> float:
        """Mean seconds per step of this launch (nan when it trained none)."""
        trained = self.steps - self.resumed_from_step
        return self.launch_step_s / trained if trained > 0 else float("nan")

    @property
    def launch_samples_per_s(self) -> float:
        return self.launch_samples / self.launch_step_s if self.launch_step_s > 0 else 0.0

    @property
    def loss_ratio(self) -> float:
        return self.final_loss / self.initial_loss


class ModalityScore(Result):
    loss: float
    perplexity: float
    tokens: int


class TaskScore(Result):
    """Greedy captions/transcripts of held-out documents against their references."""

    samples: int
    word_accuracy: float  # share of reference words (attributes) reproduced at their position
    exact_match: float
    answer_exact_match: float  # equal once whitespace and case are normalised
    answer_token_f1: float  # SQuAD-style F1 of the normalised words
    examples: list[tuple[str, str]]  # a few (decoded, reference) pairs, for people reading the report


class EvalReport(Result):
    checkpoint: str
    step: int
    samples: int
    loss: float
    perplexity: float
    per_modality: dict[str, ModalityScore]
    task: dict[str, TaskScore] = {}  # per modality with media (image, audio)

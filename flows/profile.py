"""Profile stage: make sure the dataset exists, measure it, and log what was measured."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from flows import resolve, stage_dir
from omni_core.data.profile import profile_dataset
from omni_core.data.profile_result import DatasetProfile
from omni_core.recipe import Recipe
from omni_core.tracking import stage_run


def headline_numbers(profile: DatasetProfile) -> dict[str, float]:
    """What one compares across runs; histograms stay in profile.json and the figures."""
    numbers = {
        "profile/samples": profile.total_samples,
        "profile/tokens": profile.total_tokens,
        "profile/packed_sequences": profile.packed_sequences,
        "profile/packing_efficiency": profile.packing_efficiency,
    }
    for modality, m in profile.modalities.items():
        numbers[f"profile/{modality}/share"] = m.share
        numbers[f"profile/{modality}/encoder_tokens_mean"] = m.encoder_tokens_mean
        for stat in ("mean", "p50", "p90", "p99", "max"):
            numbers[f"profile/{modality}/tokens_{stat}"] = getattr(m, stat)
    numbers.update({f"profile/skipped/{reason}": n for reason, n in profile.skipped.items()})
    for policy, b in profile.balance.items():
        numbers[f"profile/balance/{policy}/imbalance"] = b.imbalance
        numbers[f"profile/balance/{policy}/fill"] = b.fill
    return numbers


@flow(name="profile")
def profile_flow(recipe: Recipe | str, overrides: list[str] | None = None) -> DatasetProfile:
    """Profile the dataset (profile_dataset generates it first if it is missing): modality mix, token
    lengths. Logs profile.json, its figures and headline numbers to the "profile" run."""
    r = resolve(recipe, overrides)
    with stage_run("profile", r, flow_run_id=flow_run.id) as run:
        out_dir = stage_dir(r, run.run_id)
        profile, _ = profile_dataset(r, out_dir)  # writes profile.json and the figures into out_dir
        run.set_tags({"data.manifest": profile.manifest})
        run.log_metrics(headline_numbers(profile), step=0)
        run.log_artifacts(out_dir)
        return profile

"""Grouped reordering in the loaders (`data.balance`): the placement is a deterministic permutation of the
window that every member of a group computes alike, balances the predicted cost, survives a resume exactly, and
leaves the loss and gradients of a global batch unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_core.common.plan import ParallelPlan
from omni_core.data.balance import Balance, SampleCost, place, simulate
from omni_core.data.balance_groups import balance_group_size
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.packing import collate
from omni_core.data.profile import profile_dataset
from omni_core.estimator.recipe_cells import flavor_workload
from omni_core.models.omni import build_model
from omni_core.recipe.loader import override_recipe
from omni_core.recipe.schema import Recipe
from omni_core.runtime.replica import ModelReplica
from omni_core.runtime.step import train_step
from tests.helpers.plans import CapturingOptimizers
from tests.helpers.recipes import build_recipe

FLAVOR = "debug-enc"


# drawn on the fly, images of 32-160 px beside the text: samples of very different cost to place
BALANCED = {
    "experiment.name": "bal", "experiment.seed": 3,
    "data.source": "dynamic", "data.seq_len": 512, "data.synthetic.num_samples": 2000,
    "data.synthetic.image_side_px": {"min": 32, "max": 160},
    "model.flavor": FLAVOR,
    "train.steps": 4, "train.grad_accum": 2, "train.dtype": "float32", "train.lr": 1e-3, "train.warmup_steps": 1,
}  # fmt: skip


def group_loaders(r: Recipe, members: int, policy: str = "grouped") -> list[PackedLoader]:
    cost = SampleCost.for_flavor(FLAVOR, patch_size=r.data.patch_size, n_mels=r.data.n_mels)
    dataset = open_dataset(r)
    return [PackedLoader(dataset, r.data, "train", m, members, 0, Balance(policy, members, m, 2, cost))
            for m in range(members)]


def test_the_placement_is_a_permutation_that_fits_and_does_not_depend_on_the_caller():
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 300, 200).tolist()
    costs = np.stack([rng.exponential(5.0, 200), np.array(tokens, dtype=float)], axis=1)
    where = place(tokens, costs, [0] * 200, ranks=4, bins=2, capacity=1000)
    assert where == place(tokens, costs.copy(), [0] * 200, ranks=4, bins=2, capacity=1000)
    used: dict[tuple[int, int], int] = {}
    for i, spot in enumerate(where):
        if spot is not None:
            used[spot] = used.get(spot, 0) + tokens[i]
    assert max(used.values()) <= 1000 and set(used) <= {(r, b) for r in range(4) for b in range(2)}
    assert sum(used.values()) >= 0.95 * 8 * 1000  # the window held 1.7x the batch: the bins are nearly full
    overdue = place(tokens, costs, [2] + [0] * 199, ranks=4, bins=2, capacity=1000)
    assert overdue[0] is not None  # an overdue item goes in before any choice


def test_members_of_a_group_share_one_window_and_split_it_without_loss_or_duplicates(tmp_path):
    r = build_recipe(tmp_path / "out", {**BALANCED, "data.synthetic.mix": {"text": 0.3, "image": 0.7}})
    loaders = group_loaders(r, members=2)
    streams = [loader.consumer(0) for loader in loaders]
    drawn = [[r.id for _ in range(6) for seq in stream.next_sequences() for r in seq] for stream in streams]
    assert not set(drawn[0]) & set(drawn[1])
    pools = [[p.item.id for p in stream.packer.pool] for stream in streams]
    assert pools[0] == pools[1]
    taken = sorted(drawn[0] + drawn[1] + pools[0], key=lambda name: int(name.rsplit("-", 1)[1]))
    one = streams[0].dataset.source.stream(streams[0].view, None, lambda _: None)
    expected = [one.next(0).id for _ in range(len(taken))]
    assert sorted(taken) == sorted(expected)


@pytest.mark.parametrize("mix", [{"text": 0.1, "image": 0.9}, {"text": 0.5, "image": 0.5},
                                 {"text": 0.3, "audio": 0.7}], ids=["9:1", "1:1", "audio"])
def test_grouped_batches_are_balanced_when_the_window_holds_enough_samples(tmp_path, mix):
    r = build_recipe(tmp_path / "out", {**BALANCED, "data.synthetic.mix": mix, "data.pack_lookahead": 3.0})
    grouped, plain = group_loaders(r, 2), group_loaders(r, 2, policy="none")
    ratio = {}
    for name, loaders in (("grouped", grouped), ("none", plain)):
        iters = [iter(loader) for loader in loaders]
        steps = []
        for _ in range(8):
            loads = [sum(sum(next(it).predicted_flops) for _ in range(2)) for it in iters]
            steps.append(max(loads) / float(np.mean(loads)))
        ratio[name] = float(np.median(steps))
    assert ratio["grouped"] <= 1.05 and ratio["grouped"] < ratio["none"], ratio


def test_a_resumed_grouped_loader_yields_the_batches_an_uninterrupted_one_would(tmp_path):
    r = build_recipe(tmp_path / "out", {**BALANCED, "data.synthetic.mix": {"text": 0.4, "image": 0.4, "audio": 0.2}})
    loader = group_loaders(r, 2)[1]
    it = iter(loader)
    for _ in range(3):  # mid-step: one of the two placed batches is still queued
        next(it)
    state = loader.state_dict()
    assert state["consumers"][0]["queued"]
    expected = [next(it) for _ in range(3)]
    resumed = group_loaders(r, 2)[1]
    resumed.load_state_dict(state)
    again = iter(resumed)
    for a, b in zip(expected, (next(again) for _ in range(3))):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.image_patches, b.image_patches)
    with pytest.raises(ValueError, match="balance"):
        group_loaders(r, 2, policy="global")[1].load_state_dict(state)


def test_reordering_changes_neither_the_loss_nor_the_gradients_of_a_global_batch(tmp_path):
    """The same documents, packed by rank as the grouped placement put them or with every sequence's documents
    reversed and the two members' batches swapped, train to the same loss and gradients."""
    r = build_recipe(tmp_path / "out", {**BALANCED, "data.synthetic.mix": {"text": 0.4, "image": 0.6},
                                        "data.seq_len": 256})
    streams = [loader.consumer(0) for loader in group_loaders(r, 2)]
    placed = [stream.next_sequences() for stream in streams]
    reordered = [[list(reversed(seq)) for seq in batch] for batch in reversed(placed)]
    results = []
    for batches in (placed, reordered):
        model = build_model(FLAVOR, patch_size=r.data.patch_size, n_mels=r.data.n_mels, seed=1)
        optimizers = CapturingOptimizers([model], r)
        packed = [collate([[streams[0].dataset.decode(x) for x in seq] for seq in batch], r.data) for batch in batches]
        stats = train_step(ModelReplica(ParallelPlan(), [model], None), optimizers, packed, grad_clip=0.0)
        results.append((stats.metrics["loss"], optimizers.grads))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_the_group_size_must_divide_the_data_ranks():
    assert balance_group_size("none", 4, 8, 8) == 1 and balance_group_size("global", 4, 8, 2) == 8
    assert balance_group_size("grouped", 0, 8, 4) == 4
    with pytest.raises(ValueError, match="data.balance.group_size=3"):
        balance_group_size("grouped", 3, 8, 8)


def test_the_profile_simulates_each_policy_and_the_estimator_reads_the_recipes(tmp_path):
    r = build_recipe(tmp_path / "out", {**BALANCED, "data.synthetic.mix": {"text": 0.5, "image": 0.5},
                                        "parallel.nproc": 2, "data.synthetic.num_samples": 400})
    profile, _ = profile_dataset(r, tmp_path / "profile")
    assert profile.balance_ranks == 2 and set(profile.balance) == {"none", "grouped", "global"}
    assert 1.0 <= profile.balance["grouped"].imbalance <= profile.balance["none"].imbalance
    grouped = flavor_workload(r, FLAVOR, 4, profile)
    assert grouped.loader_imbalance == profile.balance["grouped"].imbalance
    plain = override_recipe(r, ["data.balance.policy=none"])
    assert flavor_workload(plain, FLAVOR, 4, profile).loader_imbalance == profile.balance["none"].imbalance
    assert flavor_workload(plain, FLAVOR, 4, None).loader_imbalance == 0  # nothing simulated: the count's spread


def test_a_simulated_run_pays_its_rare_heavy_steps_in_full():
    """One step in four puts a heavy sample on one rank: the median step is balanced, the run is not."""
    tokens = np.full(64, 100)
    costs = np.tile([0.0, 1.0], (64, 1))
    costs[::8, 0] = 10.0  # rank 0 reads samples 0, 2, 4, ...: its every fourth step
    figures = simulate(tokens, costs, "none", ranks=2, group=1, bins=1, capacity=100, lookahead=1.0, steps=32)
    assert figures["imbalance"] == pytest.approx((11 + 3 * 1) / (6 + 3 * 1))
    assert figures["fill"] == 1.0

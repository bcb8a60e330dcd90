"""The model built on the meta device and filled where it lives (`runtime.model_init`): a flavor's weights are
those of the whole model's `init_weights` on the CPU, pretrained parts are their files' tensors, projectors
start from the seed, and an LLM whose tokenizer added tokens gets rows at the mean of the file's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omni_core.common.plan import ParallelPlan
from omni_core.models.hf_import import load_pretrained, read_shard
from omni_core.models.omni import build_model
from omni_core.models.pretrained import omni_args
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.replica import build_replica
from tests.helpers.hf_parts import with_added_rows, write_llm, write_parts
from tests.helpers.models import N_MELS, PATCH_SIZE
from tests.helpers.recipes import build_recipe

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_a_flavor_built_on_meta_has_the_cpu_builds_weights(flavor: str, tmp_path: Path) -> None:
    recipe = build_recipe(tmp_path, {"model.flavor": flavor, "experiment.seed": 11})
    built = build_replica(recipe, ParallelPlan(), CPU, torch.float32).parts[0].state_dict()
    reference = build_model(flavor, patch_size=PATCH_SIZE, n_mels=N_MELS, seed=11).state_dict()
    assert built.keys() == reference.keys()
    assert all(torch.equal(built[name], value) for name, value in reference.items())


def test_pretrained_parts_are_their_files_and_projectors_the_seeds(tmp_path: Path) -> None:
    parts = write_parts(tmp_path / "parts")
    models = [build_replica(build_recipe(tmp_path, {"model.pretrained": parts, "experiment.seed": seed}),
                            ParallelPlan(), CPU, torch.float32).parts[0] for seed in (1, 1, 2)]
    model = models[0]
    for part, folder in parts.items():
        reference, _ = load_pretrained(folder, part)
        ours = getattr(model, part).state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(ours[name], with_added_rows(value, ours[name].shape), rtol=0, atol=1e-7)
    assert model.args.llm.vocab_size == reference_vocab(parts["llm"]) + 3  # <image>, <audio>, <video> added
    assert model.args.vision.dim == 48 and model.args.llm.dim == 64  # the configs', not the flavor's
    assert model.projectors["image"].fc1.in_features == 48 and model.projectors["audio"].fc2.out_features == 64
    same, other = models[1].projectors.state_dict(), models[2].projectors.state_dict()
    for name, value in model.projectors.state_dict().items():
        assert torch.equal(value, same[name]), name
        assert name.endswith("bias") or not torch.equal(value, other[name]), name


def reference_vocab(folder: str) -> int:
    return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


@pytest.mark.parametrize("tied", [False, True])
def test_added_tokens_get_the_mean_of_the_files_rows(tied: bool, tmp_path: Path) -> None:
    folder = write_llm(tmp_path / "llm", tied=tied, vocab_size=320)
    args, _ = omni_args("debug", {"llm": str(folder)}, patch_size=PATCH_SIZE, n_mels=N_MELS, vocab_size=330)
    assert args.llm.vocab_size == 330 and args.llm.tied_embeddings == tied
    stored, _ = load_pretrained(folder, "llm")
    rows = read_shard(folder / "model.safetensors", "model.embed_tokens.weight", torch.Size([330, 64]), None)
    old = stored.tok_embeddings.weight
    assert torch.equal(rows[:320], old)
    torch.testing.assert_close(rows[320:], old.mean(0, keepdim=True).expand(10, -1), rtol=0, atol=1e-7)
    box = (slice(300, 325), slice(16, 32))  # a shard across the boundary: the file's rows, then the mean's
    torch.testing.assert_close(read_shard(folder / "model.safetensors", "model.embed_tokens.weight",
                                          torch.Size([330, 64]), box), rows[box], rtol=0, atol=1e-7)


def test_the_training_hash_follows_the_starting_weights(tmp_path: Path) -> None:
    """A checkpoint folder belongs to what was trained: other pretrained folders or another init_from start
    afresh instead of resuming a foreign run."""
    hashes = {build_recipe(tmp_path, overrides).training_hash() for overrides in (
        {}, {"model.pretrained.llm": "a"}, {"model.pretrained.llm": "b"}, {"model.init_from": "c"})}
    assert len(hashes) == 4


def test_balancing_and_profiling_price_the_pretrained_parts(tmp_path: Path) -> None:
    """The loader's and the profiler's FLOP model is the recipe's model: the pretrained parts' dimensions, not the
    flavor's (the tiny parts here are smaller than the debug flavor in every width)."""
    from omni_core.data.flops import FlopModel
    from omni_core.models import flops as model_flops

    parts = write_parts(tmp_path / "parts")
    recipe = build_recipe(tmp_path, {"model.pretrained": parts})
    priced, flavor = FlopModel.for_recipe(recipe), FlopModel.for_flavor("debug", patch_size=PATCH_SIZE, n_mels=N_MELS)
    args = omni_args("debug", parts, patch_size=PATCH_SIZE, n_mels=N_MELS)[0]
    tokens = model_flops.TRAIN_FACTOR * model_flops.llm_forward_flops(args.llm, [100])
    assert priced.llm(100) == pytest.approx(tokens) and priced.llm(100) != pytest.approx(flavor.llm(100))
    assert priced.vision_per_patch < flavor.vision_per_patch and priced.audio_per_frame < flavor.audio_per_frame
    no_parts = build_recipe(tmp_path, {})
    assert FlopModel.for_recipe(no_parts) == flavor


def test_the_log_names_the_pretrained_parts(tmp_path: Path) -> None:
    from omni_core.runtime.trainer import model_name

    assert model_name(build_recipe(tmp_path, {})) == "debug"
    some = build_recipe(tmp_path, {"model.pretrained": {"llm": "/m/Qwen2-0.5B", "vision": "/m/siglip"}})
    assert model_name(some) == "llm Qwen2-0.5B + vision siglip (otherwise the debug flavor)"


def test_the_estimate_prices_the_recipes_pretrained_model(tmp_path: Path) -> None:
    """`omni estimate` and the runtime's plan check price the model the recipe builds: its pretrained LLM (2
    layers, 4 query and 2 KV heads here), not the debug flavor it replaces, and without importing torch."""
    import subprocess
    import sys

    from omni_core.estimator.recipe_cells import flavor_workload
    from omni_core.models.flavors import get_flavor

    parts = write_parts(tmp_path / "parts")
    recipe = build_recipe(tmp_path, {"model.pretrained": parts})
    shape = flavor_workload(recipe, "debug", 2).shape
    assert (shape.n_layers, shape.n_heads, shape.n_kv_heads) == (2, 4, 2)
    debug = get_flavor("debug", patch_size=PATCH_SIZE, n_mels=N_MELS).llm
    assert flavor_workload(build_recipe(tmp_path, {}), "debug", 2).shape.n_layers == debug.n_layers != 2
    code = (
        "import sys; from omni_core.models.pretrained import omni_args; "
        f"omni_args('debug', {parts!r}, patch_size={PATCH_SIZE}, n_mels={N_MELS}); print('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"

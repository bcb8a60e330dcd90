"""Recipe loading: extends, --set overrides, FILE:LINE error reports, hashing, dumping, flattening."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omni_core.recipe import Recipe, RecipeError, dump_recipe, flatten_recipe, load_recipe, recipe_hash

FULL_RECIPE = """\
experiment:
  name: demo
  seed: 7
data:
  synthetic:
    num_samples: 64
    mix: {text: 0.5, image: 0.25, audio: 0.25}
model:
  freeze: [vision]
cluster:
  node_groups:
    - {gpu_type: a100, nodes: 2, gpus_per_node: 8}
jobs:
  - name: small
    model: bert__1.3B
    global_batch: 32
    iterations: 100
  - name: large
    model: gpt__7B
    global_batch: 64
    iterations: 10
    deadline_s: 3600
train:
  steps: 20
  lr: 1e-3
"""


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(RecipeError) as caught:
        load_recipe(path, overrides)
    assert str(caught.value).splitlines() == caught.value.problems
    return caught.value.problems


def test_good_recipe_loads_with_defaults_filled(tmp_path):
    recipe = load_recipe(write(tmp_path, "r.yaml", FULL_RECIPE))
    assert isinstance(recipe, Recipe)
    assert recipe.experiment.seed == 7
    assert recipe.train.lr == pytest.approx(1e-3)
    assert recipe.train.warmup_steps == 10  # default
    assert [job.name for job in recipe.jobs] == ["small", "large"]
    assert recipe.jobs[1].deadline_s == 3600.0
    assert recipe.cluster.node_groups[0].gpus_per_node == 8
    assert recipe.model.freeze == ["vision"]


def test_extends_merges_mappings_and_replaces_lists_through_a_chain(tmp_path):
    write(tmp_path, "root.yaml", "experiment: {name: root, seed: 1}\neval: {max_batches: 3}\n")
    write(
        tmp_path,
        "base.yaml",
        """\
        extends: root.yaml
        model: {flavor: small, freeze: [vision, audio]}
        train: {steps: 50, lr: 0.01}
        """,
    )
    (tmp_path / "sub").mkdir()
    child = write(
        tmp_path / "sub",
        "child.yaml",
        """\
        extends: ../base.yaml
        experiment: {name: child}
        model: {freeze: [llm]}
        train: {lr: 0.5}
        """,
    )
    recipe = load_recipe(child)
    assert recipe.experiment.name == "child"
    assert recipe.experiment.seed == 1  # from root, two levels up
    assert recipe.eval.max_batches == 3
    assert recipe.model.flavor == "small"
    assert recipe.model.freeze == ["llm"]  # lists replace, never concatenate
    assert recipe.train.steps == 50
    assert recipe.train.lr == 0.5


def test_one_merge_rule_for_extends_and_set_sections_merge_free_keyed_maps_replace(tmp_path):
    """A child can drop a modality from its parent's mix, as --set can; both merge a section's fields."""
    base = write(tmp_path, "base.yaml", """\
        experiment: {name: x}
        data: {seq_len: 256, synthetic: {num_samples: 10, mix: {text: 0.5, image: 0.5}}}
        estimate: {gpus: {cpu: {memory_gb: 8}}}
        """)
    child = write(tmp_path, "child.yaml", "extends: base.yaml\ndata: {synthetic: {mix: {text: 1.0}}}\n")
    by_extends = load_recipe(child)
    by_set = load_recipe(base, ["data={synthetic: {mix: {text: 1.0}}}"])
    for recipe in (by_extends, by_set):
        assert recipe.data.synthetic.mix == {"text": 1.0}  # the map replaced: image dropped
        assert recipe.data.seq_len == 256 and recipe.data.synthetic.num_samples == 10  # the sections merged
    assert load_recipe(base, ["data.synthetic.mix={audio: 1.0}"]).data.synthetic.mix == {"audio": 1.0}
    gpus = load_recipe(base, ["estimate.gpus={a100: {memory_gb: 40}}"]).estimate.gpus
    assert set(gpus) == {"a100"}


def test_errors_point_at_the_file_that_defined_the_value(tmp_path):
    write(tmp_path, "base.yaml", "experiment: {name: x}\ntrain:\n  steps: abc\n  lr: 0.1\n")
    child = write(tmp_path, "child.yaml", "extends: base.yaml\ntrain:\n  lr: fast\n")
    steps_problem, lr_problem = problems_of(child)
    assert steps_problem.startswith(f"{tmp_path / 'base.yaml'}:3: train.steps: Input should be a valid integer")
    assert lr_problem.startswith(f"{child}:3: train.lr: Input should be a valid number")


def test_replaced_parent_list_leaves_no_stale_lines(tmp_path):
    write(
        tmp_path,
        "base.yaml",
        """\
        experiment: {name: x}
        jobs:
          - {name: a, model: m, global_batch: 1, iterations: 1}
          - {name: b, model: m, global_batch: 1, iterations: 1}
        """,
    )
    child = write(tmp_path, "child.yaml", "extends: base.yaml\njobs:\n  - {name: c}\n")
    problems = problems_of(child)
    assert problems[0] == f"{child}:3: jobs.0.model: missing required key"


def test_extends_cycle_is_reported_with_the_chain(tmp_path):
    first = write(tmp_path, "a.yaml", "experiment: {name: a}\nextends: b.yaml\n")
    second = write(tmp_path, "b.yaml", "extends: a.yaml\n")
    assert problems_of(first) == [f"{second}:1: extends: extends cycle: {first} -> {second} -> {first}"]


def test_missing_extends_file_points_at_the_extends_line(tmp_path):
    child = write(tmp_path, "child.yaml", "experiment: {name: a}\n\nextends: nowhere.yaml\n")
    assert problems_of(child) == [f"{child}:3: extends: file not found: {tmp_path / 'nowhere.yaml'}"]


def test_missing_recipe_file(tmp_path):
    assert problems_of(tmp_path / "absent.yaml") == [f"{tmp_path / 'absent.yaml'}: file not found"]


def test_unknown_keys_name_file_line_path_and_allowed_keys(tmp_path):
    path = write(
        tmp_path,
        "r.yaml",
        """\
        experiment:
          name: x
        trian:
          steps: 3
        data:
          synthetic:
            num_sampels: 5
        """,
    )
    problems = problems_of(path)
    assert f"{path}:3: trian: unknown key (allowed: experiment, data, model," in problems[1]
    assert problems[1].endswith("did you mean 'train'?")
    assert problems[0].startswith(f"{path}:7: data.synthetic.num_sampels: unknown key (allowed: num_samples, mix,")


def test_wrong_type_shows_line_and_value(tmp_path):
    path = write(tmp_path, "r.yaml", "experiment:\n  name: x\ntrain:\n  steps: 5\n  lr: fast\n")
    assert problems_of(path) == [
        f"{path}:5: train.lr: Input should be a valid number (got 'fast')"
    ]


def test_missing_required_key_points_at_its_section(tmp_path):
    path = write(
        tmp_path,
        "r.yaml",
        """\
        experiment:
          seed: 1
        jobs:
          - name: a
            model: m
            iterations: 2
        """,
    )
    assert problems_of(path) == [
        f"{path}:1: experiment.name: missing required key",
        f"{path}:4: jobs.0.global_batch: missing required key",
    ]


def test_section_validator_message_is_reported_without_pydantic_prefix(tmp_path):
    path = write(tmp_path, "r.yaml", "experiment: {name: x}\ndata:\n  synthetic:\n    audio_ms: {min: 9, max: 3}\n")
    assert problems_of(path) == [f"{path}:4: data.synthetic.audio_ms: max (3) must be >= min (9)"]


def test_all_problems_are_reported_at_once(tmp_path):
    path = write(tmp_path, "r.yaml", "experiment: {name: x}\ntrain: {steps: 0, lr: -1}\nmodel: {freeze: [eyes]}\n")
    problems = problems_of(path, ("eval.max_batches=zero",))
    assert [p.split(": ")[1] for p in problems] == ["model.freeze.0", "train.steps", "train.lr", "eval.max_batches"]


def test_set_overrides_are_parsed_as_yaml(tmp_path):
    path = write(tmp_path, "r.yaml", FULL_RECIPE + "tracking: {uri: 'http://x'}\n")
    recipe = load_recipe(
        path,
        [
            "train.lr=3e-4",
            "data.synthetic.mix={text: 1.0}",
            "model.freeze=[vision, audio]",
            "tracking.uri=null",
            "schedule.policy=gavel",  # a section the file never mentions
            "experiment.description=a=b",  # only the first '=' splits
        ],
    )
    assert recipe.train.lr == pytest.approx(3e-4)
    assert recipe.data.synthetic.mix == {"text": 1.0}
    assert recipe.model.freeze == ["vision", "audio"]
    assert recipe.tracking.uri is None
    assert recipe.schedule.policy == "gavel"
    assert recipe.experiment.description == "a=b"


def test_set_list_index_changes_only_that_item_even_through_yaml_aliases(tmp_path):
    path = write(
        tmp_path,
        "r.yaml",
        """\
        experiment: {name: x}
        data: {synthetic: {text_words: &range {min: 1, max: 5}, audio_ms: *range}}
        jobs:
          - &job {name: a, model: m, global_batch: 1, iterations: 1}
          - *job
        """,
    )
    recipe = load_recipe(path, ["jobs.1.iterations=5", "data.synthetic.audio_ms.max=9"])
    assert [job.iterations for job in recipe.jobs] == [1, 5]
    assert (recipe.data.synthetic.text_words.max, recipe.data.synthetic.audio_ms.max) == (5, 9)
    assert problems_of(path, ("jobs.2.iterations=5",)) == [
        "--set jobs.2.iterations=5: jobs.2.iterations: jobs has 2 item(s), no index 2"
    ]


def test_set_value_is_type_checked(tmp_path):
    path = write(tmp_path, "r.yaml", "experiment: {name: x}\n")
    assert problems_of(path, ("train.steps=abc",)) == [
        "--set train.steps=abc: train.steps: Input should be a valid integer (got 'abc')"
    ]


def test_set_unknown_key_is_rejected_as_coming_from_set(tmp_path):
    path = write(tmp_path, "r.yaml", "experiment: {name: x}\ntrain: {lr: 0.1}\n")
    nested, top_level = problems_of(path, ("optim.beta.x=1", "train.lrr=0.2"))
    assert nested.startswith("--set train.lrr=0.2: train.lrr: unknown key (allowed: steps, lr,")
    assert top_level.startswith("--set optim.beta.x=1: optim: unknown key (allowed: experiment,")


def test_malformed_set_is_a_clear_error(tmp_path):
    path = write(tmp_path, "r.yaml", "experiment: {name: x}\ntrain: {lr: 0.1}\n")
    assert problems_of(path, ("train.lr", "train.lr.x=1", "train..lr=1")) == [
        "--set train.lr: expected key=value, e.g. train.lr=1e-3",
        "--set train.lr.x=1: train.lr.x: train.lr is a float 0.1, it has no keys to set",
        "--set train..lr=1: train..lr: empty segment in dotted key",
    ]


def test_yaml_syntax_error_keeps_file_line_and_column(tmp_path):
    path = write(tmp_path, "r.yaml", "experiment:\n  name: x\ntrain:\n  lr: [1, 2\n  steps: 3\n")
    (problem,) = problems_of(path)
    expected = rf"{re.escape(str(path))}:5:\d+: invalid YAML: while parsing a flow sequence started at line 4: .+"
    assert re.fullmatch(expected, problem)


def test_top_level_must_be_a_mapping(tmp_path):
    path = write(tmp_path, "r.yaml", "- experiment\n- train\n")
    assert problems_of(path) == [f"{path}:1: top level must be a mapping of sections, got a list"]


def test_duplicate_keys_are_rejected_instead_of_silently_overwritten(tmp_path):
    path = write(tmp_path, "r.yaml", "experiment: {name: x}\ntrain:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n")
    assert problems_of(path) == [f"{path}:5: train.lr: duplicate key (first at line 3)"]


def test_yaml_merge_keys_may_override_without_counting_as_duplicates(tmp_path):
    path = write(
        tmp_path,
        "r.yaml",
        """\
        experiment: {name: x}
        jobs:
          - &job {name: a, model: m, global_batch: 1, iterations: 1}
          - <<: *job
            name: b
        """,
    )
    assert [job.name for job in load_recipe(path).jobs] == ["a", "b"]


def test_hash_ignores_key_order_and_extends_layout_but_not_content(tmp_path):
    flat = write(tmp_path, "flat.yaml", "experiment: {name: x, seed: 3}\ntrain: {lr: 0.1, steps: 9}\n")
    write(tmp_path, "base.yaml", "train: {steps: 9, lr: 0.5}\nexperiment: {seed: 3, name: base}\n")
    child = write(tmp_path, "child.yaml", "train: {lr: 0.1}\nextends: base.yaml\nexperiment: {name: x}\n")
    digest = recipe_hash(load_recipe(flat))
    assert re.fullmatch(r"[0-9a-f]{12}", digest)
    assert recipe_hash(load_recipe(child)) == digest
    assert recipe_hash(load_recipe(flat, ["train.steps=10"])) != digest


def test_dump_then_load_gives_an_equal_recipe(tmp_path):
    recipe = load_recipe(write(tmp_path, "r.yaml", FULL_RECIPE))
    text = dump_recipe(recipe)
    assert "  betas: [0.9, 0.95]\n" in text  # scalar lists stay readable
    assert text.index("experiment:") < text.index("train:")  # schema order, not alphabetical
    reloaded = load_recipe(write(tmp_path, "dumped.yaml", text))
    assert reloaded == recipe
    assert recipe_hash(reloaded) == recipe_hash(recipe)


def test_flatten_gives_dotted_string_params(tmp_path):
    flat = flatten_recipe(load_recipe(write(tmp_path, "r.yaml", FULL_RECIPE)))
    assert flat["experiment.name"] == "demo"
    assert flat["train.lr"] == "0.001"
    assert flat["train.resume"] == "true"
    assert flat["train.betas"] == "[0.9,0.95]"
    assert flat["model.freeze"] == '["vision"]'
    assert flat["data.synthetic.mix"] == '{"text":0.5,"image":0.25,"audio":0.25}'
    assert flat["data.synthetic.text_words.max"] == "24"
    assert flat["jobs.1.deadline_s"] == "3600.0"
    assert flat["cluster.node_groups.0.gpu_type"] == "a100"
    assert flat["tracking.uri"] == "null"
    assert all(isinstance(value, str) for value in flat.values())


@pytest.mark.parametrize(
    ("text", "overrides"),
    [
        ("experiment: {name: x}\ntrain: {lr: fast}\n", ()),
        ("# only a comment\n", ()),
        ("experiment: [\n", ()),
        ("experiment: {name: x}\n", ("nonsense",)),
        ("experiment: {name: x}\n", ("jobs.0.name=a",)),
        ("experiment: {name: x}\nextends: 7\n", ()),
        ("experiment: {name: x}\n1: 2\n", ()),
        ("experiment: !!python/object/apply:os.system [true]\n", ()),
        ("jobs: &loop [*loop]\n", ()),
    ],
)
def test_every_problem_line_is_file_line_path_message_never_a_traceback(tmp_path, text, overrides):
    path = write(tmp_path, "r.yaml", text)
    for problem in problems_of(path, overrides):
        assert "Traceback" not in problem
        assert problem.startswith((f"{path}:", "--set ")), problem


def test_loader_imports_neither_torch_nor_mlflow():
    code = "import sys, omni_core.recipe; print(sorted({'torch', 'mlflow'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"

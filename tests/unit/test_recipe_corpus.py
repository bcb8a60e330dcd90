"""A corpus of malformed recipes: each case is one small edit of recipes/quickstart.yaml (a YAML edit, or a
`--set`), and `omni recipe check` must refuse it with exit 2 and say, on the line that wrote the value, which
field is wrong and why. Static checks only: no launch, no network but loopback."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from flows.cli import main

REPO = Path(__file__).resolve().parents[2]
BASE = (REPO / "recipes" / "quickstart.yaml").read_text()


@dataclass(frozen=True)
class Case:
    """`replace` (old, new) edits the base recipe's text, `append` adds to its end, `sets` are `--set`s.
    `expect` must appear in the output right after the location: `FILE:LINE: ` for the line holding the text
    `at` (the edited line by default), `--set ...: ` for a case whose value came from an override, nothing
    when `at` is ""."""

    id: str
    expect: str
    replace: tuple[str, str] | None = None
    append: str = ""
    sets: tuple[str, ...] = ()
    at: str | None = None


def in_train(line: str) -> tuple[str, str]:
    """An edit adding `line` to the base recipe's train section."""
    return "keep_last: 2", f"keep_last: 2\n  {line}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CLOSED = closed_port()

SCHEMA = [
    # strict types: no bool or string is taken for a number, no number for a switch
    Case("steps-bool", "train.steps: Input should be a valid integer (got True)", ("steps: 300", "steps: true")),
    Case("steps-string", "train.steps: Input should be a valid integer (got '30')", ("steps: 300", "steps: '30'")),
    Case("steps-1e36", "train.steps: Input should be a valid integer (got 1e+36)", ("steps: 300", "steps: 1e36")),
    Case("steps-float", "train.steps: Input should be a valid integer (got 30.0)", ("steps: 300", "steps: 30.0")),
    Case("steps-zero", "train.steps: Input should be greater than or equal to 1", ("steps: 300", "steps: 0")),
    Case("steps-huge", "train.steps: Input should be less than or equal to 100000000",
         ("steps: 300", "steps: 1000000000000")),
    Case("lr-word", "train.lr: Input should be a valid number (got 'fast')", ("lr: 3.0e-3", "lr: fast")),
    Case("lr-bool", "train.lr: Input should be a valid number (got True)", ("lr: 3.0e-3", "lr: yes")),
    Case("lr-zero", "train.lr: Input should be greater than 0", ("lr: 3.0e-3", "lr: 0")),
    Case("lr-nan", "train.lr: Input should be a finite number", ("lr: 3.0e-3", "lr: .nan")),
    Case("warmup-past-steps", "train.warmup_steps: warmup_steps (500) exceeds steps (300)",
         ("warmup_steps: 20", "warmup_steps: 500")),
    Case("warmup-past-steps-set", "train.warmup_steps: warmup_steps (50) exceeds steps (20)",
         sets=("train.steps=20", "train.warmup_steps=50")),
    Case("betas-out-of-range", "train: betas (0.9, 1.0) must each be in [0, 1)", replace=in_train("betas: [0.9, 1.0]"),
         at="train:"),
    Case("betas-strings", "train.betas.0: Input should be a valid number (got '0.9')",
         replace=in_train("betas: ['0.9', 0.95]"), at="betas:"),
    Case("dtype-unknown", "train.dtype: Input should be 'auto', 'float32' or 'bfloat16' (got 'float16')",
         replace=in_train("dtype: float16")),
    Case("resume-number", "train.resume: Input should be a valid boolean (got 1)", replace=in_train("resume: 1")),
    Case("compile-words", "train.compile: Input should be a valid boolean (got 'yes please')",
         replace=in_train("compile: yes please")),
    Case("grad-accum-zero", "train.grad_accum: Input should be greater than or equal to 1",
         replace=in_train("grad_accum: 0")),
    Case("ckpt-every-negative", "train.ckpt_every: Input should be greater than or equal to 0",
         ("ckpt_every: 100", "ckpt_every: -1")),
    Case("timeout-zero", "train.timeout_s: Input should be greater than 0", replace=in_train("timeout_s: 0")),
    Case("train-typo", "train.stepz: unknown key (allowed: steps,", replace=in_train("stepz: 5")),
    Case("seq-len-small", "data.seq_len: Input should be greater than or equal to 16", ("seq_len: 512", "seq_len: 8")),
    Case("seq-len-huge", "data.seq_len: Input should be less than or equal to 1048576",
         ("seq_len: 512", "seq_len: 4000000")),
    Case("micro-batch-string", "data.micro_batch: Input should be a valid integer (got '2')",
         ("micro_batch: 1", "micro_batch: '2'")),
    Case("num-samples-1e12", "data.synthetic.num_samples: Input should be a valid integer (got 1000000000000.0)",
         ("num_samples: 2000", "num_samples: 1e12")),
    Case("num-samples-huge", "data.synthetic.num_samples: Input should be less than or equal to 100000000",
         ("num_samples: 2000", "num_samples: 1000000000000")),
    Case("mix-negative", "data.synthetic: mix needs non-negative shares with a positive sum",
         ("mix: {text: 0.4, image: 0.4, audio: 0.2}", "mix: {text: -1.0}"), at="synthetic:"),
    Case("mix-unknown-modality", "data.synthetic.mix.smell: invalid key: Input should be 'text', 'image', 'audio' or "
         "'video' (got 'smell')", ("mix: {text: 0.4, image: 0.4, audio: 0.2}", "mix: {smell: 1.0}")),
    Case("heldout-whole", "data.heldout_fraction: Input should be less than 1",
         ("micro_batch: 1", "micro_batch: 1\n  heldout_fraction: 1.5"), at="heldout_fraction"),
    Case("source-unknown", "data.source: Input should be 'synthetic', 'jsonl', 'wds' or 'dynamic' (got 'csv')",
         ("source: synthetic", "source: csv")),
    Case("patches-crossed", "data: min_image_patches (100) exceeds max_image_patches (64)",
         ("micro_batch: 1", "micro_batch: 1\n  min_image_patches: 100"), at="data:"),
    Case("all-frozen", "model.freeze: every part of the model is frozen (vision, audio, projectors, llm): nothing "
         "is left to train", ("flavor: debug", "flavor: debug\n  freeze: [vision, audio, projectors, llm]"),
         at="freeze:"),
    Case("freeze-unknown", "model.freeze.0: Input should be 'vision', 'audio', 'projectors' or 'llm' (got 'eyes')",
         ("flavor: debug", "flavor: debug\n  freeze: [eyes]"), at="freeze:"),
    Case("nproc-zero", "parallel.nproc: Input should be greater than or equal to 1", ("nproc: 2", "nproc: 0")),
    Case("nproc-huge", "parallel.nproc: Input should be less than or equal to 1024", ("nproc: 2", "nproc: 100000")),
    Case("dp-shard-zero", "parallel: dp_shard must be -1 (derived from the world size) or >= 1",
         ("nproc: 2", "nproc: 2\n  dp_shard: 0"), at="parallel:"),
    Case("auto-with-degrees", "parallel: plan is auto, so the estimate stage chooses tp",
         ("nproc: 2", "nproc: 2\n  plan: auto\n  tp: 2"), at="parallel:"),
    Case("encoder-ranks-coupled", "parallel.encoders: encoders.ranks=1 needs layout disaggregated",
         ("encoders: {layout: omni}", "encoders: {layout: coupled, ranks: 1}")),
    Case("name-pattern", "experiment.name: String should match pattern", ("name: quickstart", "name: 'quick start!'")),
    Case("name-missing", "experiment.name: missing required key", ("name: quickstart", "title: quickstart"),
         at="experiment:"),
    Case("alias-reserved", "tracking: model_alias 'latest' is reserved by MLflow", append="tracking:\n  model_alias: "
         "latest\n", at="tracking:"),
    Case("replan-without-checkpoints", "replan.enabled needs train.ckpt_every > 0",
         ("ckpt_every: 100", "ckpt_every: 0"), append="replan: {enabled: true}\n", at=""),
    Case("slots-not-power-of-two", "cluster: slots=3 must be a power of two", append="cluster: {slots: 3}\n",
         at="cluster:"),
    Case("duplicate-key", "train.steps: duplicate key (first at line", ("steps: 300", "steps: 300\n  steps: 400"),
         at="steps: 400"),
    Case("top-level-list", "top level must be a mapping of sections, got a list", (BASE, "- experiment: {name: x}\n"),
         at="- experiment"),
    Case("yaml-unclosed", "invalid YAML:", ("mix: {text: 0.4, image: 0.4, audio: 0.2}", "mix: {text: 0.4"), at=""),
    Case("nul-byte", "invalid YAML: unacceptable character #x0000 (special characters are not allowed)",
         ("steps: 300", "steps: 300\x00")),
    Case("extends-missing", "extends: file not found", ("experiment:", "extends: nowhere.yaml\nexperiment:"),
         at="extends:"),
    # overrides
    Case("set-list-index", "jobs.3.name: jobs has 0 item(s), no index 3", sets=("jobs.3.name=x",)),
    Case("set-no-equals", "expected key=value", sets=("train.steps",)),
    Case("set-empty-segment", "train..steps: empty segment in dotted key", sets=("train..steps=1",)),
    Case("set-into-number", "train.steps.x: train.steps is a int 300, it has no keys to set",
         sets=("train.steps.x=1",)),
    Case("set-bool-steps", "train.steps: Input should be a valid integer (got True)", sets=("train.steps=true",)),
    Case("set-bad-yaml", "train.lr: value is not valid YAML", sets=("train.lr=[1",)),
    Case("set-unknown-key", "train.stepz: unknown key", sets=("train.stepz=1",)),
]

LAUNCH = [
    # what only a launch used to find: the model, the plan on the world, data, checkpoints, tracking
    Case("flavor-unknown", "model.flavor: unknown model flavor 'nope'; known flavors: debug,",
         ("flavor: debug", "flavor: nope")),
    Case("tp-over-world", "parallel: world size 2 is not divisible by pp=1 x dp_replicate=1 x cp=1 x tp=3 = 3",
         ("nproc: 2", "nproc: 2\n  tp: 3"), at="parallel:"),
    Case("tp-over-world-set", "parallel: world size 2 is not divisible", sets=("parallel.tp=3",)),
    Case("tp-not-dividing-kv-heads", "parallel: plan dp1-tp4+omni does not fit the model: tp=4 does not divide "
         "n_kv_heads=2", sets=("parallel.nproc=4", "parallel.tp=4")),
    Case("pp-without-microbatches", "parallel: plan dp1-pp2+omni: pp=2 (1F1B) needs at least 2 micro-batches per "
         "step, got 1 (raise train.grad_accum)", ("nproc: 2", "nproc: 2\n  pp: 2"), at="parallel:"),
    Case("ep-on-dense", "parallel: plan dp2-ep2+omni does not fit the model: ep=2 needs an MoE model",
         sets=("parallel.ep=2",)),
    Case("cp-seq-len", "parallel: plan dp1-cp2u+omni does not fit the model: cp=2 (ulysses) x tp=1 needs seq_len=17 "
         "divisible by 2", sets=("parallel.cp=2", "data.seq_len=17"), at="--set parallel.cp=2"),
    Case("encoder-fsdp-compiled", "parallel: plan dp2+omni.v-fsdp: encoders.vision.fsdp with train.compile is not "
         "built", ("encoders: {layout: omni}", "encoders: {layout: omni, vision: {fsdp: true}}"),
         sets=("train.compile=true",), at="parallel:"),
    Case("group-size", "data.balance.group_size: data.balance.group_size=3 must divide the 2 data ranks of plan "
         "dp2+omni", ("micro_batch: 1", "micro_batch: 1\n  balance: {group_size: 3}"), at="balance:"),
    Case("data-missing", "data.path: data.source is 'jsonl' but {tmp}/missing does not exist",
         ("source: synthetic", "source: jsonl\n  path: {tmp}/missing"), at="path:"),
    Case("data-default-missing", "data.path: data.source is 'wds' but {tmp}/out/data/quickstart does not exist",
         ("source: synthetic", "source: wds"), at="data:"),
    Case("manifest-empty", "data.path: {tmp}/empty.jsonl (1 shards): no sample at all (empty)",
         ("source: synthetic", "source: jsonl\n  path: {tmp}/empty.jsonl"), at="path:"),
    Case("manifest-all-bad", "data.path: {tmp}/bad.jsonl (1 shards): no usable sample (2 bad_record skipped)",
         ("source: synthetic", "source: jsonl\n  path: {tmp}/bad.jsonl"), at="path:"),
    Case("wds-no-shards", "data.path: {tmp}/folder: no *.tar shard found",
         ("source: synthetic", "source: wds\n  path: {tmp}/folder"), at="path:"),
    Case("synthetic-on-s3", "data.path: data.path s3://bucket/data: data.source 'synthetic' generates locally",
         ("source: synthetic", "source: synthetic\n  path: s3://bucket/data"), at="path:"),
    Case("s3-endpoint-down", f"data.s3_endpoint_url: S3 endpoint http://127.0.0.1:{CLOSED} is not reachable",
         ("source: synthetic", "source: jsonl\n  path: s3://bucket/data\n"
                               f"  s3_endpoint_url: http://127.0.0.1:{CLOSED}"),
         at="s3_endpoint_url:"),
    Case("data-under-a-file", "experiment.output_dir: the dataset is generated into {tmp}/afile/out/data/quickstart, "
         "but {tmp}/afile is not a directory",
         ("seed: 0", "seed: 0\n  output_dir: {tmp}/afile/out"), at="output_dir:"),
    Case("ckpt-gs", "train.ckpt_dir: checkpoint location 'gs://bucket/ckpt': only local paths and s3:// are "
         "supported", replace=in_train("ckpt_dir: gs://bucket/ckpt")),
    Case("ckpt-no-bucket", "train.ckpt_dir: checkpoint location 's3:///ckpt' names no bucket",
         replace=in_train("ckpt_dir: s3:///ckpt")),
    Case("ckpt-is-a-file", "train.ckpt_dir: checkpoints go to {tmp}/afile, but {tmp}/afile is not a directory",
         replace=in_train("ckpt_dir: {tmp}/afile")),
    Case("ckpt-under-a-file", "train.ckpt_dir: checkpoints go to {tmp}/afile/ckpt, but {tmp}/afile is not a "
         "directory", sets=("train.ckpt_dir={tmp}/afile/ckpt",)),
    Case("tracking-ftp", "tracking.uri: MLflow tracking URI ftp://host/x: MLflow cannot track to ftp://",
         append="tracking: {uri: 'ftp://host/x'}\n", at="tracking:"),
    Case("tracking-down", f"tracking.uri: MLflow tracking server http://127.0.0.1:{CLOSED} is not reachable",
         sets=(f"tracking.uri=http://127.0.0.1:{CLOSED}",)),
    Case("tracking-no-folder", "tracking.uri: MLflow tracking URI sqlite:///{tmp}/none/mlflow.db: directory "
         "{tmp}/none does not exist", sets=("tracking.uri=sqlite:///{tmp}/none/mlflow.db",)),
]


@pytest.fixture(autouse=True)
def data_warnings_to_stderr(monkeypatch):
    """The readers warn about each bad entry they skip; here they go to this test's stderr, not through handlers
    an earlier test may have left on the root logger (on a stream since closed)."""
    monkeypatch.setattr(logging.getLogger("omni_core.data.sources"), "propagate", False)


@pytest.fixture
def workdir(tmp_path):
    """Files the cases point at: an empty manifest, an all-bad one, an empty folder, a plain file."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text("{not json\n[1, 2]\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("")
    return tmp_path


def fill(text: str, folder: Path) -> str:
    return text.replace("{tmp}", str(folder))


def recipe_file(folder: Path, case: Case) -> tuple[Path, str]:
    """The base recipe with the case's edit (its output under `folder` unless the edit places it), and the
    location its error names."""
    text = BASE
    if case.replace:
        old, new = case.replace
        assert old in text, f"{case.id}: the base recipe has no {old!r}"
        text = text.replace(old, fill(new, folder), 1)
    text += fill(case.append, folder)
    if "output_dir:" not in text:
        text = text.replace("  seed: 0\n", f"  seed: 0\n  output_dir: {folder}/out\n", 1)
    path = folder / "recipe.yaml"
    path.write_text(text)
    if case.at is not None and (case.at == "" or case.at.startswith("--set ")):
        return path, fill(case.at, folder) + (": " if case.at else "")
    if case.sets and case.at is None:
        return path, f"--set {fill(case.sets[-1], folder)}: "
    edited = case.replace[1] if case.replace else case.append
    marker = fill(case.at or (edited.splitlines() or [""])[-1], folder).strip()
    if not marker:
        return path, ""
    line = next(i for i, text_line in enumerate(text.splitlines(), 1) if marker in text_line)
    return path, f"{path}:{line}: "


def check(path: Path, sets: tuple[str, ...], folder: Path, capsys) -> tuple[int, str]:
    argv = ["recipe", "check", str(path)]
    for override in sets:
        argv += ["--set", fill(override, folder)]
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", SCHEMA + LAUNCH, ids=lambda case: case.id)
def test_a_malformed_recipe_is_refused_naming_its_line_and_field(case, workdir, capsys):
    path, where = recipe_file(workdir, case)
    code, err = check(path, case.sets, workdir, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert f"{where}{fill(case.expect, workdir)}" in err, err


def test_the_corpus_is_large():
    assert len(SCHEMA + LAUNCH) >= 60
    assert len({case.id for case in SCHEMA + LAUNCH}) == len(SCHEMA + LAUNCH)


def test_every_problem_comes_at_once(workdir, capsys):
    path, _ = recipe_file(workdir, Case("three", "", ("flavor: debug", "flavor: nope")))
    code, err = check(path, ("train.ckpt_dir=gs://b/c", f"tracking.uri=http://127.0.0.1:{CLOSED}"), workdir, capsys)
    assert code == 2
    for field in ("model.flavor: unknown model flavor", "train.ckpt_dir: checkpoint location",
                  "tracking.uri: MLflow tracking server"):
        assert field in err, err


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_passes_check(recipe, capsys, monkeypatch):
    """A study recipe's trace lies in the workspace's shared data beside the checkout (README), which a clone
    elsewhere lacks: that recipe is then skipped by name (`omni recipe check` refuses it, as it should)."""
    monkeypatch.chdir(REPO)
    trace = yaml.safe_load(recipe.read_text()).get("schedule", {}).get("trace")
    if trace and not (recipe.parent / trace).resolve().is_relative_to(REPO) and not (recipe.parent / trace).exists():
        pytest.skip(f"{recipe.name}: its trace {trace} (the workspace's shared data) is not on this machine")
    if recipe.name.startswith("mllm_"):
        pytest.skip(f"{recipe.name}: its pretrained folders are the user's to fill (tests/unit/test_mllm_stages.py)")
    assert main(["recipe", "check", str(recipe)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("ok ")


def test_yaml_exponents_without_a_dot_are_numbers(workdir, capsys):
    """Strict numbers need YAML 1.2's `1e-3` read as a float (YAML 1.1 read it as a string)."""
    case = Case("lr", "", ("lr: 3.0e-3", "lr: 1e-3"))
    path, _ = recipe_file(workdir, case)
    code, err = check(path, ("train.weight_decay=1E-2",), workdir, capsys)
    assert code == 0, err


def test_the_default_warmup_over_a_short_run_is_no_problem(workdir, capsys):
    path, _ = recipe_file(workdir, Case("short", "", ("  warmup_steps: 20\n", "")))
    assert check(path, ("train.steps=5",), workdir, capsys)[0] == 0


def test_a_full_disk_is_found_before_the_first_save(workdir, capsys, monkeypatch):
    usage = shutil.disk_usage(workdir)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))
    path, _ = recipe_file(workdir, Case("full", ""))
    code, err = check(path, (), workdir, capsys)
    assert code == 2
    assert f"experiment.output_dir: checkpoints go to {workdir}/out/quickstart/ckpt-" in err
    assert "has 1.0 MiB free, and one checkpoint of this model takes" in err


def test_a_read_only_folder_is_found_before_the_first_save(workdir, capsys, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    path, where = recipe_file(workdir, Case("ro", "", replace=in_train("ckpt_dir: {tmp}/ckpt")))
    code, err = check(path, (), workdir, capsys)
    assert code == 2
    assert f"{where}train.ckpt_dir: checkpoints go to {workdir}/ckpt, but {workdir} is not writable " \
           "(Read-only file system)" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_folder_without_write_permission_is_refused(workdir, capsys):
    locked = workdir / "locked"
    locked.mkdir(mode=0o555)
    path, _ = recipe_file(workdir, Case("locked", "", replace=in_train(f"ckpt_dir: {locked}/ckpt")))
    code, err = check(path, (), workdir, capsys)
    assert code == 2 and f"{locked} is not writable" in err


def test_an_unreachable_checkpoint_endpoint_is_refused(workdir, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{CLOSED}")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    path, where = recipe_file(workdir, Case("s3", "", replace=in_train("ckpt_dir: s3://bucket/ckpt")))
    code, err = check(path, (), workdir, capsys)
    assert code == 2
    assert f"{where}train.ckpt_dir: checkpoints go to s3://bucket/ckpt, but S3 endpoint " \
           f"http://127.0.0.1:{CLOSED} is not reachable" in err


def test_the_check_leaves_nothing_behind(workdir, capsys):
    before = sorted(workdir.rglob("*"))
    path, _ = recipe_file(workdir, Case("clean", ""))
    assert check(path, (), workdir, capsys)[0] == 0
    assert sorted(workdir.rglob("*")) == sorted([*before, path])  # no output folder, no probe file

"""Launch checks: every problem a launch of a recipe would meet before its first step, found in seconds.

`omni recipe check` and every flow command (`omni run`, `train`, `profile`, ...) call `check_launch` before
any stage starts. Each check asks the rule the launch itself applies: the flavor registry (`get_flavor`),
the plan against the model and the world (`plan_rules.resolve_plan`, `plan_rules.check_buildable`), the balancing
groups (`balance_group_size`), where the data is (`dataset_location`) and whether it holds a sample
(`ShardedSource.check_usable`), the checkpoint store (`checkpoint_store`), the tracking URI
(`check_tracking_uri`). So a check and a launch cannot disagree; this module only adds what no launch step
asks before it is too late (a writable checkpoint folder with room for a checkpoint, reachable S3 endpoints)
and names the recipe field each answer is about, so that it prints as `FILE:LINE: field: message`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.data.balance_groups import balance_group_size
from omni_core.data.dataset_location import dataset_location
from omni_core.data.storage import endpoint_unreachable, is_s3, s3_endpoint
from omni_core.models.args import OmniModelArgs
from omni_core.models.flavors import get_flavor
from omni_core.models.flops import omni_params
from omni_core.recipe import Locations, Recipe, RecipeError, located_problem
from omni_core.runtime.ckpt_store import MANIFEST, CheckpointError, LocalStore, S3Store, checkpoint_store
from omni_core.runtime.plan_rules import check_buildable, resolve_plan, shards_per_node
from omni_core.runtime.slurm import unknown_nodes
from omni_core.runtime.supervisor import LaunchError
from omni_core.tracking import TrackingError, check_tracking_uri, resolve_tracking_uri

NO_GPUS = "nccl needs CUDA GPUs and this machine has none (gloo or auto run on CPUs)"
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvmap", "/dev/kfd", "/dev/dxg")

# What DCP writes per parameter: the fp32 weight, and AdamW's two fp32 moments for a trained one.
WEIGHT_BYTES, OPTIMIZER_BYTES = 4, 8


@dataclass(frozen=True)
class Finding:
    """One problem (or warning) of a recipe: the dotted field it is about, and what is wrong."""

    field: str
    message: str


def check_launch(recipe: Recipe, locations: Locations | None = None) -> list[str]:
    """Raise one RecipeError listing every problem a launch of `recipe` would meet (and the warnings after
    them); else return the warnings. Each is `FILE:LINE: field: message` where `locations` (`load_located`)
    knows the line."""
    where = locations or {}
    problems, warnings = _launch_findings(recipe, written=where.keys())
    warned = [located_problem(where, w.field, f"warning: {w.message}") for w in warnings]
    if problems:
        raise RecipeError([*(located_problem(where, p.field, p.message) for p in problems), *warned])
    return warned


def _launch_findings(recipe: Recipe, written: Collection[str] = ()) -> tuple[list[Finding], list[Finding]]:
    """(problems, warnings) of a launch of `recipe`: every check runs, so all problems come at once.
    `written`: the dotted fields the recipe's author set (the rest are defaults)."""
    args, flavor_problems = _model(recipe)
    problems = [
        *flavor_problems,
        *(_plan(recipe) if args else []),
        *_schedule(recipe, written),
        *_devices(recipe),
        *(_attention(recipe, args) if args else []),
        *_data(recipe),
        *_checkpoints(recipe, args),
        *_init_from(recipe),
        *_tracking(recipe),
        *_launcher(recipe),
    ]
    return problems, _capacity_warnings(recipe)


def _launcher(recipe: Recipe) -> list[Finding]:
    """A Slurm launch needs Slurm's commands here (the job is submitted and followed from this machine), and
    the nodes it names (launch.nodelist, the schedule stage's cluster hosts) must be the cluster's."""
    if recipe.launch.target != "slurm":
        return []
    missing = [name for name in ("sbatch", "scontrol", "scancel", "sinfo") if shutil.which(name) is None]
    if missing:
        return [
            Finding(
                "launch.target",
                f"slurm needs {', '.join(missing)} on PATH (Slurm's client commands, "
                "configured for the cluster: SLURM_CONF)",
            )
        ]
    named = {
        "launch.nodelist": recipe.launch.nodelist,
        **{f"cluster.node_groups.{i}.hosts": g.hosts for i, g in enumerate(recipe.cluster.node_groups)},
    }
    findings = []
    for field, names in named.items():
        try:
            unknown = unknown_nodes(names, os.environ) if names else []
        except LaunchError as error:
            return [Finding(field, f"cannot list the Slurm cluster's nodes: {error}")]
        if unknown:
            findings.append(Finding(field, f"{', '.join(unknown)}: no such node in the Slurm cluster (sinfo)"))
    return findings


# --- model and plan --------------------------------------------------------------------------------------


def _model(recipe: Recipe) -> tuple[OmniModelArgs | None, list[Finding]]:
    try:
        args = get_flavor(recipe.model.flavor, patch_size=recipe.data.patch_size, n_mels=recipe.data.n_mels)
    except ValueError as error:
        return None, [Finding("model.flavor", str(error))]
    given = [part for part, folder in recipe.model.pretrained.model_dump().items() if folder is not None]
    if not given:
        return args, []
    findings = [finding for part in given for finding in _pretrained(recipe, part)] or _tower_inputs(recipe)
    if findings:
        return None, findings
    from omni_core.runtime.model_init import recipe_args  # torch: only for a model with pretrained parts

    return recipe_args(recipe)[0], []


def _pretrained(recipe: Recipe, part: str) -> list[Finding]:
    """A pretrained part's folder, its config.json (every key honoured, `hf_config`), its inputs against the
    data settings and its tensors' names and shapes (the files' headers), as the build will read them."""
    from omni_core.common.tokenizer import PlaceholderError
    from omni_core.models.pretrained import check_weights
    from omni_core.runtime.model_init import recipe_args

    field, folder = f"model.pretrained.{part}", Path(getattr(recipe.model.pretrained, part))
    if not folder.is_dir():
        return [
            Finding(
                field, f"{folder}: no such folder (a transformers checkpoint directory: config.json and safetensors)"
            )
        ]
    try:
        check_weights(*recipe_args(recipe, parts=(part,)))
    except PlaceholderError as error:
        return [Finding("model.placeholders", str(error))]
    except (OSError, ValueError) as error:  # hf_config.ConfigRefused is a ValueError
        return [Finding(field, str(error))]
    return []


def _tower_inputs(recipe: Recipe) -> list[Finding]:
    """The towers' processor configs (preprocessor_config.json) are honoured and the data settings fit them, as
    the data path will prepare their inputs (`TowerInputs.of_recipe`)."""
    from omni_core.data.tower_processors import ProcessorConfigError, TowerInputs

    try:
        TowerInputs.of_recipe(recipe)
    except ProcessorConfigError as error:
        return [Finding(error.field or "model.pretrained", str(error))]
    return []


def _plan(recipe: Recipe) -> list[Finding]:
    """The plan the runtime would resolve on parallel.nproc ranks, and the balancing groups it implies.
    Under `plan: auto` there is nothing to check yet: the estimate stage picks a plan that fits."""
    if recipe.parallel.plan == "auto":
        return []
    try:
        plan = resolve_plan(recipe, recipe.parallel.nproc)
        check_buildable(plan, recipe.train.compile)
    except PlanError as error:
        model = recipe.model.pretrained.llm or recipe.model.flavor
        return [Finding("parallel", f"{error} (model {model}, {recipe.parallel.nproc} ranks)")]
    return _balance(recipe, plan)


def _balance(recipe: Recipe, plan: ParallelPlan) -> list[Finding]:
    """The balancing groups the loaders of a one-node launch would form must divide the plan's data ranks."""
    balance = recipe.data.balance
    try:
        balance_group_size(balance.policy, balance.group_size, plan.dp, shards_per_node(plan, recipe.parallel.nproc))
    except ValueError as error:
        return [Finding("data.balance.group_size", f"{error} of plan {plan.name}")]
    return []


def _schedule(recipe: Recipe, written: Collection[str]) -> list[Finding]:
    """A warmup set past the steps: the learning rate would never reach train.lr. Only a warmup the author
    wrote: the default's 10 steps over a short smoke run (`--set train.steps=5`) are not worth refusing."""
    train = recipe.train
    if "train.warmup_steps" in written and train.warmup_steps > train.steps:
        return [
            Finding(
                "train.warmup_steps",
                f"warmup_steps ({train.warmup_steps}) exceeds steps "
                f"({train.steps}): the learning rate would never reach train.lr",
            )
        ]
    return []


def _devices(recipe: Recipe) -> list[Finding]:
    """A rank per GPU (`dist.init_distributed`): the backend needs GPUs, and there must be one per rank."""
    backend, nproc = recipe.parallel.backend, recipe.parallel.nproc
    if not may_have_gpus():  # torch would find none: no need to load it
        return [Finding("parallel.backend", NO_GPUS)] if backend == "nccl" else []
    import torch

    from omni_core.runtime.dist import uses_cuda

    if backend == "nccl" and not torch.cuda.is_available():
        return [Finding("parallel.backend", NO_GPUS)]
    if uses_cuda(backend) and nproc > torch.cuda.device_count():
        return [
            Finding(
                "parallel.nproc", f"{nproc} ranks take a GPU each, but this machine has {torch.cuda.device_count()}"
            )
        ]
    return []


def _attention(recipe: Recipe, args: OmniModelArgs) -> list[Finding]:
    """model.attention on the device and in the dtype the ranks will train in (the rule each attention applies
    at its first forward, `models.args.attention_problem`). A Slurm launch that asks for GPUs trains on them
    wherever this check runs; torch is loaded only where a GPU is."""
    launch = recipe.launch
    remote_gpus = launch.target == "slurm" and launch.gpus_per_node > 0
    local_gpus = may_have_gpus() and recipe.parallel.backend != "gloo"
    if not remote_gpus and not local_gpus:
        device, varlen = "cpu", None
    else:
        import torch

        from omni_core.models.attention import varlen_support

        device, varlen = ("cuda" if remote_gpus or torch.cuda.is_available() else "cpu"), varlen_support()
    dtype = recipe.train.dtype if recipe.train.dtype != "auto" else "bfloat16" if device == "cuda" else "float32"
    problem = args.attention_problem(recipe.model.attention, device, dtype, varlen)
    return [Finding("model.attention", problem)] if problem else []


def may_have_gpus() -> bool:
    """Whether a GPU driver's device files are here: NVIDIA's, Tegra's (/dev/nvmap), ROCm's (/dev/kfd) or
    WSL's (/dev/dxg). Without them torch finds no GPU, so the device check skips importing it (seconds)."""
    return any(Path(device).exists() for device in GPU_DEVICE_FILES)


# --- data ------------------------------------------------------------------------------------------------


def _data(recipe: Recipe) -> list[Finding]:
    """The dataset the launch reads is there and holds a usable sample, or a synthetic one can be written."""
    cfg = recipe.data
    if is_s3(recipe.data_dir()) and cfg.source in ("jsonl", "wds"):  # boto3 would retry for minutes
        unreachable = endpoint_unreachable(s3_endpoint(cfg.s3_endpoint_url))
        if unreachable:
            return [Finding("data.s3_endpoint_url" if cfg.s3_endpoint_url else "data.path", unreachable)]
    try:
        location = dataset_location(recipe)
        if location is None:  # a synthetic dataset the profile stage writes first
            problem = _unwritable(Path(recipe.data_dir()), need_bytes=0)
            return (
                [Finding(_data_field(recipe), f"the dataset is generated into {recipe.data_dir()}, but {problem}")]
                if problem
                else []
            )
        if location != "dynamic":
            _check_usable(location, recipe)
    except (OSError, ValueError, BotoCoreError, ClientError) as error:  # the last two: S3 said no
        return [Finding(_data_field(recipe), str(error))]
    return []


def _check_usable(location: str, recipe: Recipe) -> None:
    """The launch's reader of the dataset at `location` meets a usable sample (ValueError otherwise). Imported
    here: the readers bring the media decoders and torch, which a dataset still to be generated does not need."""
    from omni_core.common.tokenizer import tokenizer_for
    from omni_core.data.dataset import open_source
    from omni_core.data.sources import ShardedSource
    from omni_core.data.tower_processors import TowerInputs

    # conversations render with its template; media are measured as the towers take them
    source = open_source(location, recipe.data, tokenizer_for(recipe), TowerInputs.of_recipe(recipe))
    assert isinstance(source, ShardedSource)  # every location but the dynamic generator's is sharded
    source.check_usable()


def _data_field(recipe: Recipe) -> str:
    """The field that placed the data: data.path, or the output folder its default lives in."""
    return "data.path" if recipe.data.path or recipe.data.source != "synthetic" else "experiment.output_dir"


# --- checkpoints -----------------------------------------------------------------------------------------


def _checkpoints(recipe: Recipe, args: OmniModelArgs | None) -> list[Finding]:
    """The store opens (local or s3://), its endpoint answers, and the local folder DCP writes into (the
    store itself, or an S3 store's staging cache) takes one checkpoint now, not at the first save."""
    field = "train.ckpt_dir" if recipe.train.ckpt_dir else "experiment.output_dir"
    try:
        store = checkpoint_store(recipe)
    except CheckpointError as error:
        return [Finding(field, str(error))]
    if isinstance(store, S3Store):
        unreachable = endpoint_unreachable(s3_endpoint())
        if unreachable:
            return [Finding(field, f"checkpoints go to {store.uri}, but {unreachable}")]
    local = store.cache if isinstance(store, S3Store) else store.root
    problem = _unwritable(local, _checkpoint_bytes(recipe, args))
    return [Finding(field, f"checkpoints go to {local}, but {problem}")] if problem else []


def _init_from(recipe: Recipe) -> list[Finding]:
    """A local `model.init_from` holds a complete checkpoint (registry and S3 ones are looked up at launch)."""
    source = recipe.model.init_from
    if source is None or source.startswith(("models:/", "s3://")):
        return []
    folder = Path(source)
    if not folder.is_dir():
        return [
            Finding(
                "model.init_from", f"{folder}: no such checkpoint folder (has the stage it starts from saved one yet?)"
            )
        ]
    if (folder / MANIFEST).is_file() or LocalStore(folder).steps():
        return []
    return [Finding("model.init_from", f"{folder} holds no complete checkpoint (a step folder with {MANIFEST})")]


def _checkpoint_bytes(recipe: Recipe, args: OmniModelArgs | None) -> int:
    """About what one checkpoint of the recipe's model takes on disk (0 for an unknown flavor)."""
    if args is None:
        return 0
    params = omni_params(args)
    trained = params["total"] - sum(params[part] for part in recipe.model.freeze)
    return WEIGHT_BYTES * params["total"] + OPTIMIZER_BYTES * trained


def _unwritable(folder: Path, need_bytes: int) -> str | None:
    """Why a run could not write `need_bytes` into `folder` (made when missing), or None. The deepest folder
    that exists is tried with a temporary file the OS removes, so the check leaves nothing behind."""
    existing = folder
    try:
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            return f"{existing} is not a directory"
        with tempfile.TemporaryFile(dir=existing):
            pass
        free = shutil.disk_usage(existing).free
    except OSError as error:
        return f"{existing} is not writable ({error.strerror or error})"
    if free < need_bytes:
        return f"{existing} has {_size(free)} free, and one checkpoint of this model takes {_size(need_bytes)}"
    return None


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# --- tracking and capacity -------------------------------------------------------------------------------


def _tracking(recipe: Recipe) -> list[Finding]:
    try:
        check_tracking_uri(resolve_tracking_uri(recipe))
    except TrackingError as error:
        return [Finding("tracking.uri", str(error))]
    return []


def _capacity_warnings(recipe: Recipe) -> list[Finding]:
    """More ranks than cores runs, but every step waits for ranks that share a core."""
    nproc, cores = recipe.parallel.nproc, len(os.sched_getaffinity(0))
    if nproc > cores:
        return [
            Finding(
                "parallel.nproc",
                f"{nproc} ranks on {cores} CPU cores: ranks will share cores, and "
                "every step waits for the slowest (expect it far slower)",
            )
        ]
    return []

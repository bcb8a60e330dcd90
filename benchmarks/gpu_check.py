"""The runtime on one NVIDIA GPU, checked by one command in at most eight minutes (issue #46):

    python3 benchmarks/gpu_check.py --out DIR [--cpu-dry-run] [--budget-s S] [--sections a,b]

writes DIR/report.json (every figure, each section's errors and skips) and DIR/summary.txt (a page to read).
Sections, each in its own process so that one that fails, runs out of memory or hangs records its error and
the rest still run; each is given what is left of the wall budget, the last all of it:

- environment: Python, torch, CUDA, NCCL, the GPU; a measured bf16 matmul (8192^3, CUDA events) against the
  datasheet's dense peak, named by the device (H100 and H200 SXM: 989 TFLOP/s).
- correctness (gpu_check_train, gpu_check_attention): the attention paths' parity in bf16, forward and backward;
  a training step on a one-rank NCCL group with OMNI_ALWAYS_COLLECT=1, so every collective of the step runs;
  FSDP2 in bf16; a checkpoint saved and loaded (the next two steps' losses again); the omni and coupled encoder
  layouts at world 1 (the same losses).
- throughput (gpu_check_train): omni-1b text-only and 1:1 image:text at seq_len 8,192, 20 steps after warm-up:
  tokens/s, MFU against the named peak, peak memory, host syncs per step, recompiles; steps timed by CUDA events.
- attention (gpu_check_attention): the per-document loop, flex and varlen on packed documents of mean length 512.
- estimator (gpu_check_estimator): `estimator_gpu_validate.py --quick` (the GPU's calibration, then the quick
  validation), predicted against measured step time per case; and the throughput section's omni-1b steps
  predicted from that calibration beside what it measured. The calibration is kept in DIR/calibration unless
  OMNI_CALIBRATION_DIR says otherwise.

`--cpu-dry-run` runs the same sections on CPU at tiny sizes (debug flavor, seq_len 256, 2 steps), each
skip named in the report, in about a minute: tests/unit/test_gpu_check.py runs it. The script imports neither
MLflow nor Prefect (each section checks its own process's modules); on a GPU machine without network it needs
the wheels of `make gpu-wheels` (README.md, "On a GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Seconds each section may take at most, in order; what one leaves unused goes to the later ones. Throughput's is
# the largest: omni-1b's build on the host (about a minute) and inductor's first compiles come before its steps;
# attention's covers flex_attention's compilation. Not yet timed on a GPU: the first run's report says.
GPU_SECTIONS = {"environment": 45, "correctness": 120, "throughput": 240, "attention": 90, "estimator": 600}
GPU_BUDGET_S = 450.0  # eight minutes less the machine's start-up and the interpreter's imports
DRY_BUDGET_S = 88.0  # the bound for the dry run is 90 s
# Tracking and orchestration, which the GPU machines lack and the check must not need. (omni's own tracking
# package may load, MLflow-free: the estimator's validation runs the trainer with its null tracker.)
FORBIDDEN_MODULES = ("mlflow", "prefect")
LOG = "gpu_check.log"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for report.json and summary.txt")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU: checks the script")
    parser.add_argument(
        "--budget-s", type=float, help=f"wall budget (default {GPU_BUDGET_S:.0f}, dry run {DRY_BUDGET_S:.0f})"
    )
    parser.add_argument("--sections", help=f"comma-separated subset of {','.join(GPU_SECTIONS)}")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # a child: run this one section
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        run_section(args.section, args.out, args.cpu_dry_run, args.deadline, args.result)
        return {}
    names = args.sections.split(",") if args.sections else list(GPU_SECTIONS)
    unknown = [n for n in names if n not in GPU_SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(GPU_SECTIONS)}")
    if not args.cpu_dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA GPU is visible here: --cpu-dry-run checks the script on the CPU")
    budget = args.budget_s or (DRY_BUDGET_S if args.cpu_dry_run else GPU_BUDGET_S)
    # a stop from outside unwinds through run_child, which kills the running section's processes (they run in
    # their own session, which a stopped caller's kill would not reach)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = run_all(names, args.out, args.cpu_dry_run, budget)
    print((args.out / "summary.txt").read_text())
    return report


def run_all(names: list[str], out: Path, dry_run: bool, budget: float) -> dict[str, Any]:
    """Every section in its own process under the budget; the report and summary written after each, so a
    run cut short by the caller still leaves what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    deadline = started + budget
    report: dict[str, Any] = {"mode": "cpu-dry-run" if dry_run else "gpu", "budget_s": budget, "sections": {}}
    (out / LOG).write_text("")
    for name in names:
        left = deadline - time.time()
        if left < 5:
            report["sections"][name] = {"status": "skipped", "reason": f"the {budget:.0f} s budget was spent"}
        else:
            report["sections"][name] = run_child(name, out, dry_run, min(GPU_SECTIONS[name], left))
        report["wall_s"] = time.time() - started
        write_report(report, out)
    return report


def run_child(name: str, out: Path, dry_run: bool, seconds: float) -> dict[str, Any]:
    """One section in a fresh interpreter (its own CUDA context and peak memory), killed with every process
    it started when its time is up."""
    result = out / f".{name}.json"
    result.unlink(missing_ok=True)
    deadline = time.time() + seconds
    command = [
        sys.executable,
        __file__,
        "--section",
        name,
        "--out",
        str(out),
        "--result",
        str(result),
        "--deadline",
        str(deadline),
    ] + (["--cpu-dry-run"] if dry_run else [])
    started = time.perf_counter()
    with open(out / LOG, "a") as log:
        log.write(f"\n===== {name} ({seconds:.0f} s) =====\n")
        log.flush()
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if child.poll() is None:  # out of time, or this process is being stopped (SIGTERM, Ctrl-C)
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    section: dict[str, Any] = json.loads(result.read_text()) if result.is_file() else {}
    result.unlink(missing_ok=True)
    section["wall_s"] = time.perf_counter() - started
    if code is None:
        section.update(status="error", error=f"killed after its {seconds:.0f} s (the tail of {LOG} says where)")
    elif code != 0 and section.get("status") != "error":
        section.update(status="error", error=f"exited {code} before reporting (see {LOG})")
    return section


def run_section(name: str, out: Path, dry_run: bool, deadline: float, result: Path) -> None:
    """In the child: the section's figures, with its errors and skips, and the forbidden modules it imported.
    The result file is rewritten as parts finish, so a section killed at its deadline keeps what it measured."""
    section: dict[str, Any] = {"status": "ok"}

    def save() -> None:
        result.write_text(json.dumps(section, default=str))

    try:
        section.update(SECTION_RUNNERS[name](Context(out, dry_run, deadline, section, save)))
    except Exception as error:
        section.update(status="error", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
    section["imported_forbidden"] = sorted(
        m for m in sys.modules if any(m == f or m.startswith(f"{f}.") for f in FORBIDDEN_MODULES)
    )
    if any(part.get("status") == "error" for part in section.values() if isinstance(part, dict)):
        section["status"] = "error"
    save()


class Context:
    """What a section is given: the output folder, the mode, its deadline, and its report so far (`save()`
    writes it, so that parts done survive a later kill)."""

    def __init__(self, out: Path, dry_run: bool, deadline: float, report: dict[str, Any], save) -> None:
        self.out, self.dry_run, self.deadline, self.report, self.save = out, dry_run, deadline, report, save

    @property
    def device(self):
        import torch

        return torch.device("cpu" if self.dry_run else "cuda")

    def left_s(self) -> float:
        return self.deadline - time.time()

    def part(self, name: str, run, *args) -> None:
        """One part of a section: its figures, or its error; saved either way."""
        started = time.perf_counter()
        try:
            self.report[name] = {"status": "ok", **run(self, *args)}
        except Exception as error:
            self.report[name] = {
                "status": "error",
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
        self.report[name]["seconds"] = time.perf_counter() - started
        self.save()


def environment(ctx: Context) -> dict[str, Any]:
    """Versions, the device, and its measured bf16 matmul rate against the datasheet's peak."""
    import platform
    from importlib import metadata

    import torch

    from omni_core.runtime.perf import device_peak

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "loadavg": os.getloadavg(),
    }
    for package in ("numpy", "pydantic", "pydantic_core", "orjson", "soundfile", "PyYAML", "pillow"):
        try:
            env[f"{package}_version"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[f"{package}_version"] = None
    from omni_core.models.attention import resolve_attention, varlen_support

    support = varlen_support()  # what this torch's varlen_attn takes, None without it
    env["varlen_attn"] = None if support is None else {"windows": support.windows, "gqa": support.gqa}
    # the path `model.attention: auto` takes for omni-1b's bf16 heads of 128 on this device
    env["attention_auto"] = resolve_attention("auto", torch.empty(1, 1, 128, dtype=torch.bfloat16, device=ctx.device))
    if ctx.device.type == "cuda":
        props, nccl = torch.cuda.get_device_properties(0), torch.cuda.nccl.version()  # a tuple, an int before 2.1
        env.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            memory_gib=props.total_memory / 2**30,
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        )
    else:
        from gpu_check_measures import skipped

        env["gpu"] = skipped("no GPU in a dry run: no device properties, no NCCL version")
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    n = 256 if ctx.dry_run else 8192
    env["matmul"] = {"n": n, "dtype": str(dtype).removeprefix("torch."), "tflops": matmul_tflops(n, dtype, ctx.device)}
    peak = device_peak(ctx.device, dtype)
    env["peak"] = {"name": peak.name, "tflops": peak.flops / 1e12} if peak else {"name": None, "tflops": None}
    if peak:
        env["matmul"]["pct_of_peak"] = 100 * env["matmul"]["tflops"] * 1e12 / peak.flops
    return env


def matmul_tflops(n: int, dtype, device, warmup: int = 3, repeats: int = 10) -> float:
    """Mean rate of n^3 matmuls: CUDA events around the timed ones on a GPU (work there is asynchronous), the
    wall clock on a CPU (synchronous)."""
    import torch

    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    for _ in range(warmup):
        a @ b
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            a @ b
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000
    else:
        began = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = time.perf_counter() - began
    return 2 * n**3 * repeats / seconds / 1e12


def estimator(ctx: Context) -> dict[str, Any]:
    from gpu_check_estimator import estimator as run

    return run(ctx)


def correctness(ctx: Context) -> dict[str, Any]:
    from gpu_check_attention import attention_parity
    from gpu_check_train import layouts_agree, nccl_step_and_checkpoint

    ctx.part("attention_parity", attention_parity)
    ctx.part("step_nccl_fsdp_checkpoint", nccl_step_and_checkpoint)
    ctx.part("layouts_world1", layouts_agree)
    return {}


def throughput(ctx: Context) -> dict[str, Any]:
    from gpu_check_train import WORKLOADS, ThroughputModel, join_group, sizes, workload_throughput

    model = ThroughputModel(join_group(), sizes(ctx.dry_run))  # one model for both workloads
    for workload in WORKLOADS:
        ctx.part(workload, workload_throughput, workload, model)
    return {}


def attention(ctx: Context) -> dict[str, Any]:
    from gpu_check_attention import attention_timings

    ctx.part("timings", attention_timings)
    return {}


SECTION_RUNNERS = {
    "environment": environment,
    "correctness": correctness,
    "throughput": throughput,
    "attention": attention,
    "estimator": estimator,
}


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "summary.txt").write_text(summary(report))


def summary(report: dict[str, Any]) -> str:
    """The report's page: each section's status and headline figures beside the issue's targets, then every
    error and skip by name."""
    sections = report["sections"]
    lines = [
        f"omni GPU check ({report['mode']}): {report.get('wall_s', 0):.0f} s of a {report['budget_s']:.0f} s budget"
    ]
    for name, section in sections.items():
        lines.append(f"[{section.get('status', '?')}] {name} ({section.get('wall_s', 0):.0f} s)")
        lines += [f"    {line}" for line in HEADLINES.get(name, lambda _: [])(section)]
    problems = [f"{path}: {text}" for path, text in findings(sections, "error")]
    skips = [f"{path}: {text}" for path, text in findings(sections, "skipped")]
    lines += [
        "errors:",
        *(f"    {p}" for p in problems or ["none"]),
        "skips:",
        *(f"    {s}" for s in skips or ["none"]),
    ]
    return "\n".join(lines) + "\n"


def findings(node: dict[str, Any], status: str, path: str = "") -> list[tuple[str, str]]:
    """(where, why) of every part with this status, however deep (a section that only holds a failed part is
    not named again)."""
    found = []
    why = str(node.get("error") or node.get("reason") or "").strip()
    if node.get("status") == status and why:
        lines = why.splitlines()
        found.append((path or "report", lines[0][:300] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else "")))
    for key, value in node.items():
        if isinstance(value, dict):
            found += findings(value, status, f"{path}.{key}" if path else key)
    return found


def _num(value: Any, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _environment(s: dict[str, Any]) -> list[str]:
    matmul, peak = s.get("matmul", {}), s.get("peak", {})
    device = s["gpu"] if isinstance(s.get("gpu"), str) else "CPU"  # a dry run's `gpu` is its skip
    return [
        f"{device}; torch {s.get('torch')}, CUDA {s.get('cuda')}, Python {s.get('python')}",
        f"matmul {matmul.get('dtype')} {matmul.get('n')}^3: {_num(matmul.get('tflops'))} TFLOP/s = "
        f"{_num(matmul.get('pct_of_peak'))}% of {peak.get('name')} ({_num(peak.get('tflops'))} TFLOP/s)",
        f"model.attention auto takes {s.get('attention_auto')} here; torch's varlen_attn: {s.get('varlen_attn')}",
    ]


def _correctness(s: dict[str, Any]) -> list[str]:
    step, layouts = s.get("step_nccl_fsdp_checkpoint", {}), s.get("layouts_world1", {})
    paths = s.get("attention_parity", {}).get("paths", {})
    worst = {k: max(v["relative_error"].values()) for k, v in paths.items() if "relative_error" in v}
    return [
        "attention parity (bf16 vs fp32, worst relative error): " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()),
        f"step on {step.get('backend')} (world {step.get('world_size')}): loss {_num(step.get('loss'), 4)}, "
        f"collectives {step.get('collectives_in_step')}, FSDP2 modules {step.get('fsdp_modules')} "
        f"(param {step.get('param_dtype')}, reduce {step.get('reduce_dtype')})",
        f"checkpoint: losses after save {step.get('losses_after_save')}, after load {step.get('losses_after_load')}",
        f"layouts at world 1: {layouts.get('losses')}",
    ]


def _throughput(s: dict[str, Any]) -> list[str]:
    lines = []
    for name, target in (("text_only", 40), ("image_text_1to1", 35)):
        w = s.get(name, {})
        lines.append(
            f"{name}: {_num(w.get('tokens_per_s'), 0)} tokens/s, MFU {_num(w.get('mfu_pct'))}% "
            f"(target >= {target}%), peak memory {_num(w.get('peak_memory_gib'))} GiB, host syncs/step "
            f"{_num(w.get('host_syncs_per_step'))} (target <= 1), recompiles {w.get('recompiles_after_warmup')}"
            f" (target 0), {w.get('steps_timed')} steps of {w.get('flavor')} at {w.get('seq_len')}"
        )
    return lines


def _attention(s: dict[str, Any]) -> list[str]:
    t = s.get("timings", {})
    times = ", ".join(
        f"{k.removesuffix('_ms')} {_num(v, 2)} ms"
        for k, v in t.items()
        if k.endswith("_ms") and not k.endswith("_fwd_ms")
    )
    return [
        f"fwd+bwd at mean document {t.get('mean_doc_len')}: {times}",
        f"varlen over the per-document loop: {_num(t.get('varlen_speedup_over_loop'))}x (target >= 3x)",
    ]


def _estimator(s: dict[str, Any]) -> list[str]:
    v, own = s.get("validation", {}), s.get("throughput_predicted", {})
    cases = [
        f"{c['case']}: predicted {_num(c['predicted_s'], 4)} s, measured {_num(c['measured_s'], 4)} s "
        f"({_num(c['ape_pct'])}%)"
        for c in v.get("cases", [])
    ]
    ours = [
        f"{own.get('flavor')} {name}: predicted {_num(w['predicted_s'], 4)} s, measured {_num(w['measured_s'], 4)} s "
        f"({_num(w['ape_pct'])}%, target <= 15%); peak memory predicted {_num(w['predicted_peak_memory_gib'], 2)} GiB, "
        f"measured {_num(w['measured_peak_memory_gib'], 2)} GiB"
        for name, w in own.get("workloads", {}).items()
    ]
    return [f"quick validation: MAPE {_num(v.get('mape_pct'))}% over {v.get('n_plans_validated')} cases", *cases, *ours]


HEADLINES = {
    "environment": _environment,
    "correctness": _correctness,
    "throughput": _throughput,
    "attention": _attention,
    "estimator": _estimator,
}


if __name__ == "__main__":
    main()

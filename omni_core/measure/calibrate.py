"""On-device micro-profile: a few seconds of kernels, runtime primitives and collectives that correct the
catalogue's peaks for the device at hand, stored per device type.

What it measures (the current thread setting, CPU tensors; never a training step), every probe sampled in
interleaved passes and averaged (`_sample`: a shared host switches between fast and slow states within a
second, and a training step lasts through several):

    matmul       forward + backward of [tokens x k] @ [k x n] for several shapes -> peak FLOP/s and the
                 bandwidth of their operands (a least-squares fit of both)
    attention    the runtime's per-document attention, fwd + bwd, at several lengths and head sizes -> FLOP/s,
                 seconds per score element and per call (fitted)
    operators    a tiny LLM block, forward and backward -> seconds per aten operator it dispatches
    elementwise  a Llama block's norms, RoPE, gate and residuals at a model's size, fwd + bwd, less their operators'
                 overhead -> bytes/s of the element-wise work layers count (on a CPU they run from cache but
                 compute transcendentals element by element: slower than streaming)
    memory       elementwise add over a large buffer -> bandwidth
    on `world` forked gloo ranks (one process group on loopback):
    collectives  all-reduce, all-gather, reduce-scatter, all-to-all and a point-to-point exchange at several
                 sizes -> alpha (latency per ring step) and beta (bytes/s) of each
    memory       the elementwise add on every rank at once against rank 0 alone -> how much the ranks'
                 sharing of the node's memory bandwidth slows memory-bound work
    straggling   pieces of work each followed by an all-reduce on every rank, against the work alone -> how
                 much the ranks' independent jitter (each collective waits for the slowest) stretches a
                 rank's own work
    parameters   the step's gradient norm and the runtime's AdamW (foreach) over 8 and 64 small parameters,
                 plain (one process) and as DTensors (on the ranks), and over one large one -> seconds per
                 parameter group, per tensor and per element
    wrappers     forward + backward of stacks of small Linears under FSDP2, under DTensor TP and through a
                 1F1B pipeline, at two depths -> seconds per FSDP unit, per TP-parallel module and per
                 micro-batch per stage (hooks, redistributions, schedule, their collectives' latency)

The result is the catalogue entry with the measured peaks and link, and an `Efficiency` relative to it
(so `cost.estimate_step` is unchanged), saved as JSON under $OMNI_CALIBRATION_DIR (default
~/.cache/omni/calibration)/<device>.json. Calibration never sees training-step times: the validation
(`validate.py`) compares predictions built from it with runs.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.calibration import calibration_path, store_calibration
from omni_core.estimator.communication import collective_time, ring_volume
from omni_core.estimator.cost import COLLECTIVES, Efficiency
from omni_core.estimator.transformer_layers import transformer_block
from omni_core.runtime.ranks import run_ranks

MATMUL_SHAPES = tuple((t, k, n) for t in (32, 256, 1024) for k, n in ((64, 256), (128, 384), (384, 1536), (768, 2048)))
# (heads, head dim, document length, documents): two head sizes over the same score matrices (separating the
# per-element from the per-FLOP cost), and many short documents (the per-call cost)
ATTN_SHAPES = ((4, 16, 512, 1), (4, 64, 512, 1), (4, 32, 16, 32))
COLLECTIVE_BYTES = (12 << 10, 96 << 10, 768 << 10, 3 << 20)  # divisible by 4-byte floats x world sizes 1..4
PROBE_TENSOR_COUNTS = (8, 64)  # parameters of the optimizer probes: the difference is what one more costs
PROBE_DIM = 48  # width of the ranks probes' Linears: divisible by world sizes 1-4
WRAPPER_REPEATS = 4  # the wrapper probes are differences of millisecond timings: more passes for their means
# passes per repeat of the collectives (their latency, the intercept of a line through millisecond timings, moved
# 2x between probes at 2 passes: all-reduce 0.5-1.2 ms) and of the ratios of the ranks' work together to rank 0's
# alone (straggling moved 1.1-1.37): all of them take a few seconds
COLLECTIVE_REPEATS = 8
RATIO_REPEATS = 6
WRAP_DEPTHS = (2, 8)  # stacks of the wrapper probes: the difference is what one more wrapped module costs
COMPUTE_PASSES = 2  # interleaved passes of the kernel probes per unit of `repeat` (~0.5 s each here)
SAMPLE_SECONDS = 0.01  # the shortest sample of a kernel probe
BIG_PARAM = 4 << 20  # elements of the optimizer's per-element probe
STREAM = 8 << 20  # elements of the memory bandwidth probe's buffers
# (tokens, dim, heads, kv heads, FFN width) of the element-wise probe's block: the `debug` LLM's at 512 tokens
ELEMENTWISE_BLOCK = (512, 128, 4, 2, 384)


@dataclass(frozen=True)
class ProbeDevice:
    """Where the kernel micro-profile runs: the torch device type, the compute dtype of its matmuls and
    attention, and shapes large enough for that device to reach its peaks (a GPU's kernels at a CPU's shapes
    would time their launches)."""

    device: str = "cpu"
    dtype: str = "float32"
    matmul_shapes: tuple[tuple[int, int, int], ...] = MATMUL_SHAPES
    attn_shapes: tuple[tuple[int, int, int, int], ...] = ATTN_SHAPES
    stream: int = STREAM
    big_param: int = BIG_PARAM
    elementwise_block: tuple[int, int, int, int, int] = ELEMENTWISE_BLOCK

    @property
    def element_bytes(self) -> float:
        return 2.0 if self.dtype == "bfloat16" else 4.0

    @property
    def precision(self) -> str:
        """The cost model's name for the dtype."""
        return "bf16" if self.dtype == "bfloat16" else "fp32"

    def wall_clock(self) -> Callable[[], float]:
        """perf_counter, after the device's queued work (a GPU's kernels run asynchronously)."""
        if self.device != "cuda":
            return time.perf_counter
        import torch

        def synced() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return synced


CPU_PROBES = ProbeDevice()
# a GPU in bf16, as the runtime trains there: matmuls up to 8k x 8k, attention over 1k-4k documents, memory and
# the optimizer over buffers well past its caches
CUDA_PROBES = ProbeDevice(
    "cuda",
    "bfloat16",
    matmul_shapes=tuple((t, k, n) for t in (512, 2048, 8192) for k, n in ((1024, 4096), (4096, 4096), (4096, 8192))),
    attn_shapes=((16, 64, 2048, 1), (16, 128, 2048, 1), (16, 128, 128, 32)),
    stream=256 << 20,
    big_param=64 << 20,
    elementwise_block=(8192, 4096, 32, 8, 14336),
)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), intercept clamped at >= 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return max(0.0, my - slope * mx), slope


def fit_costs(features: list[tuple[float, ...]], seconds: list[float]) -> tuple[float, ...]:
    """Non-negative per-unit costs c with seconds ~ features . c, least squares on the relative error (small
    and large probes count alike); a cost the fit would make negative is dropped (set to 0) and the rest refit."""
    import numpy as np

    x = np.array(features, dtype=float) / np.array(seconds)[:, None]
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active], np.ones(len(seconds)), rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return tuple(float(c) for c in coef)
        active.remove(min(negative, key=lambda i: coef[i]))


def _count_ops(fn) -> int:
    """Aten operators `fn` dispatches (forward and backward), as workloads.py counted the model's modules."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def _sample(
    probes: dict[Any, Callable[[], Any]], passes: int, clock=time.perf_counter, sync: Callable[[], Any] | None = None
) -> dict[Any, float]:
    """Mean seconds of each probe's run over `passes` round-robin passes.

    A shared host's cores switch between a fast and a slow state every 0.1-1 s (on this VM: operator
    dispatch 6.5 against 11 us, matmuls 82 against 62 GFLOP/s, both at once), so a probe timed in one burst
    measures one state, while a training step runs through several. Interleaving spreads every probe over
    the whole calibration, and the mean (not the median) of its passes is what a long run averages to.

    Alone, a probe's warm-up run sets how many runs make one of its samples (at least SAMPLE_SECONDS: a
    single run right after another probe's large buffers pays for cold caches, which a long stream of
    operators does not). With `sync` (a barrier before each sample: ranks start collectives together) every
    sample is one run, so that all ranks run the same calls."""
    runs = {}
    for key, fn in probes.items():
        if sync:
            sync()
        start = clock()
        fn()
        runs[key] = 1 if sync else max(1, round(SAMPLE_SECONDS / max(clock() - start, 1e-6)))
    totals = dict.fromkeys(probes, 0.0)
    for _ in range(passes):
        for key, fn in probes.items():
            if sync:
                sync()
            start = clock()
            for _ in range(runs[key]):
                fn()
            totals[key] += clock() - start
    return {key: total / (passes * runs[key]) for key, total in totals.items()}


def kernel_probes(at: ProbeDevice = CPU_PROBES) -> dict[Any, Callable[[], Any]]:
    """The kernel micro-profile's probes (`profile_compute`) on `at`'s device, forward + backward where there
    is one; built once (their buffers, models and optimizers take a second), sampled as often as needed."""
    import torch

    from omni_core.models.attention import varlen_attention

    torch.manual_seed(0)
    dev, dtype = torch.device(at.device), getattr(torch, at.dtype)
    probes: dict[Any, Callable[[], Any]] = {}
    for m, k, n in at.matmul_shapes:
        a, w = (torch.randn(r, c, device=dev, dtype=dtype, requires_grad=True) for r, c in ((m, k), (k, n)))
        probes[("matmul", m, k, n)] = lambda a=a, w=w: (a @ w).sum().backward()
    for heads, dim, length, docs in at.attn_shapes:
        q, k, v = (
            torch.randn(docs * length, heads, dim, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        bounds = list(range(0, docs * length + 1, length))
        probes[("attention", heads, dim, length, docs)] = lambda q=q, k=k, v=v, b=bounds: (
            varlen_attention(q, k, v, b, True).sum().backward()
        )
    probes["tiny"] = _tiny_block(dev)
    probes["elementwise"] = _elementwise_block(at)
    for n, update in _parameter_probes(lambda n: [torch.randn(32, 32, device=dev) for _ in range(n)]).items():
        probes[("optimizer", n)] = update
    big = torch.nn.Parameter(torch.randn(at.big_param, device=dev))
    big.grad = torch.randn(at.big_param, device=dev)
    big_optimizer = torch.optim.AdamW([big], lr=1e-3, foreach=True)

    def update_big() -> None:  # the step's clipping (norm, scaling) and AdamW, per element
        torch.nn.utils.get_total_norm([big.grad], foreach=True)
        big.grad.mul_(1.0)  # a scaling pass (not by < 1: repeated, it would sink the values into slow denormals)
        big_optimizer.step()

    probes["update_big"] = update_big
    x, y = torch.randn(at.stream, device=dev), torch.randn(at.stream, device=dev)
    out = torch.empty_like(x)
    probes["add"] = lambda: torch.add(x, y, out=out)
    return probes


def profile_compute(
    repeat: int = 5, clock=time.perf_counter, probes: dict | None = None, at: ProbeDevice = CPU_PROBES
) -> dict[str, float]:
    """The device's kernels (`kernel_probes(at)`, built here unless given), fitted to the cost model's terms:

    matmul      seconds ~ FLOPs / peak + operand bytes / bandwidth (small matmuls are bound by their operands)
    attention   per document, as the runtime calls it (`varlen_attention`): seconds ~ a call's overhead + FLOPs
                / rate + score elements x seconds each (the CPU kernel materialises the full score matrix)
    operators   a tiny LLM block (all overhead) over the aten operators it dispatches: seconds per operator
    elementwise a block's element-wise operators at a model's size (`_elementwise_block`), their operators'
                overhead taken off, against the bytes the cost model counts for them: their bytes/s
    optimizer   the step's gradient norm and the runtime's AdamW at two tensor counts and over one large
                tensor: seconds per parameter group, per tensor and per element
    memory      elementwise add over a large buffer -> bandwidth

    Every probe is sampled in COMPUTE_PASSES x `repeat` interleaved passes (`_sample`), a few seconds in all.
    On a GPU `clock` must wait for the device (`ProbeDevice.wall_clock`)."""
    probes = probes or kernel_probes(at)
    secs = _sample(probes, COMPUTE_PASSES * repeat, clock)
    size = at.element_bytes
    matmul_flops = [6.0 * m * k * n for m, k, n in at.matmul_shapes]
    matmul_s = [secs[("matmul", *shape)] for shape in at.matmul_shapes]
    inv_peak, inv_bw, _ = fit_costs(
        [(f, 3 * size * (m * k + k * n + m * n), 1.0) for f, (m, k, n) in zip(matmul_flops, at.matmul_shapes)], matmul_s
    )
    if not inv_peak:  # a loaded host's noise made the FLOP term negative: the best rate a shape reached
        inv_peak = min(t / f for t, f in zip(matmul_s, matmul_flops))
    call_s, inv_attn, score_s = fit_costs(
        [
            (docs, 3 * 4.0 * dim * heads * length**2 * docs, 3 * heads * length**2 * docs)
            for heads, dim, length, docs in at.attn_shapes
        ],
        [secs[("attention", *shape)] for shape in at.attn_shapes],
    )
    op_s = secs["tiny"] / _count_ops(probes["tiny"])
    elementwise_s = secs["elementwise"] - _count_ops(probes["elementwise"]) * op_s
    group_s, tensor_s = _per_group_and_tensor([secs[("optimizer", n)] for n in PROBE_TENSOR_COUNTS])
    mem_bw = 3 * at.stream * 4 / secs["add"]
    return {
        "matmul_flops": 1 / inv_peak,
        "matmul_bw": 1 / inv_bw if inv_bw else 0.0,
        "attn_flops": 1 / inv_attn if inv_attn else 1e30,
        "score_s": score_s,
        "attn_call_s": call_s,
        "mem_bw": mem_bw,
        "op_s": op_s,
        "tensor_s": tensor_s,
        "tensor_group_s": group_s,
        "elementwise_bw": 3 * _elementwise_bytes(at) / elementwise_s if elementwise_s > 0 else 0.0,
        "optimizer_bytes_per_param": secs["update_big"] / at.big_param * mem_bw,
    }


def _parameter_probes(make: Callable[[int], list]) -> dict[int, Callable[[], None]]:
    """Per tensor count n of PROBE_TENSOR_COUNTS: the step's gradient norm and the runtime's AdamW
    (`runtime.step.build_optimizer`: foreach, one group per kind of tensor) over `make(n)` small tensors
    (plain or DTensors). A line through their times gives seconds per parameter group and per tensor."""
    import torch
    from torch.distributed.tensor import DTensor

    from omni_core.recipe import Recipe
    from omni_core.runtime.step import build_optimizer

    recipe = Recipe.model_validate({"experiment": {"name": "calibration"}})
    probes = {}
    for n in PROBE_TENSOR_COUNTS:
        module = torch.nn.Module()
        module.params = torch.nn.ParameterList(make(n))
        for param, grad in zip(module.params, make(n)):
            param.grad = grad
        optimizer = build_optimizer(module, recipe)

        def update(params=list(module.params), optimizer=optimizer) -> None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            optimizer.step()

        probes[n] = update
    return probes


def _per_group_and_tensor(seconds: list[float]) -> tuple[float, float]:
    """(seconds per parameter group, per tensor): the line through the `_parameter_probes` times at
    PROBE_TENSOR_COUNTS tensors (a tensor never costs less than nothing)."""
    group_s, tensor_s = _fit_line(list(PROBE_TENSOR_COUNTS), seconds)
    return group_s, max(tensor_s, 0.0)


def _tiny_block(device=None):
    """Forward + backward of a tiny LLM block (4 tokens): nothing but operator overhead (on a GPU: launches)."""
    import torch

    from omni_core.models.args import LLMArgs
    from omni_core.models.llm import TransformerBlock, rope_cos_sin

    device = device or torch.device("cpu")
    args = LLMArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, vocab_size=8)
    block, x = TransformerBlock(args).to(device), torch.randn(4, 32, device=device, requires_grad=True)
    cos, sin = (t.to(device) for t in rope_cos_sin(torch.arange(4), args))

    def tiny() -> None:
        block(x, cos, sin, [0, 4]).sum().backward()

    return tiny


def _elementwise_block(at: ProbeDevice) -> Callable[[], None]:
    """Forward + backward of a Llama block's element-wise operators, as the model runs them, at
    `at.elementwise_block`'s size: its two RMSNorms and residual adds, RoPE on the queries and keys, and the
    SwiGLU gate (its matmuls and attention are the other probes')."""
    import torch

    from omni_core.models.args import LLMArgs
    from omni_core.models.llm import TransformerBlock, apply_rope, rope_cos_sin

    tokens, dim, heads, kv_heads, ffn = at.elementwise_block
    dev, dtype = torch.device(at.device), getattr(torch, at.dtype)
    args = LLMArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=ffn, vocab_size=8)
    block = TransformerBlock(args).to(dev, dtype)
    head_dim = dim // heads

    def leaf(*shape: int):
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    x, q, k, gate, up = (
        leaf(tokens, dim),
        leaf(tokens, heads, head_dim),
        leaf(tokens, kv_heads, head_dim),
        leaf(tokens, ffn),
        leaf(tokens, ffn),
    )
    cos, sin = (t.to(dev) for t in rope_cos_sin(torch.arange(tokens), args))

    def run() -> None:
        h = x + block.attention_norm(x)
        h = h + block.ffn_norm(h)
        gated = block.feed_forward.act(gate) * up
        (h.sum() + apply_rope(q, cos, sin).sum() + apply_rope(k, cos, sin).sum() + gated.sum()).backward()

    return run


def _elementwise_bytes(at: ProbeDevice) -> float:
    """The forward bytes the cost model counts for the element-wise probe's work (`Layer.mem_bytes`)."""
    tokens, dim, heads, kv_heads, ffn = at.elementwise_block
    return transformer_block(
        "probe",
        dim=dim,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        tokens=tokens,
        sum_sq=0.0,
        docs=1,
        causal=True,
        gated=True,
        bias=False,
        dtype_bytes=int(at.element_bytes),
    ).mem_bytes


def _collective_times(
    world: int, repeat: int, at: ProbeDevice = CPU_PROBES, sizes: tuple[int, ...] = COLLECTIVE_BYTES
) -> dict[str, dict[int, float]]:
    """Wall seconds of each collective (and a neighbour exchange) per buffer size on the default group, with
    buffers on `at`'s device (rank r's GPU r under NCCL)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    dev = torch.device(at.device, rank) if at.device == "cuda" else torch.device("cpu")
    probes = {}
    for size in sizes:
        n = size // 4
        buf, out, scattered = (
            torch.ones(n, device=dev),
            torch.empty(n * world, device=dev),
            torch.empty(n // world, device=dev),
        )
        a2a_out = torch.empty(n, device=dev)
        recv = torch.empty(n, device=dev)

        def exchange(buf=buf, recv=recv) -> None:
            ops = [dist.P2POp(dist.isend, buf, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        calls = {
            "all_reduce": lambda buf=buf: dist.all_reduce(buf),
            "all_gather": lambda buf=buf, out=out: dist.all_gather_single(out, buf),
            "reduce_scatter": lambda buf=buf, s=scattered: dist.reduce_scatter_single(s, buf),
            "all_to_all": lambda buf=buf, o=a2a_out: dist.all_to_all_single(o, buf),
            "p2p": exchange,
        }
        probes.update({(kind, size): call for kind, call in calls.items()})
    secs = _sample(probes, COLLECTIVE_REPEATS * repeat, clock=at.wall_clock(), sync=dist.barrier)
    times: dict[str, dict[int, float]] = {kind: {} for kind in (*COLLECTIVES, "p2p")}
    for (kind, size), seconds in secs.items():
        times[kind][size] = seconds
    return times


def _dtensor_costs(repeat: int) -> tuple[float, float]:
    """Seconds per parameter group and per tensor (`_parameter_probes`) of sharded (DTensor) parameters: what
    FSDP and TP make of every parameter."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    probes = _parameter_probes(lambda n: [distribute_tensor(torch.randn(32, 32), mesh, [Shard(0)]) for _ in range(n)])
    secs = _sample(probes, 2 * repeat, sync=dist.barrier)
    return _per_group_and_tensor([secs[n] for n in PROBE_TENSOR_COUNTS])


def _stack(depth: int, width: int = 1):
    """`depth` modules of `width` tiny Linears each."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(*[nn.Linear(PROBE_DIM, PROBE_DIM) for _ in range(width)]) for _ in range(depth)]
    )


def _wrapper_costs(repeat: int) -> dict[str, float]:
    """Seconds the runtime's wrappers add per forward + backward, with their collectives' latency (their volume
    is priced by the links): an FSDP2 unit and each parameter tensor in it (units of one and of four tiny
    Linears), a TP-parallel Linear, one more micro-batch through a 1F1B pipeline with a stage per rank. Each
    is a difference between stacks (wrapped against plain, deep against shallow) sampled together."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))

    def fsdp(model):
        for unit in model:
            fully_shard(unit, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def tp(model):
        return parallelize_module(
            model, mesh, {f"{i}.0": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(len(model))}
        )

    x = torch.randn(16, PROBE_DIM)

    def forward_backward(model) -> Callable[[], None]:
        return lambda: model(x).sum().backward()

    low, high = WRAP_DEPTHS
    stacks = {
        "plain": ((low, 1), (high, 1), (high, 4)),
        "fsdp": ((low, 1), (high, 1), (high, 4)),
        "tp": ((low, 1), (high, 1)),
    }
    wraps = {"plain": lambda model: model, "fsdp": fsdp, "tp": tp}
    probes = {
        (name, depth, width): forward_backward(wraps[name](_stack(depth, width)))
        for name, shapes in stacks.items()
        for depth, width in shapes
    }
    micro = [max(d, world) for d in WRAP_DEPTHS]
    for n in micro:  # every rank a stage of one Linear; n micro-batches of 16 tokens
        schedule = Schedule1F1B(
            PipelineStage(_stack(1), rank, world, torch.device("cpu")), n, loss_fn=lambda out, target: out.sum()
        )
        batch = torch.randn(16 * n, PROBE_DIM)

        def step(schedule=schedule, batch=batch) -> None:
            if rank == 0:
                schedule.step(batch)
            elif rank == world - 1:
                schedule.step(target=batch)
            else:
                schedule.step()

        probes[("pp", n)] = step
    secs = _sample(probes, WRAPPER_REPEATS * repeat, sync=dist.barrier)

    def added(wrap: str, depth: int, width: int) -> float:
        return secs[(wrap, depth, width)] - secs[("plain", depth, width)]

    per_unit = (added("fsdp", high, 1) - added("fsdp", low, 1)) / (high - low)
    per_tensor = max(0.0, (added("fsdp", high, 4) / high - per_unit) / 6)  # 3 more Linears
    return {
        "fsdp_unit": max(0.0, per_unit - 2 * per_tensor),
        "fsdp_tensor": per_tensor,
        "tp": max(0.0, (added("tp", high, 1) - added("tp", low, 1)) / (high - low)),
        "pp": max(0.0, (secs[("pp", micro[1])] - secs[("pp", micro[0])]) / (micro[1] - micro[0])),
    }


def _memory_share(repeat: int) -> float:
    """How much slower a memory-bound kernel (elementwise add over a large buffer) runs, in process CPU time,
    when every rank streams at once than on rank 0 alone: the ranks of a CPU node share its memory bandwidth
    (matmuls and operator dispatch measured ~1.0 here, so only memory-bound work is scaled)."""
    import torch
    import torch.distributed as dist

    x, y = torch.randn(STREAM), torch.randn(STREAM)
    out = torch.empty_like(x)

    def add_seconds() -> float:  # one add in process CPU time, after a warm-up one
        torch.add(x, y, out=out)
        start = time.process_time()
        torch.add(x, y, out=out)
        return time.process_time() - start

    alone = together = 0.0  # sums over alternating passes: the host's fast and slow states average out
    for _ in range(RATIO_REPEATS * repeat):
        dist.barrier()
        if dist.get_rank() == 0:
            alone += add_seconds()
        dist.barrier()
        together += add_seconds()
    return together / alone if alone else 1.0


def _straggle(repeat: int, iterations: int = 10) -> float:
    """How much longer every rank's work takes when the ranks synchronise after each piece of it: a tiny block's
    forward + backward x 5 (~10 ms, a phase between two of the runtime's collectives) then a small all-reduce,
    on all ranks, against rank 0 doing the work alone plus the all-reduce's own time. The ranks jitter
    independently and every collective waits for the slowest (and wakes the waiting ones)."""
    import torch
    import torch.distributed as dist

    tiny, flag = _tiny_block(), torch.zeros(16)

    def work() -> None:
        for _ in range(5):
            tiny()

    def loop(fn) -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        return (time.perf_counter() - start) / iterations

    work()
    alone = reduce = both = 0.0  # sums over alternating passes: the host's fast and slow states average out
    for _ in range(RATIO_REPEATS * repeat):
        dist.barrier()
        alone += loop(work) if dist.get_rank() == 0 else 0.0
        dist.barrier()
        reduce += loop(lambda: dist.all_reduce(flag))
        dist.barrier()
        both += loop(lambda: (work(), dist.all_reduce(flag)))
    return both / (alone + reduce) if alone else 1.0


def _link_cpu_share(repeat: int) -> float:
    """Of the wall seconds the collectives' probe sizes take (each kind, gloo on this host), the share the rank's
    process spends on a core (its own and gloo's threads: copies, polling); the rest is waiting for peers."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    buffers = [torch.ones(size // 4) for size in COLLECTIVE_BYTES]
    calls = [
        call
        for buf in buffers
        for call in (
            lambda b=buf: dist.all_reduce(b),
            lambda b=buf: dist.all_gather_single(torch.empty(b.numel() * world), b),
            lambda b=buf: dist.reduce_scatter_single(torch.empty(b.numel() // world), b),
        )
    ]
    for call in calls:  # warm
        call()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(COLLECTIVE_REPEATS * repeat):
        for call in calls:
            call()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return min(1.0, cpu / wall)


def _rank_probe(rank: int, world: int, repeat: int) -> dict:
    group_s, tensor_s = _dtensor_costs(repeat)
    return {
        "collectives": _collective_times(world, repeat),
        "memory_share": _memory_share(repeat),
        "straggle": _straggle(repeat),
        "link_cpu_share": _link_cpu_share(repeat),
        "wrappers": {"dtensor": tensor_s, "dtensor_group": group_s, **_wrapper_costs(repeat)},
    }


def fit_collective(kind: str, times: dict[int, float], world: int) -> tuple[float, float]:
    """(alpha seconds per step, beta bytes/s) of one collective from its times per buffer size, by the ring
    model of `communication.collective_time` (a p2p exchange: one step moving the whole buffer)."""
    steps, volume = ring_volume(kind, world)
    alpha_steps, inv_beta = _fit_line([volume * b for b in times], list(times.values()))
    return alpha_steps / steps, 1 / inv_beta if inv_beta > 0 else 1e12


# NCCL over NVLink moves megabytes in microseconds: buffers up to 256 MB (divisible by 4-byte floats x 1-8 ranks)
GPU_COLLECTIVE_BYTES = (3 << 16, 3 << 20, 3 << 23, 3 << 26)


def _link_probe(rank: int, world: int, repeat: int, at: ProbeDevice) -> dict:
    return {"collectives": _collective_times(world, repeat, at, GPU_COLLECTIVE_BYTES)}


def profile_links(world: int, repeat: int, at: ProbeDevice) -> dict:
    """The collectives alone on `world` GPU ranks under NCCL (spawned: a forked process cannot use CUDA):
    rank 0's measurements. The runtime's wrappers (FSDP, TP, pipeline) keep their default costs there."""
    return run_ranks(_link_probe, world, repeat, at, backend="nccl")[0]


def profile_ranks(world: int = 2, repeat: int = 5) -> dict:
    """Collectives, per-parameter and per-wrapper costs on `world` forked ranks (wall clock: they wait for
    each other): rank 0's measurements."""
    return run_ranks(_rank_probe, world, repeat)[0]


def _fsdp_unit_collectives(fits: dict[str, tuple[float, float]], world: int) -> float:
    """Seconds of the collectives inside one unit of the FSDP wrapper probe (two all-gathers and a
    reduce-scatter of a PROBE_DIM Linear over `world` ranks), by the fitted links."""
    nbytes = 4.0 * (PROBE_DIM * PROBE_DIM + PROBE_DIM)

    def seconds(kind: str) -> float:
        alpha, beta = fits[kind]
        return collective_time(kind, nbytes, world, beta, alpha)

    return 2 * seconds("all_gather") + seconds("reduce_scatter")


def with_links(
    spec: GpuSpec, eff: Efficiency, collectives: dict, world: int
) -> tuple[GpuSpec, Efficiency, dict[str, tuple[float, float]]]:
    """`spec` and `eff` with the links a collectives probe measured on `world` ranks of one node, and the
    fits: all-reduce gives the link's alpha and beta, the other kinds factors of them."""
    fits = {kind: fit_collective(kind, times, world) for kind, times in collectives.items()}
    return *with_fitted_links(spec, eff, fits), fits


def with_fitted_links(
    spec: GpuSpec, eff: Efficiency, fits: dict[str, tuple[float, float]]
) -> tuple[GpuSpec, Efficiency]:
    """`spec` and `eff` with fitted links ((alpha, beta) per kind, `with_links`)."""
    base_alpha, base_beta = fits["all_reduce"]
    spec = replace(spec, intra_bw=base_beta, intra_lat=base_alpha)
    eff = replace(
        eff,
        collectives=tuple(
            (kind, a / base_alpha if base_alpha else 1.0, b / base_beta)
            for kind, (a, b) in fits.items()
            if kind != "all_reduce"
        ),
    )
    return spec, eff


def with_ranks(spec: GpuSpec, eff: Efficiency, ranks: dict, world: int) -> tuple[GpuSpec, Efficiency, dict]:
    """`spec` and `eff` with the links and the runtime's wrapper costs a ranks probe (`profile_ranks`) measured
    on `world` ranks, and their summary (`with_ranks_summary` applies one again)."""
    fits = {kind: fit_collective(kind, times, world) for kind, times in ranks["collectives"].items()}
    summary = {
        "collectives": {kind: {"alpha_s": a, "beta_bytes_s": b} for kind, (a, b) in fits.items()},
        "wrappers": ranks["wrappers"],
        "memory_share": ranks["memory_share"],
        "straggle": ranks["straggle"],
        "link_cpu_share": ranks["link_cpu_share"],
    }
    return *with_ranks_summary(spec, eff, summary, world), summary


def with_ranks_summary(spec: GpuSpec, eff: Efficiency, summary: dict, world: int) -> tuple[GpuSpec, Efficiency]:
    """`spec` and `eff` with a ranks probe's summary (`with_ranks`; as a validation report stores it). An FSDP
    unit's cost is kept without its collectives (`stage.fsdp_seconds` prices those per plan, by the size of its
    shard and replica groups)."""
    fits = {kind: (fit["alpha_s"], fit["beta_bytes_s"]) for kind, fit in summary["collectives"].items()}
    spec, eff = with_fitted_links(spec, eff, fits)
    wrappers = summary["wrappers"]
    eff = replace(
        eff,
        dtensor_s=wrappers["dtensor"],
        dtensor_group_s=wrappers["dtensor_group"],
        fsdp_unit_s=max(0.0, wrappers["fsdp_unit"] - _fsdp_unit_collectives(fits, world)),
        fsdp_tensor_s=wrappers["fsdp_tensor"],
        tp_module_s=wrappers["tp"],
        pp_microbatch_s=wrappers["pp"],
        shared_memory=max(1.0, summary["memory_share"]),
        straggle=max(1.0, summary["straggle"]),
        link_cpu_share=summary["link_cpu_share"],
    )
    return spec, eff


def with_compute(spec: GpuSpec, compute: dict[str, float], at: ProbeDevice = CPU_PROBES) -> tuple[GpuSpec, Efficiency]:
    """The catalogue entry with the peaks a kernel profile (`profile_compute`) measured on `at`, and the
    Efficiency relative to it (links and wrappers keep the catalogue's and default values). CPU attention
    computes whole score matrices; a GPU's fused kernels skip the causal half."""
    peak = compute["matmul_flops"]
    measured = replace(spec, fp32_flops=peak, bf16_flops=peak, fp16_flops=peak, mem_bw=compute["mem_bw"])
    eff = replace(
        Efficiency(),
        matmul=1.0,
        attention=compute["attn_flops"] / peak,
        memory=1.0,
        link=1.0,
        op_overhead_s=compute["op_s"],
        attn_call_s=compute["attn_call_s"],
        matmul_bw=compute["matmul_bw"],
        elementwise_bw=compute.get("elementwise_bw", 0.0),  # absent from profiles made before it was
        score_s=compute["score_s"],
        attention_full=at.device == "cpu",
        tensor_s=compute["tensor_s"],
        tensor_group_s=compute["tensor_group_s"],
        optimizer_bytes_per_param=compute["optimizer_bytes_per_param"],
    )
    return measured, eff


def calibrate(
    spec: GpuSpec,
    *,
    world: int = 2,
    repeat: int = 5,
    save: bool = True,
    clock=time.perf_counter,
    at: ProbeDevice = CPU_PROBES,
) -> tuple[GpuSpec, Efficiency, dict]:
    """Micro-profile this device: the catalogue entry with measured peaks and links, the Efficiency relative
    to it, and the raw measurements. Saved per device type unless `save` is false. `clock` times a CPU's
    compute kernels: wall time on a dedicated device; process CPU time on a host shared with other tenants,
    whose load would otherwise be measured instead of the device (what ranks do together is always timed on
    the wall); a GPU's are timed on the synchronised wall clock. `world` = 1 skips the ranks (links and
    wrappers keep the catalogue's and default values); on GPUs, `world` of them measure NCCL's collectives
    and the wrappers keep their defaults. A shared host's speed drifts by tens of percent within minutes,
    and the fitted terms compensate each other within one profile: repeat whole calibrations rather than
    averaging terms (`validate.validate` profiles the kernels next to each run it compares with)."""
    started = time.perf_counter()
    gpu = at.device == "cuda"
    raw: dict[str, Any] = profile_compute(repeat, at.wall_clock() if gpu else clock, at=at)
    measured, eff = with_compute(spec, raw, at)
    if world > 1 and gpu:
        measured, eff, fits = with_links(measured, eff, profile_links(world, repeat, at)["collectives"], world)
        raw["collectives"] = {kind: {"alpha_s": a, "beta_bytes_s": b} for kind, (a, b) in fits.items()}
    elif world > 1:
        measured, eff, summary = with_ranks(measured, eff, profile_ranks(world, repeat), world)
        raw.update(summary)
    raw["seconds"] = time.perf_counter() - started
    if save:
        store_calibration(measured, eff, raw)
    return measured, eff, raw


if __name__ == "__main__":
    # python -m omni_core.measure.calibrate [DEVICE]: profile this host as DEVICE (default cpu) and store it
    from omni_core.common.catalog import GpuCatalog

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(json.dumps(calibrate(GpuCatalog()[device])[2], indent=2))
    print(f"stored in {calibration_path(GpuCatalog()[device].name)}")

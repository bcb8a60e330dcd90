"""Convolutional workloads: Alpa's Wide-ResNet (alpa/model/wide_resnet.py, the Alpa benchmark suite's CNN), one
pipeline layer per residual block, its convolutions data and pipeline parallel only."""

from __future__ import annotations

from omni_core.common.plan import ModelShape
from omni_core.estimator.workloads import BYTES, Layer, Workload


def wide_resnet(
    name: str,
    *,
    depth: int,
    base_channels: int,
    width_factor: int,
    global_batch: int,
    image: int = 224,
    classes: int = 1024,
    precision: str = "fp32",
    optimizer: str = "sgd",
    recompute: bool | None = None,
) -> Workload:
    """Alpa's Wide-ResNet (alpa/model/wide_resnet.py): a 7x7 stem, bottleneck blocks with 1x1 (f),
    3x3 (f * width_factor), 1x1 (4f) convolutions and a projection on each stage's first block; f doubles
    per stage. One pipeline layer per residual block; the convolutions are data/pipeline parallel only."""
    stages = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}[depth]
    b = BYTES[precision]
    stem, side = _stem(base_channels, image, b)
    blocks, cin, side = _bottleneck_stages(stages, base_channels, width_factor, side, b)
    head = Layer(
        "head",
        params=cin * classes + classes,
        flops=2 * cin * classes,
        act_bytes=b * cin,
        mem_bytes=b * cin * side**2,
        ops=4,
    )
    layers = [stem, *blocks, head]
    # n_heads=1: the plan object then refuses tp > 1 (convolutions are not tensor-parallel here)
    shape = ModelShape(n_layers=len(layers), n_heads=1, n_kv_heads=1)
    return Workload(
        name, tuple(layers), global_batch, shape, precision=precision, optimizer=optimizer, recompute=recompute
    )


def _conv(cin: int, cout: int, k: int, hw: int) -> tuple[float, float]:
    """(parameters, forward FLOPs) of a k x k convolution at output resolution hw x hw."""
    params = cin * cout * k * k
    return params, 2 * params * hw * hw


def _stem(base_channels: int, image: int, b: int) -> tuple[Layer, int]:
    """The 7x7 stride-2 convolution and max-pool over `image` x `image` inputs, and the side it leaves."""
    side = image // 2
    p, f = _conv(3, base_channels, 7, side)
    side //= 2  # max-pool
    stem = Layer(
        "stem",
        params=p + 2 * base_channels,
        flops=f,
        act_bytes=b * (3 * image**2 + 2 * base_channels * side**2 * 4),
        out_bytes=b * base_channels * side**2,
        mem_bytes=6 * b * base_channels * side**2 * 4,
        ops=4,
    )
    return stem, side


def _bottleneck_stages(
    stages: tuple[int, ...], base_channels: int, width_factor: int, side: int, b: int
) -> tuple[list[Layer], int, int]:
    """The residual blocks of every stage (`stages`: blocks per stage), the first of each stage after the first
    halving the side; and the channels and side they leave."""
    layers = []
    cin = base_channels
    for i, blocks in enumerate(stages):
        filters = base_channels * 2**i
        for j in range(blocks):
            out_side = side // 2 if (i > 0 and j == 0) else side
            layers.append(_bottleneck(f"stage{i}.block{j}", cin, filters, width_factor, side, out_side, b))
            cin, side = 4 * filters, out_side
    return layers, cin, side


def _bottleneck(name: str, cin: int, filters: int, width_factor: int, side: int, out_side: int, b: int) -> Layer:
    """A bottleneck block: 1x1 (f), 3x3 (f * width_factor), 1x1 (4f) convolutions, with a projection where the
    channels or the side change."""
    parts = [
        _conv(cin, filters, 1, side),
        _conv(filters, filters * width_factor, 3, out_side),
        _conv(filters * width_factor, 4 * filters, 1, out_side),
    ]
    if cin != 4 * filters or out_side != side:
        parts.append(_conv(cin, 4 * filters, 1, out_side))
    acts = cin * side**2 + (filters + filters * width_factor + 4 * filters) * out_side**2
    return Layer(
        name,
        params=sum(p for p, _ in parts) + 2 * (2 * filters + filters * width_factor + 4 * filters),
        flops=sum(f for _, f in parts),
        act_bytes=2 * b * acts,
        out_bytes=b * 4 * filters * out_side**2,
        mem_bytes=4 * b * acts,
        ops=12,
    )

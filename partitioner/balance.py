"""Choosing pipeline cuts: the slowest stage, compute plus boundary transfer, minimised. Pure.

A stage's time for one microbatch (forward and backward) on one of its
``devices`` is modelled as::

    compute  = PASSES · Σ over its equations: max(FLOPs / (devices · rate), kernel time)
               (the kernel time for matmuls and convolutions only)
    transfer = Σ over its boundaries (the one it receives at, the one it sends at):
               (activation bytes + gradient bytes) / (devices · link bandwidth)
               + one message latency per direction
    time     = compute + transfer

``PASSES = 3``: the backward pass costs about twice the forward. A matmul or
convolution takes at least one kernel's time however small it is, so a small
model is priced by its kernels, not its FLOPs (without that floor a narrow
model looks transfer-bound and is cut unevenly); a large one by its FLOPs.
Transfers are charged to both stages of a boundary and are not assumed to
overlap compute, so a cut through the middle of an attention (queries, keys
and values, or the scores, all alive) costs what sending them costs; no
boundary is excluded up front.

:func:`choose_cuts` takes the cut points a model offers, in model order, each
with the compute before it and the bytes crossing it (built by
:func:`~axonn_jax.partitioner.stages.cut_points`; any other enumeration, e.g.
iteration boundaries inside a scan, may add points), and returns those that
minimise the slowest stage's time; among choices within :data:`TOLERANCE` of
that time, the one whose stage times are the most even (smallest sum of
squares), then the one most even in FLOPs.

The rates come from a machine profile (:class:`StageCosts`; the face's
``axonn_jax.perf.machines.Machine.stage_costs`` builds one from a profile);
the default is the built-in ``h100-node`` profile.

Example:
    >>> pts = [CutPoint(after=k, seconds_before=1e-3 * (k + 1), flops_before=1e9 * (k + 1),
    ...                 send_bytes=8, grad_bytes=8) for k in range(7)]
    >>> [p.after for p in choose_cuts(pts, 8e-3, 4, total_flops=8e9)]
    [1, 3, 5]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from axonn_jax.partitioner.flops import MATMULS, equation_total, primitive_flops

#: forward + backward ≈ 3 forward passes
PASSES = 3
#: cuts whose slowest stage is within this fraction of the fastest possible count as
#: equally fast (the times are estimates); among them the most even stage times win
TOLERANCE = 0.02
#: weight of the FLOPs' evenness among equally fast cuts (a tie-breaker)
FLOP_TIES = 0.01


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Rates a pipeline stage is priced with, per device.

    ``tflops``: what compute reaches (peak × efficiency); ``kernel_us``: the
    least time of one matmul or convolution kernel (with the elementwise work
    fused around it); ``link_gbps``: the bandwidth one device of a stage has
    to the next stage (GB/s, 10⁹ B/s); ``latency_us``: fixed cost of one
    message. The default is the built-in ``h100-node`` profile of
    ``axonn_jax.perf.machines`` (989 TFLOP/s bf16 × 0.5; NVLink at 360 GB/s
    between two stages of up to 4 devices; no latency table) with an assumed
    floor of 1 µs per matmul or convolution kernel (not measured here: the
    least a small kernel takes on a current GPU, its launch hidden behind the
    previous kernel's).
    """

    name: str = "h100-node"
    tflops: float = 494.5
    link_gbps: float = 360.0
    latency_us: float = 0.0
    kernel_us: float = 1.0

    def __post_init__(self) -> None:
        if not (self.tflops > 0 and self.link_gbps > 0 and self.latency_us >= 0 and self.kernel_us >= 0):
            raise ValueError(f"StageCosts {self.name!r}: tflops and link_gbps must be > 0, "
                             f"latency_us and kernel_us >= 0; got {self}")  # fmt: skip

    def equation_seconds(self, eqn, devices: int = 1) -> float:
        """Forward + backward time of one equation of the model (sub-jaxprs included)."""
        rate, floor = devices * self.tflops * 1e12, self.kernel_us * 1e-6

        def seconds(e) -> float:
            work = primitive_flops(e) / rate
            return max(work, floor) if e.primitive.name in MATMULS else work

        return PASSES * equation_total(eqn, seconds)

    def transfer_seconds(self, point: CutPoint | None, devices: int = 1) -> float:
        """Sending ``point``'s activations forward and their gradients back (0 for no point)."""
        if point is None:
            return 0.0
        messages = (point.send_bytes > 0) + (point.grad_bytes > 0)
        moved = point.send_bytes + point.grad_bytes
        return moved / (devices * self.link_gbps * 1e9) + messages * self.latency_us * 1e-6

    def describe(self) -> str:
        latency = f", {self.latency_us:g} µs per message" if self.latency_us else ""
        return (f"{self.name}: {self.tflops:g} TFLOP/s, at least {self.kernel_us:g} µs per matmul, "
                f"{self.link_gbps:g} GB/s between stages{latency}")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CutPoint:
    """A place the model can be cut: after equation ``after`` of the inlined jaxpr.

    ``seconds_before`` and ``flops_before``: compute time (forward +
    backward, :meth:`StageCosts.equation_seconds`) and forward FLOPs of
    everything before the cut; ``send_bytes``: activation bytes that cross it
    (one microbatch); ``grad_bytes``: those of them that are floating (their
    gradients cross back).
    """

    after: int
    seconds_before: float
    flops_before: float
    send_bytes: int
    grad_bytes: int


def stage_times(points: Sequence[CutPoint], total_seconds: float, costs: StageCosts,
                devices: int = 1) -> list[tuple[float, float]]:  # fmt: skip
    """``(compute, transfer)`` seconds of each stage the cut ``points`` (in order) make."""
    bounds: list[CutPoint | None] = [None, *points, None]
    before = [0.0, *(p.seconds_before for p in points), total_seconds]
    return [(before[s + 1] - before[s],
             costs.transfer_seconds(bounds[s], devices) + costs.transfer_seconds(bounds[s + 1], devices))
            for s in range(len(points) + 1)]  # fmt: skip


def choose_cuts(points: Sequence[CutPoint], total_seconds: float, num_stages: int,
                costs: StageCosts = StageCosts(), devices: int = 1, *,
                total_flops: float = 0.0) -> list[CutPoint]:  # fmt: skip
    """The ``num_stages - 1`` of ``points`` (in model order) that minimise the slowest stage.

    ``total_seconds`` and ``total_flops``: the compute time and forward FLOPs
    of the whole model. Dynamic programming over the points, exact: first the
    least possible slowest-stage time ``T``, then, among the cuts whose every
    stage takes at most ``T · (1 + TOLERANCE)``, the one with the smallest sum
    of squared stage times — the other stages as even as the cut points
    allow, of two equally even cuts the one that sends less — plus
    :data:`FLOP_TIES` × the sum of squared FLOP times (of two equally fast
    cuts, the one more even in FLOPs: FLOPs are certain, the kernel time is
    an estimate). Memory stays within :data:`BLOCK` numbers however many
    points there are. ``len(points) >= num_stages - 1`` is the caller's to
    check.
    """
    if num_stages == 1:
        return []
    n = len(points) + 2  # node 0: the model's start; node n-1: its end
    before = np.array([0.0, *(p.seconds_before for p in points), total_seconds])
    flops = np.array([0.0, *(p.flops_before for p in points), total_flops])
    flops *= PASSES / (devices * costs.tflops * 1e12)  # as seconds
    edge = np.array([0.0, *(costs.transfer_seconds(p, devices) for p in points), 0.0])
    nodes = np.arange(n)

    def stage_time(cols: slice) -> np.ndarray:
        """``[i, j]``: the time of a stage from node ``i`` to node ``j`` (∞ unless i < j)."""
        time = before[None, cols] - before[:, None] + edge[:, None] + edge[None, cols]
        return np.where(nodes[:, None] < nodes[None, cols], time, np.inf)

    slowest = _minimise(n, stage_time, num_stages, lambda best, t: np.maximum(best[:, None], t))[0]
    limit = slowest * (1 + TOLERANCE)

    def squared(cols: slice) -> np.ndarray:
        time = stage_time(cols)
        work = flops[None, cols] - flops[:, None]
        return np.where(time <= limit, time * time + FLOP_TIES * work * work, np.inf)

    _, back = _minimise(n, squared, num_stages, lambda best, t: best[:, None] + t)
    chosen, j = [], n - 1
    for s in range(num_stages - 1, 0, -1):
        j = back[s][j]
        chosen.append(points[j - 1])
    return chosen[::-1]


#: how many stage times the DP holds at once (column blocks of the node × node table)
BLOCK = 1 << 22


def _minimise(n: int, stage_value, num_stages: int, combine) -> tuple[float, list[np.ndarray]]:
    """DP over stages: ``best[j]``, the best value of a split of nodes ``0..j`` so far.

    ``stage_value(cols)``: the ``[n, len(cols)]`` values of single stages ending at
    ``cols``; ``combine(best, values)``: the value of adding such a stage to ``best``.
    """
    width = max(1, BLOCK // n)
    blocks = [slice(a, min(a + width, n)) for a in range(0, n, width)]
    kept = [stage_value(b) for b in blocks] if n * n <= BLOCK else None  # small: compute once
    values = (lambda k: kept[k]) if kept else (lambda k: stage_value(blocks[k]))  # noqa: E731
    best = np.concatenate([values(k)[0] for k in range(len(blocks))])  # one stage: node 0 to node j
    back = [np.zeros(n, dtype=np.int64)]
    for _ in range(1, num_stages):
        step, new = np.zeros(n, dtype=np.int64), np.full(n, np.inf)
        for k, b in enumerate(blocks):
            total = combine(best, values(k))
            step[b] = np.argmin(total, axis=0)
            new[b] = total[step[b], np.arange(b.stop - b.start)]
        back.append(step)
        best = new
    value = float(best[n - 1])
    if not math.isfinite(value):
        raise ValueError(f"no way to cut into {num_stages} stages")  # callers check beforehand
    return value, back

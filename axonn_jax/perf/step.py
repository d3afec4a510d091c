"""Predicted time of one training step: compute + communication (+ pipeline bubble). Pure.

No overlap of communication with compute is modelled::

    t_mb   = (compute + elementwise + per-microbatch collectives) / microbatches
    step   = (microbatches + (pipeline − 1)/virtual) · t_mb
             + gradient all-reduces + optimizer update + offload copies
    bubble = (pipeline − 1) / (virtual · microbatches + pipeline − 1)

(zero-bubble schedules: a shorter fill and drain, :func:`~axonn_jax.perf.options.fill_and_drain`.)

(``virtual`` stages per pipeline rank, 1 without interleaving: the fill and
drain shrink v-fold, and each microbatch crosses each rank boundary v times.)

* compute: FLOPs per device at ``machine.peak_tflops × machine.efficiency``,
  counting what the kernels really compute: a layer's matmul is split over
  data·z·x·y, the tied output head over data·z·y only (it is replicated over
  x), attention over data·z and the axis splitting the heads;
* elementwise (memory bound): every kept activation element is written in
  forward, read in backward, and its gradient written and read
  (:data:`ELEMENTWISE_PASSES`, one more forward under recompute), at
  ``machine.activation_gbps``; activations replicated over x or y cost each copy;
* optimizer update (memory bound): :data:`OPTIMIZER_BYTES_PER_PARAM` per local
  parameter, on the device, or at ``host_memory_gbps`` when offloaded and
  updated on the host;
* communication: :func:`~axonn_jax.perf.comm.collectives` priced with the
  machine's bandwidth (eq. 7) and per-call latency; offload moves
  :func:`offload_bytes_per_param` over the host link once per step, not
  overlapped (gradients and weights, or the streamed host state).

The paper's model is communication only; compute and the memory-bound terms
are what ranking grids on one machine needs besides (replicated work differs
between grids).

Example:
    >>> from axonn_jax import Grid
    >>> from axonn_jax.perf.machines import get
    >>> from axonn_jax.perf.spec import gpt_spec
    >>> spec = gpt_spec(layers=24, hidden=4096, heads=32, seq=2048, batch=512, vocab=51200)
    >>> p = predict(spec, Grid(x=4, z=4, data=4), get("perlmutter"))
    >>> p.step_seconds > p.compute_seconds > 0
    True
"""

from __future__ import annotations

import dataclasses
import functools

from axonn_jax.partitioner.grid import Grid
from axonn_jax.perf.comm import CollectiveCost, collectives
from axonn_jax.perf.machines import Machine
from axonn_jax.perf.memory import Memory, local_params, memory
from axonn_jax.perf.options import Options, fill_and_drain
from axonn_jax.perf.spec import ModelSpec

#: Memory passes over each kept activation element: forward write, backward read,
#: gradient write and read.
ELEMENTWISE_PASSES = 4
#: AdamW reads weights, gradients and both moments and writes weights and moments:
#: 7 float32 arrays.
OPTIMIZER_BYTES_PER_PARAM = 28


def offload_bytes_per_param(options: Options) -> int:
    """Bytes per local parameter an offloaded step moves over the host link: the gradients
    to the host and the weights back (``update_on="host"``), or the host state in and out
    (``update_on="device"``: master weights and optimizer state, 24 B with AdamW in mixed
    precision); 0 without offload.

    Example:
        >>> [offload_bytes_per_param(Options(offload=True, update_on=u)) for u in ("host", "device")]
        [4, 24]
    """
    if not options.offload:
        return 0
    b = options.bytes
    if options.update_on == "host":
        return b.grad + b.param
    return 2 * b.offloaded_bytes_per_param


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Everything predicted for one grid (seconds per step, bytes per device)."""

    grid: Grid
    options: Options
    compute_seconds: float  # matmul FLOPs
    elementwise_seconds: float  # memory-bound activation work
    optimizer_seconds: float
    comm_seconds: float  # time one device spends in collectives
    offload_seconds: float
    bubble: float
    step_seconds: float
    comm_bytes: float  # ring wire bytes one device sends per step
    flops: float  # per device and step
    memory: Memory
    collectives: tuple[CollectiveCost, ...]
    collective_seconds: tuple[float, ...]
    per_microbatch_fixed: float  # collective seconds split between the microbatches
    per_microbatch_linear: float  # collective seconds each extra microbatch adds

    def step_seconds_with(self, microbatches: int) -> float:
        """The step time with another number of microbatches (same grid and options).

        Exact: collective calls and weight gathers grow linearly with the
        microbatches, activation bytes do not, compute does not.
        """
        mb, o = microbatches, self.options
        per_mb = self.per_microbatch_fixed + mb * self.per_microbatch_linear
        once = self.comm_seconds - self.per_microbatch_fixed - o.microbatches * self.per_microbatch_linear
        work = self.compute_seconds + self.elementwise_seconds
        fill = fill_and_drain(self.grid.pipeline, self.grid.virtual, o.schedule, o.recompute,
                              self.grid.placement, mb)  # fmt: skip
        return (mb + fill) / mb * (work + per_mb) + once + self.optimizer_seconds + self.offload_seconds

    def as_dict(self) -> dict:
        g = self.grid
        return {
            "x": g.x, "y": g.y, "z": g.z, "data": g.data, "pipeline": g.pipeline,
            "virtual": g.virtual, "placement": g.placement,
            "microbatches": self.options.microbatches,
            "offload": self.options.offload,
            "update_on": self.options.update_on if self.options.offload else None,
            "recompute": self.options.recompute,
            "schedule": self.options.schedule,
            "comm_seconds": self.comm_seconds,
            "compute_seconds": self.compute_seconds,
            "elementwise_seconds": self.elementwise_seconds,
            "optimizer_seconds": self.optimizer_seconds,
            "offload_seconds": self.offload_seconds,
            "bubble": self.bubble,
            "step_seconds": self.step_seconds,
            "comm_bytes_per_gpu": self.comm_bytes,
            "bytes_per_gpu": self.memory.as_dict(),
        }  # fmt: skip


def flops_per_device(spec: ModelSpec, grid: Grid, *, recompute: bool) -> float:
    """FLOPs one device of a (balanced) pipeline stage computes in one step.

    Matmuls inside the blocks (``recomputed``) and attention are shared by the
    stages; the others (the output head) are charged in full.
    """
    total = 0.0
    for m in spec.matmuls:
        passes = m.passes + (1 if recompute and m.recomputed else 0)
        split = m.in_split(grid) * (grid.axis_size(m.out_axis) if m.out_axis else 1)
        total += m.count * m.flops * passes / split / (grid.pipeline if m.recomputed else 1)
    heads = grid.axis_size(spec.attention_axis) if spec.attention_axis else 1
    total += spec.attention_flops * (4 if recompute else 3) / heads / grid.pipeline
    return total / grid.batch_shards


def elementwise_bytes(spec: ModelSpec, grid: Grid, *, recompute: bool, itemsize: int) -> float:
    """Memory traffic of elementwise work on one device in one step (see module docstring)."""
    tokens = spec.tokens / grid.batch_shards
    total = 0.0
    for a in spec.activations:
        elements = a.local_per_token(grid)
        passes = ELEMENTWISE_PASSES
        if a.kind != "other":
            elements /= grid.pipeline
            passes += 1 if recompute else 0
        total += elements * (a.itemsize or itemsize) * passes
    return total * tokens


@functools.lru_cache(maxsize=4096)
def _collectives(spec: ModelSpec, grid: Grid, recompute: bool, microbatches: int,
                 scatter_batch: bool, loss_rows: int) -> tuple[CollectiveCost, ...]:
    """:func:`collectives`, remembered: the search prices several offload and schedule
    choices of each (grid, recompute, microbatches), which send the same."""
    return collectives(spec, grid, recompute=recompute, microbatches=microbatches, scatter_batch=scatter_batch,
                       loss_rows=loss_rows)  # fmt: skip


def predict(spec: ModelSpec, grid: Grid, machine: Machine, options: Options = Options()) -> Prediction:
    """Time and memory of one training step of ``spec`` on ``grid`` (see module docstring)."""
    mb, p, v = options.microbatches, grid.pipeline, grid.virtual
    cs = _collectives(spec, grid, options.recompute, mb, options.scatter_batch, options.loss_rows)
    itemsize = options.itemsize
    seconds, once, fixed, linear = [], 0.0, 0.0, 0.0
    for c in cs:
        latency = c.calls * machine.latency(c.inner, c.size)
        transfer = c.elements * itemsize / (machine.bandwidth(c.inner, c.size) * 1e9)
        seconds.append(latency + transfer)
        if not c.per_microbatch:
            once += latency + transfer
        elif c.repeats:
            linear += (latency + transfer) / mb
        else:
            linear += latency / mb
            fixed += transfer
    per_mb = fixed + mb * linear
    flops = flops_per_device(spec, grid, recompute=options.recompute)
    compute = flops / machine.flops_per_second
    traffic = elementwise_bytes(spec, grid, recompute=options.recompute,
                                itemsize=options.bytes.activation)  # fmt: skip
    elementwise = traffic / (machine.activation_gbps * 1e9)
    n_local = local_params(spec, grid)
    offload = n_local * offload_bytes_per_param(options) / (machine.host_link_gbps * 1e9)
    on_host = options.offload and options.update_on == "host"
    update_gbps = machine.host_memory_gbps if on_host else machine.memory_gbps
    optimizer = n_local * OPTIMIZER_BYTES_PER_PARAM / (update_gbps * 1e9)
    fill = fill_and_drain(p, v, options.schedule, options.recompute, grid.placement, mb)
    step = (mb + fill) / mb * (compute + elementwise + per_mb) + once + optimizer + offload
    return Prediction(
        grid=grid,
        options=options,
        compute_seconds=compute,
        elementwise_seconds=elementwise,
        optimizer_seconds=optimizer,
        comm_seconds=per_mb + once,
        offload_seconds=offload,
        bubble=fill / (mb + fill),
        step_seconds=step,
        comm_bytes=sum(c.elements for c in cs) * itemsize,
        flops=flops,
        memory=memory(spec, grid, options),
        collectives=cs,
        collective_seconds=tuple(seconds),
        per_microbatch_fixed=fixed,
        per_microbatch_linear=linear,
    )

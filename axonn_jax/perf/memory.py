"""Bytes one device holds during a training step, by kind. Pure.

* parameters, gradients, optimizer state: the device's shard of every
  parameter (layer weights are split over x, y and z), times the bytes of
  :class:`~axonn_jax.perf.options.PrecisionBytes`; with offload the master
  weights, their gradients and the optimizer state live in host memory;
* buffers: gathered (z) weight blocks — without recompute the compiled step
  keeps every gathered block for the backward pass; with recompute one
  block's weights and weight gradients — plus, when the offloaded update
  streams through the device, one bucket of the host state (:func:`stream_buffer`);
* activations kept for backward for the microbatches in flight (one, or up
  to ``pipeline + 1`` on the first stage, the message-driven queue's default
  limit; with ``virtual`` stages per rank see :func:`in_flight`), split over
  data·z and the axis of
  each :class:`~axonn_jax.perf.spec.Activation`; under recompute only block
  inputs and one block's working set.

The pipeline's stages are assumed balanced (``1/pipeline`` of the blocks each);
embeddings, the head and the logits are charged to every stage.

Example:
    >>> from axonn_jax import Grid
    >>> from axonn_jax.perf.options import Options
    >>> from axonn_jax.perf.spec import gpt_spec
    >>> spec = gpt_spec(layers=2, hidden=64, heads=4, seq=32, batch=8, vocab=256)
    >>> on, off = (memory(spec, Grid(z=2), Options(offload=o)) for o in (True, False))
    >>> on.optimizer, off.optimizer > 0
    (0.0, True)
"""

from __future__ import annotations

import dataclasses

from axonn_jax.partitioner.grid import Grid, default_limit
from axonn_jax.perf.options import Options
from axonn_jax.perf.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device (``host``: bytes per device kept in host memory)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    host: float

    @property
    def device(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict[str, float]:
        return dict(params=self.params, grads=self.grads, optimizer=self.optimizer,
                    activations=self.activations, buffers=self.buffers,
                    device_total=self.device, host=self.host)  # fmt: skip


def local_params(spec: ModelSpec, grid: Grid) -> float:
    """Parameter elements stored on one device of a (balanced) pipeline stage."""
    return sum(
        p.local_elements(grid) * p.count / (grid.pipeline if p.per_block else 1)
        for p in spec.params
    )


def memory(spec: ModelSpec, grid: Grid, options: Options) -> Memory:
    """Bytes per device of ``spec`` on ``grid`` (see module docstring)."""
    b = options.bytes
    n = local_params(spec, grid)
    offload = options.offload
    params = n * (b.param + (0 if offload else b.master))
    grads = n * (b.grad + (0 if offload else b.master_grad))
    optimizer = 0.0 if offload else n * b.optimizer
    host = n * b.offloaded_bytes_per_param if offload else 0.0
    return Memory(params, grads, optimizer, _activations(spec, grid, options),
                  stream_buffer(n, options) + _gathered(spec, grid, options), host)  # fmt: skip


def stream_buffer(n_local: float, options: Options) -> float:
    """Device bytes of one bucket of the offloaded state of ``n_local`` parameters, streamed
    through the device (``update_on="device"``): ``bucket_bytes`` of float32 masters and
    their optimizer state, never more than the whole offloaded state; 0 when the update
    runs on the host.

    Example:
        >>> stream_buffer(1e9, Options(offload=True, update_on="device", bucket_bytes=4 * 2**20))
        12582912.0
    """
    if not (options.offload and options.update_on == "device"):
        return 0.0
    b = options.bytes
    return min(options.bucket_bytes / 4, n_local) * b.offloaded_bytes_per_param


def _gathered(spec: ModelSpec, grid: Grid, options: Options) -> float:
    if grid.z == 1:
        return 0.0
    stage_blocks = spec.layers / grid.pipeline
    outside = sum(p.use_elements(grid) * p.count for p in spec.params if p.depth and not p.per_block)
    per_block = sum(p.use_elements(grid) * p.count for p in spec.params
                    if p.depth and p.per_block) / spec.layers  # fmt: skip
    kept_blocks = 1 if options.recompute else stage_blocks
    # gathered weights (kept blocks) + one block's gathered weight gradients
    return options.bytes.param * (outside + per_block * (kept_blocks + 1))


def in_flight(microbatches: int, pipeline: int, virtual: int = 1, schedule: str = "message",
              placement: str = "interleaved") -> float:  # fmt: skip
    """Microbatches whose activations the busiest pipeline rank holds at once, in units of
    one microbatch through all of that rank's layers.

    The message-driven queue keeps at most ``limit − s`` microbatches between
    stage ``s``'s forward and backward, ``limit`` = :func:`default_limit` of
    the ``p·v`` stages; rank 0 holds stages ``0, p, 2p, …``, each ``1/v`` of
    its layers, so it holds ``Σ_c min(m, limit − c·p) / v`` — ``min(m, p + 1)``
    without virtual stages (interleaving costs memory). The V-shaped placement
    (``placement="v"``, ``virtual=2``: rank ``r`` holds stages ``r`` and
    ``2p − 1 − r``) spreads it evenly: every rank holds at most
    ``min(2m, 2p + 1)`` stage-microbatches at once (the message-driven queue
    and 1F1B in ``tests/schedule_sim.py``, p = 2, 4, 8), ``min(m, p + 1/2)``
    microbatches of a rank's layers against the interleaved rank 0's
    ``(min(m, 2p + 1) + min(m, p + 1))/2``.

    Zero bubble: ``"zb"`` also keeps up to ``p`` deferred W's per stage (its W
    budget, :func:`deferred_w`; on the V ``p + 3/2`` microbatches of a rank's layers, as
    simulated: its W's wait for ``2p`` deferred before going ahead of forwards), counted
    here as whole microbatches; :func:`memory`
    charges each at :func:`w_residual_share` of one (stage 0's W holds all its residuals
    and the output gradient: its B is empty); ``"zb-h1"``
    keeps 1F1B's ``min(m, p)`` (stage 0 defers no W); ``"zb-v"`` (V only) too: a
    rank holds at most ``min(2m, 2p)`` stage-microbatches of residuals of either
    kind, full or W's (``tests/test_schedule_sim.py``, p = 2…8). 1F1B and GPipe
    are priced like the message-driven queue.

    Example:
        >>> in_flight(16, 4), in_flight(16, 4, virtual=2), in_flight(2, 4, virtual=2)
        (5.0, 7.0, 2.0)
        >>> in_flight(16, 4, schedule="zb"), in_flight(16, 4, schedule="zb-h1")
        (9.0, 4.0)
        >>> in_flight(16, 4, 2, "zb-v", placement="v"), in_flight(16, 4, 2, "zb", placement="v")
        (4.0, 10.0)
        >>> in_flight(16, 4, virtual=2, placement="v"), in_flight(3, 4, virtual=2, placement="v")
        (4.5, 3.0)
    """
    if pipeline == 1:
        return 1.0
    if schedule in ("zb-h1", "zb-v"):
        return float(min(microbatches, pipeline))
    limit = default_limit(pipeline * virtual)
    if placement == "v":
        full = min(virtual * microbatches, limit) / virtual
    else:
        full = sum(min(microbatches, limit - c * pipeline) for c in range(virtual)) / virtual
    return full + deferred_w(microbatches, pipeline, virtual, schedule, placement)


def deferred_w(microbatches: int, pipeline: int, virtual: int = 1, schedule: str = "message",
               placement: str = "interleaved") -> float:  # fmt: skip
    """How many of :func:`in_flight`'s microbatches are deferred W's (``"zb"`` only: its W budget
    ``p``; on the V ``p + 3/2``, the most a rank held beyond its full residuals in
    ``tests/schedule_sim.py``, p = 2…8)."""
    if schedule != "zb" or pipeline == 1:
        return 0.0
    return float(min(microbatches, pipeline + 1.5 if placement == "v" else pipeline))


def output_gradient_elements(spec: ModelSpec, grid: Grid) -> float:
    """Elements per token of the gradient a stage receives for its output (``hidden/y``)."""
    return spec.hidden / grid.axis_size("y")


def matmul_w_elements(spec: ModelSpec, grid: Grid) -> float:
    """Elements per token one balanced stage's weight matmuls read for dW = Iᵀ·dO: each input
    (once per ``fused`` group) and each output gradient, split over the layer's axes.

    Blocks' matmuls (``count`` a multiple of the layers) count ``1/pipeline`` of their copies,
    the others whole (as :func:`memory` charges embeddings and the head to every stage).
    """
    total = 0.0
    for mm in spec.matmuls:
        copies = mm.count / grid.pipeline if mm.count % spec.layers == 0 else mm.count
        inputs = mm.input_per_row / mm.in_split(grid) / mm.fused
        grads = mm.n / (grid.axis_size(mm.out_axis) if mm.out_axis else 1)
        total += copies * (inputs + grads)
    return total


def w_residual_share(spec: ModelSpec, grid: Grid, options: Options, first: bool = True) -> float:
    """What one deferred W holds per microbatch, as a share of the stage's full residuals.

    ``first`` (stage 0, the busiest rank's): its input is data, so its B is empty and W runs its
    whole backward, holding every residual plus the output gradient: ``1 + g/A``
    (measured: ``tests/test_zero_bubble.py``, GPT stage 0 holds 247,756 B per deferred W
    against 245,708 B of residuals). A later stage: its weight matmuls' inputs and output
    gradients (:func:`matmul_w_elements`, a lower bound: norms and biases are not counted),
    at most ``1 + g/A``.
    """
    per_token = _activation_bytes_per_token(spec, grid, options)
    if per_token == 0:
        return 0.0
    grad = output_gradient_elements(spec, grid) * options.bytes.activation
    whole = 1.0 + grad / per_token
    if first:
        return whole
    return min(matmul_w_elements(spec, grid) * options.bytes.activation / per_token, whole)


def held_microbatches(spec: ModelSpec, grid: Grid, options: Options, microbatches: int) -> float:
    """The busiest rank's held residuals in microbatches of full residuals: :func:`in_flight`'s
    full ones plus each deferred W (:func:`deferred_w`) at its :func:`w_residual_share`."""
    args = (microbatches, grid.pipeline, grid.virtual, options.schedule, grid.placement)
    deferred = deferred_w(*args)
    if not deferred:
        return in_flight(*args)
    return in_flight(*args) - deferred + deferred * w_residual_share(spec, grid, options)


def _activation_bytes_per_token(spec: ModelSpec, grid: Grid, options: Options) -> float:
    """Bytes per token (of the whole batch's rows on this device) of one stage's kept activations."""
    total = 0.0
    for a in spec.activations:
        elements = a.local_per_token(grid)
        if a.kind == "checkpoint":
            elements /= grid.pipeline
        elif a.kind == "block":
            elements /= spec.layers if options.recompute else grid.pipeline
        total += elements * (a.itemsize or options.bytes.activation)
    return total


def _activations(spec: ModelSpec, grid: Grid, options: Options) -> float:
    microbatches = options.microbatches
    tokens = spec.tokens / (grid.batch_shards * microbatches)
    held = held_microbatches(spec, grid, options, microbatches)  # the busiest rank
    return _activation_bytes_per_token(spec, grid, options) * tokens * held

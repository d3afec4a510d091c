"""How a training step is run, as far as time and memory are concerned. Pure.

Example:
    >>> Options(precision="fp32", recompute=False).bytes
    PrecisionBytes(param=4, grad=4, master=0, master_grad=0, optimizer=8, activation=4)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter of each copy, and per activation element (IPDPS'22 §memory)."""

    param: int  # weights used for compute
    grad: int  # their gradients
    master: int  # full-precision master weights (0: the compute weights are the master)
    master_grad: int  # full-precision gradients held between backward and update
    optimizer: int  # Adam m and v
    activation: int

    @property
    def device_bytes_per_param(self) -> int:
        """Without offload: everything on the device (mixed precision: 16)."""
        return self.param + self.grad + self.master + self.master_grad + self.optimizer

    @property
    def offloaded_bytes_per_param(self) -> int:
        """With offload, the host holds the master weights (in fp32 too: a copy of the
        device's weights), their gradients and the optimizer state (mixed and fp32: 12)."""
        return (self.master or self.param) + self.master_grad + self.optimizer


PRECISIONS: dict[str, PrecisionBytes] = {
    # bf16/fp16 weights and gradients on the device, fp32 master weights and Adam. IPDPS'22
    # also counts fp32 gradients (20 B/param); MasterOptimizer casts the gradients as the
    # update reads them, and holds none (runtime.memory measures 16 on the device, 12 on the
    # host with offload; on an H100 the update's temporaries were 0 B)
    "mixed": PrecisionBytes(param=2, grad=2, master=4, master_grad=0, optimizer=8, activation=2),
    # everything in float32 (what axonn_jax runs today: parameters are float32)
    "fp32": PrecisionBytes(param=4, grad=4, master=0, master_grad=0, optimizer=8, activation=4),
}


#: where an offloaded update runs: ``MasterOptimizer(update_on=)``'s choices (the model
#: imports nothing of the runtime; tests/test_offload.py holds the two equal)
UPDATE_ON = ("host", "device")

#: the pipeline schedules the model prices (those of ``axonn_jax.runtime.pipeline.schedules``)
SCHEDULES = ("message", "1f1b", "gpipe", "zb", "zb-h1", "zb-v")


def fill_and_drain(pipeline: int, virtual: int, schedule: str, recompute: bool,
                   placement: str = "interleaved", microbatches: int | None = None) -> float:  # fmt: skip
    """The pipeline's idle time, in microbatch-times of one rank's work.

    GPipe, 1F1B and message-driven: ``(p − 1)/v`` (the classic bubble). Zero
    bubble: W fills the cool-down, so only the warm-up's forwards remain —
    ``(p − 1)/v`` forwards for ``"zb"`` (the floor the message-driven policy
    reaches in ``tests/schedule_sim.py``) and ``(p − 1)`` for ZB-H1 (its
    ``(p − 1)·(F + B − W)`` with B = W; no interleaving gain is priced). A
    forward is ``1/3`` of a microbatch's compute (the backward's two matmuls per
    forward matmul), ``1/4`` under recompute (the forward runs again). The
    V-shaped placement (``placement="v"``) has its own: :func:`v_fill_and_drain`.

    Example:
        >>> fill_and_drain(4, 1, "message", False), fill_and_drain(4, 1, "zb", False)
        (3.0, 1.0)
    """
    if pipeline == 1:
        return 0.0
    forward = 1 / 4 if recompute else 1 / 3
    if placement == "v":
        return v_fill_and_drain(pipeline, schedule, forward, microbatches)
    if schedule == "zb-v":
        raise ValueError("schedule 'zb-v' runs on the V-shaped placement only (placement='v', virtual=2)")
    if schedule == "zb":
        return (pipeline - 1) / virtual * forward
    if schedule == "zb-h1":
        return (pipeline - 1) * forward
    return (pipeline - 1) / virtual


def v_fill_and_drain(pipeline: int, schedule: str, forward: float, microbatches: int | None = None) -> float:
    """:func:`fill_and_drain` on the V-shaped placement (``virtual=2``; rank ``r`` holds stages
    ``r`` and ``2p − 1 − r``), in microbatch-times of one rank's work, a forward being
    ``forward`` of it and B = W the rest halved (``microbatches`` ``None``: many).

    * ``"zb-v"`` (:func:`~axonn_jax.runtime.pipeline.timeline.zb_v_theory`, F = B = W):
      ``max(p − 1, 4p − 2m − 2)·F/2`` — the zero-bubble floor, ``(p − 1)·F/2``, once
      ``m ≥ 2p − 1``, else the order's critical path ``(4p + 4m − 2)·F/2`` less the work;
    * ``"1f1b"``, ``"gpipe"``: the per-stage orders do not interleave on a V:
      ``(p − 1) − min(m − 1, p − 1)·F/2`` (1F1B: exact in ``tests/schedule_sim.py``,
      p = 2…8, m = 1…32, F = B = W and B = W = F/2; GPipe priced the same);
    * ``"zb"``: the floor ``(p − 1)·F/2`` (the warm-up forwards, as interleaved);
    * ``"zb-h1"``: ``(p − 1)·F``, as without virtual stages (its per-stage order gains
      nothing from the second stage);
    * ``"message"``: ``(p − 1)/2``, the interleaved theory (reached exactly at
      B = W = F/2 in the simulator).

    Example:
        >>> [round(v_fill_and_drain(4, s, 1 / 3, 16), 3) for s in ("zb-v", "zb", "zb-h1", "1f1b", "message")]
        [0.5, 0.5, 1.0, 2.5, 1.5]
        >>> round(v_fill_and_drain(4, "zb-v", 1 / 3, 2), 3)   # fewer than 2p − 1 microbatches
        1.667
    """
    p = pipeline
    m = microbatches if microbatches is not None else 2 * p
    if schedule == "zb-v":
        return max(p - 1, 4 * p - 2 * m - 2) * forward / 2
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) - min(m - 1, p - 1) * forward / 2
    if schedule == "zb":
        return (p - 1) * forward / 2
    if schedule == "zb-h1":
        return (p - 1) * forward
    return (p - 1) / 2


@dataclasses.dataclass(frozen=True)
class Options:
    """``precision`` (``"mixed"`` or ``"fp32"``), activation checkpointing per block
    (``recompute``), optimizer offload to host memory (``offload``: the update runs
    on the host, ``update_on="host"``, or streams the host state through the device
    in buckets of ``bucket_bytes`` float32 masters, ``update_on="device"``, as
    :class:`~axonn_jax.runtime.master_optimizer.MasterOptimizer` does), and the number of
    ``microbatches`` a step's batch is split into (gradient accumulation, or
    the pipeline's microbatches), and the pipeline ``schedule`` (one of
    :data:`SCHEDULES`; the zero-bubble ones, ``"zb"``, ``"zb-h1"`` and ``"zb-v"``
    (V-shaped placement only), shorten the bubble and keep deferred weight-gradient residuals).
    ``scatter_batch``: the program reduce-scatters layer outputs onto the batch
    (``partition``'s default) instead of all-reducing them. ``loss_rows``: the
    rows a softmax cross-entropy planned with the model reads (``pm.train_step``
    / ``pm.value_and_grad``; ``batch·seq`` for :func:`~axonn_jax.models.next_token_loss`
    on loader windows), whose all-reduces over x replace the logits' gathers
    (:func:`~axonn_jax.perf.comm.collectives`); 0: the loss runs after
    ``pm.apply``'s gathered outputs.
    """

    precision: str = "mixed"
    recompute: bool = True
    offload: bool = False
    microbatches: int = 1
    bucket_bytes: int = 64 * 2**20
    update_on: str = "host"
    scatter_batch: bool = True
    schedule: str = "message"
    loss_rows: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is unknown; choose one of {SCHEDULES}")
        if self.update_on not in UPDATE_ON:
            raise ValueError(f"update_on {self.update_on!r} is unknown; choose one of {UPDATE_ON}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is unknown; choose one of {sorted(PRECISIONS)}")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {self.microbatches!r}")
        if isinstance(self.loss_rows, bool) or not isinstance(self.loss_rows, int) or self.loss_rows < 0:
            raise ValueError(f"loss_rows must be an int >= 0 (0: no planned loss), got {self.loss_rows!r}")

    @property
    def bytes(self) -> PrecisionBytes:
        return PRECISIONS[self.precision]

    @property
    def itemsize(self) -> int:
        """Bytes per element of what the collectives move (weights and activations)."""
        return self.bytes.param

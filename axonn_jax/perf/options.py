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
    master_grad: int
    optimizer: int  # Adam m and v
    activation: int

    @property
    def device_bytes_per_param(self) -> int:
        """Without offload: everything on the device (mixed precision: 20)."""
        return self.param + self.grad + self.master + self.master_grad + self.optimizer

    @property
    def offloaded_bytes_per_param(self) -> int:
        """With offload, master weights, their gradients and the optimizer live on the host."""
        return self.master + self.master_grad + self.optimizer


PRECISIONS: dict[str, PrecisionBytes] = {
    # bf16/fp16 weights and gradients on the device, fp32 master weights, gradients and Adam
    "mixed": PrecisionBytes(param=2, grad=2, master=4, master_grad=4, optimizer=8, activation=2),
    # everything in float32 (what axonn_jax runs today: parameters are float32)
    "fp32": PrecisionBytes(param=4, grad=4, master=0, master_grad=0, optimizer=8, activation=4),
}


@dataclasses.dataclass(frozen=True)
class Options:
    """``precision`` (``"mixed"`` or ``"fp32"``), activation checkpointing per block
    (``recompute``), optimizer offload to host memory (``offload``; a bucket
    buffer of 16 × ``bucket_bytes`` stays on the device), and the number of
    ``microbatches`` a step's batch is split into (gradient accumulation, or
    the pipeline's microbatches). ``scatter_batch``: the program reduce-scatters
    layer outputs onto the batch (``partition``'s default) instead of all-reducing them.
    """

    precision: str = "mixed"
    recompute: bool = True
    offload: bool = False
    microbatches: int = 1
    bucket_bytes: int = 16 * 2**20
    scatter_batch: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is unknown; choose one of {sorted(PRECISIONS)}")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {self.microbatches!r}")

    @property
    def bytes(self) -> PrecisionBytes:
        return PRECISIONS[self.precision]

    @property
    def itemsize(self) -> int:
        """Bytes per element of what the collectives move (weights and activations)."""
        return self.bytes.param

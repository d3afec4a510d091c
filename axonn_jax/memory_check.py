"""Ahead-of-time memory check of planned configurations: compile, don't run.

The planner (:func:`axonn_jax.search.search`) prices memory analytically. For
its top configurations this module partitions the real model on the devices
at hand, builds the configuration's train step (``pm.train_step`` with the
planned precision, offload, microbatches and recompute), lowers and compiles
it ahead of time, and reads ``memory_analysis()`` (through
:func:`axonn_jax.runtime.memory.compiled_bytes`): the bytes one device needs,
next to the prediction. Configurations whose compiled bytes exceed the limit
are dropped.

Parameters and optimizer state are created (``pm.init``, ``step.init``) to
give the program its argument layouts; no step runs. A pipelined
configuration runs one program per stage and task, not one step program: it
is reported unchecked and kept.

Example::

    result = search(spec, 8, machine, top=6)
    checks = check_memory(model, (tokens,), result.ranked[:3], limit_bytes=16 * 2**30)
    print(format_checks(checks))
    kept = [c.prediction for c in checks if c.fits]
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioned import partition
from axonn_jax.partitioner.grid import BATCH_AXES
from axonn_jax.perf.step import Prediction
from axonn_jax.runtime.memory import compiled_bytes

#: the runtime's precision for each precision the model prices
RUNTIME_PRECISION = {"mixed": "bf16", "fp32": "fp32"}


@dataclasses.dataclass(frozen=True)
class MemoryCheck:
    """One configuration's predicted and compiled bytes per device (``compiled`` ``None``:
    not checked, ``note`` says why)."""

    prediction: Prediction
    limit: float  # bytes per device
    compiled: int | None = None
    note: str = ""

    @property
    def predicted(self) -> float:
        return self.prediction.memory.device

    @property
    def fits(self) -> bool:
        """Kept: compiled within the limit, or not checked."""
        return self.compiled is None or self.compiled <= self.limit

    def as_dict(self) -> dict:
        return {"predicted_bytes": self.predicted, "compiled_bytes": self.compiled,
                "limit_bytes": self.limit, "fits": self.fits, "note": self.note}  # fmt: skip


def squares_loss(outputs, batch) -> jax.Array:
    """A loss for any model: the mean square of its (float) outputs. Memory does not depend
    on which loss it is, beyond the outputs' gradient, which every loss has."""
    leaves = [x for x in jax.tree.leaves(outputs) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves)


def check_memory(
    model,
    example_args: Sequence,
    predictions: Sequence[Prediction],
    *,
    limit_bytes: float,
    loss_fn: Callable = squares_loss,
    optimizer: optax.GradientTransformation | None = None,
    devices: Sequence | None = None,
) -> list[MemoryCheck]:
    """Compile each prediction's train step ahead of time and compare its bytes per device.

    ``example_args``: the model's inputs for one whole step (arrays or
    ShapeDtypeStructs; the global batch the predictions were made for).
    ``optimizer``: the step's (default AdamW, two fp32 slots, as the model
    prices). ``devices``: the devices at hand (default ``jax.devices()``; ``partition``
    meshes the first ``grid.size`` of the process's); a configuration needing more is
    reported unchecked.
    """
    devices = list(devices if devices is not None else jax.devices())
    optimizer = optimizer or optax.adamw(1e-3)
    out = []
    for pred in predictions:
        size = pred.grid.size
        if size > len(devices):
            out.append(MemoryCheck(pred, limit_bytes, note=f"needs {size} devices, {len(devices)} here"))
        else:
            out.append(_check_one(model, example_args, pred, limit_bytes, loss_fn, optimizer))
    return out


def _check_one(model, example_args, pred: Prediction, limit: float, loss_fn, optimizer) -> MemoryCheck:
    """Compiled bytes per device: arguments + temporaries + outputs not aliased to arguments."""
    options = pred.options
    pm = partition(model, pred.grid, *example_args)
    step = pm.train_step(loss_fn, optimizer, precision=RUNTIME_PRECISION[options.precision],
                         offload=options.offload, microbatches=options.microbatches,
                         remat="full" if options.recompute else None)  # fmt: skip
    if not step.one_program:
        return MemoryCheck(pred, limit, note="pipelined: one program per stage and task")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unusable donations, offload placement notes
        params, opt_state = step.init(pm.init(jax.random.key(0)))
        sharding = NamedSharding(pm.mesh, P(BATCH_AXES))
        batch = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in example_args]
        compiled = step.lower(params, opt_state, batch[0] if len(batch) == 1 else tuple(batch)).compile()
    b = compiled_bytes(compiled)
    return MemoryCheck(pred, limit, compiled=b["arguments"].device + b["temp"].device + b["outputs"].device
                       - min(b["aliased"].device, b["outputs"].device))  # fmt: skip


def format_checks(checks: Sequence[MemoryCheck]) -> str:
    """A table: rank, grid, predicted and compiled MiB per device, the limit, kept or dropped."""
    rows = [("rank", "grid", "predicted MiB", "compiled MiB", "compiled/predicted", "verdict")]
    for i, c in enumerate(checks, 1):
        g = c.prediction.grid
        grid = f"{g.x}×{g.y}×{g.z} data={g.data} pipe={g.pipeline}" + (f"×{g.virtual}" if g.virtual > 1 else "")
        if c.compiled is None:
            rows.append((str(i), grid, f"{c.predicted / 2**20:.2f}", "-", "-", f"kept, unchecked ({c.note})"))
            continue
        ratio = f"{c.compiled / c.predicted:.2f}" if c.predicted else "-"
        verdict = "fits" if c.fits else f"dropped (> {c.limit / 2**20:.2f} MiB)"
        rows.append((str(i), grid, f"{c.predicted / 2**20:.2f}", f"{c.compiled / 2**20:.2f}", ratio, verdict))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])

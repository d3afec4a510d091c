"""Ahead-of-time check of planned configurations: compile, don't run; read memory and cost.

The planner (:func:`axonn_jax.search.search`) prices configurations
analytically. For its top configurations this module partitions the real
model on the devices at hand, builds the configuration's train step
(``pm.train_step`` with the planned precision, offload, microbatches and
recompute), lowers and compiles it ahead of time, and reads next to the
prediction:

* memory: ``memory_analysis()`` (through
  :func:`axonn_jax.runtime.memory.compiled_bytes`), the bytes one device
  needs. Configurations whose compiled bytes exceed the limit are dropped.
* time: XLA's ``cost_analysis()`` (FLOPs, bytes accessed) and the program's
  collectives (:func:`axonn_jax.runtime.hlo.collectives`), priced with the
  machine profile (:class:`~axonn_jax.perf.compiled.ProgramCost`).
  :func:`rerank` orders the checked configurations by it.

Parameters and optimizer state are created (``pm.init``, ``step.init``) to
give the program its argument layouts; no step runs. A pipelined
configuration runs one program per stage and task, not one step program: it
is reported unchecked and kept in its place.

Example::

    result = search(spec, 8, machine, top=6)
    checks = check_compiled(model, (tokens,), result.ranked[:3], limit_bytes=16 * 2**30, machine=machine)
    print(format_checks(checks))
    best = rerank(checks)[0].prediction
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
from axonn_jax.perf.compiled import ProgramCollective, ProgramCost, ProgramTime, nesting
from axonn_jax.perf.machines import Machine
from axonn_jax.perf.step import Prediction
from axonn_jax.runtime.hlo import collectives as hlo_collectives
from axonn_jax.runtime.memory import compiled_bytes

#: the runtime's precision for each precision the model prices
RUNTIME_PRECISION = {"mixed": "bf16", "fp32": "fp32"}


@dataclasses.dataclass(frozen=True)
class CompiledCheck:
    """One configuration's predicted and compiled bytes per device, and the step time its
    compiled program implies (``compiled`` ``None``: not checked, ``note`` says why;
    ``time`` ``None``: not checked, or no machine to price it with)."""

    prediction: Prediction
    limit: float  # bytes per device
    compiled: int | None = None
    note: str = ""
    time: ProgramTime | None = None

    @property
    def predicted(self) -> float:
        return self.prediction.memory.device

    @property
    def fits(self) -> bool:
        """Kept: compiled within the limit, or not checked."""
        return self.compiled is None or self.compiled <= self.limit

    def as_dict(self) -> dict:
        return {"predicted_bytes": self.predicted, "compiled_bytes": self.compiled,
                "limit_bytes": self.limit, "fits": self.fits, "note": self.note,
                "predicted_seconds": self.prediction.step_seconds,
                "compiled_seconds": self.time and self.time.total,
                "compiled_time": self.time and dataclasses.asdict(self.time)}  # fmt: skip


def squares_loss(outputs, batch) -> jax.Array:
    """A loss for any model: the mean square of its (float) outputs. Memory does not depend
    on which loss it is, beyond the outputs' gradient, which every loss has."""
    leaves = [x for x in jax.tree.leaves(outputs) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves)


def check_compiled(
    model,
    example_args: Sequence,
    predictions: Sequence[Prediction],
    *,
    limit_bytes: float,
    machine: Machine | None = None,
    loss_fn: Callable = squares_loss,
    optimizer: optax.GradientTransformation | None = None,
    devices: Sequence | None = None,
) -> list[CompiledCheck]:
    """Compile each prediction's train step ahead of time: its bytes per device, and (given
    the ``machine`` the predictions were priced for) the step time its program implies.

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
            out.append(CompiledCheck(pred, limit_bytes, note=f"needs {size} devices, {len(devices)} here"))
        else:
            out.append(_check_one(model, example_args, pred, limit_bytes, machine, loss_fn, optimizer))
    return out


def rerank(checks: Sequence[CompiledCheck]) -> list[CompiledCheck]:
    """The configurations that fit, the checked ones reordered by their compiled step time
    among the places they hold; the others (unchecked, or not priced) keep their places.

    The analytical model ranks every configuration; the compiled program of each checked
    one says more about it (every kernel and collective XLA kept), so it orders them.
    """
    kept = [c for c in checks if c.fits]
    places = [i for i, c in enumerate(kept) if c.time is not None]
    for i, c in zip(places, sorted((kept[i] for i in places), key=lambda c: c.time.total)):
        kept[i] = c
    return kept


def program_cost(compiled, num_devices: int) -> ProgramCost:
    """What XLA reports for one device of a compiled (SPMD) program: its FLOPs and bytes
    accessed (``cost_analysis()``) and its collectives (from the HLO text)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per program
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return ProgramCost(
        flops=float(analysis.get("flops", 0.0)),
        bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
        collectives=tuple(ProgramCollective(c.kind, c.group_size, nesting(c.groups[0]), c.wire_bytes)
                          for c in hlo_collectives(compiled.as_text(), num_devices=num_devices)
                          if not c.trivial),  # fmt: skip
    )


def _check_one(model, example_args, pred: Prediction, limit: float, machine: Machine | None, loss_fn,
               optimizer) -> CompiledCheck:  # fmt: skip
    """Compiled bytes per device (arguments + temporaries + outputs not aliased to arguments)
    and, with a ``machine``, the program's step time on it."""
    options = pred.options
    pm = partition(model, pred.grid, *example_args)
    step = pm.train_step(loss_fn, optimizer, precision=RUNTIME_PRECISION[options.precision],
                         offload=options.offload, update_on=options.update_on, bucket_bytes=options.bucket_bytes,
                         microbatches=options.microbatches, remat="full" if options.recompute else None)  # fmt: skip
    if not step.one_program:
        return CompiledCheck(pred, limit, note="pipelined: one program per stage and task")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unusable donations, offload placement notes
        params, opt_state = step.init(pm.init(jax.random.key(0)))
        sharding = NamedSharding(pm.mesh, P(BATCH_AXES))
        batch = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in example_args]
        compiled = step.lower(params, opt_state, batch[0] if len(batch) == 1 else tuple(batch)).compile()
    b = compiled_bytes(compiled)
    time = program_cost(compiled, pred.grid.size).time(machine) if machine is not None else None
    return CompiledCheck(pred, limit, compiled=b["arguments"].device + b["temp"].device + b["outputs"].device
                         - min(b["aliased"].device, b["outputs"].device), time=time)  # fmt: skip


def format_checks(checks: Sequence[CompiledCheck]) -> str:
    """A table in the planner's order: predicted and compiled step ms, the place :func:`rerank`
    gives it, predicted and compiled MiB per device, their ratio, kept or dropped."""
    rows = [("rank", "grid", "predicted ms", "compiled ms", "reranked", "predicted MiB", "compiled MiB",
             "compiled/predicted MiB", "verdict")]  # fmt: skip
    place = {id(c): i for i, c in enumerate(rerank(checks), 1)}
    for i, c in enumerate(checks, 1):
        g = c.prediction.grid
        grid = f"{g.x}×{g.y}×{g.z} data={g.data} pipe={g.pipeline}" + (f"×{g.virtual}" if g.virtual > 1 else "")
        times = (f"{c.prediction.step_seconds * 1e3:.4g}", f"{c.time.total * 1e3:.4g}" if c.time else "-",
                 str(place.get(id(c), "-")))  # fmt: skip
        if c.compiled is None:
            rows.append((str(i), grid, *times, f"{c.predicted / 2**20:.2f}", "-", "-",
                         f"kept, unchecked ({c.note})"))  # fmt: skip
            continue
        ratio = f"{c.compiled / c.predicted:.2f}" if c.predicted else "-"
        verdict = "fits" if c.fits else f"dropped (> {c.limit / 2**20:.2f} MiB)"
        rows.append((str(i), grid, *times, f"{c.predicted / 2**20:.2f}", f"{c.compiled / 2**20:.2f}", ratio,
                     verdict))  # fmt: skip
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])

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
* with ``trial_steps``, a trial run: each compiled step runs that many times
  on the devices (parameters from ``pm.init``, a synthetic batch of the
  example's shapes) and its median step is kept as ``measured``;
  :func:`rerank` then orders by the measured time. This is what
  ``axonn-jax plan --check K --trial`` does: on the machine the job will run
  on, the top K of the model are timed, not only priced.

Parameters and optimizer state are created (``pm.init``, ``step.init``) to
give the program its argument layouts; without a trial no step runs. A pipelined
configuration runs one program per stage and task, not one step program: it
is reported unchecked and kept in its place.

Example::

    result = search(spec, 8, machine, top=6)
    checks = check_compiled(model, (tokens,), to_check(result.ranked, 3), limit_bytes=16 * 2**30,
                            machine=machine)
    print(format_checks(checks))
    best = rerank(checks)[0].prediction
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioned import partition
from axonn_jax.partitioner.grid import BATCH_AXES
from axonn_jax.perf.compiled import ProgramCollective, ProgramCost, ProgramTime, nesting
from axonn_jax.perf.machines import Machine
from axonn_jax.perf.step import Prediction
from axonn_jax.runtime.collectives import host_comm
from axonn_jax.runtime.hlo import collectives as hlo_collectives
from axonn_jax.runtime.memory import compiled_bytes

#: the runtime's precision for each precision the model prices
RUNTIME_PRECISION = {"mixed": "bf16", "fp32": "fp32"}

#: configurations predicted within this share of the first's step time are checked beside the
#: top K: the analytical model does not order configurations that close (on the simulated
#: devices of ``benchmarks/grid_prediction.py`` the measured best was predicted 3-6 % behind
#: the first, outside the top 3)
NEAR_TIE = 0.10


def to_check(ranked: Sequence[Prediction], k: int, within: float = NEAR_TIE) -> list[Prediction]:
    """The configurations ``axonn-jax plan --check K`` compiles: the first ``k`` of ``ranked``
    (best predicted first) and every later one predicted within ``within`` of the first's step
    time (the model's near ties), so the compiled programs or a trial decide between them.

    Example, ``ranked`` predicted 1.0, 1.04, 1.09 and 1.2 s::

        to_check(ranked, 2, within=0.1)   # the first three
    """
    if not ranked:
        return []
    limit = ranked[0].step_seconds * (1 + within)
    near = sum(1 for p in ranked if p.step_seconds <= limit)
    return list(ranked[: max(k, near)])


@dataclasses.dataclass(frozen=True)
class CompiledCheck:
    """One configuration's predicted and compiled bytes per device, the step time its
    compiled program implies and, after a trial run, the step time measured (``compiled``
    ``None``: not checked, ``note`` says why; ``time`` ``None``: not checked, or no machine
    to price it with; ``measured`` ``None``: no trial)."""

    prediction: Prediction
    limit: float  # bytes per device
    compiled: int | None = None
    note: str = ""
    time: ProgramTime | None = None
    measured: float | None = None  # seconds: the median step of the trial run

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
                "compiled_time": self.time and dataclasses.asdict(self.time),
                "measured_seconds": self.measured}  # fmt: skip


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
    trial_steps: int = 0,
) -> list[CompiledCheck]:
    """Compile each prediction's train step ahead of time: its bytes per device, (given the
    ``machine`` the predictions were priced for) the step time its program implies and (given
    ``trial_steps``) the step time measured on the devices.

    ``example_args``: the model's inputs for one whole step (arrays or
    ShapeDtypeStructs; the global batch the predictions were made for).
    ``optimizer``: the step's (default AdamW, two fp32 slots, as the model
    prices). ``devices``: the devices at hand (default ``jax.devices()``; ``partition``
    meshes the first ``grid.size`` of the process's); a configuration needing more is
    reported unchecked. ``trial_steps``: run each checked configuration that fits this many
    timed steps after one warm-up, in two passes (the configurations in order, then in
    reverse, each pass with fresh arguments, so a drift of the machine falls on both ends);
    its ``measured`` time is the lesser of its two medians (under MPI, the greatest of the
    processes' figures, so every process ranks alike). The trial needs one configuration's
    parameters, optimizer state and batch on the devices at a time.
    """
    if trial_steps < 0:
        raise ValueError(f"trial_steps must be >= 0 (timed steps per configuration), got {trial_steps}")
    devices = list(devices if devices is not None else jax.devices())
    optimizer = optimizer or optax.adamw(1e-3)
    out, trials = [], {}
    for i, pred in enumerate(predictions):
        size = pred.grid.size
        if size > len(devices):
            out.append(CompiledCheck(pred, limit_bytes, note=f"needs {size} devices, {len(devices)} here"))
            continue
        check, trial = _check_one(model, example_args, pred, limit_bytes, machine, loss_fn, optimizer)
        out.append(check)
        if trial is not None and check.fits:
            trials[i] = trial
    if trial_steps and trials:
        medians = {i: [] for i in trials}
        for order in (list(trials), list(reversed(trials))):
            for i in order:
                medians[i].append(trials[i].median_seconds(trial_steps))
        # every process must rank alike (else they would launch different configurations):
        # a step lasts as long as its slowest process
        every = host_comm().allgather({i: min(m) for i, m in medians.items()})
        seconds = {i: max(times[i] for times in every) for i in medians}
        out = [dataclasses.replace(c, measured=seconds[i]) if i in seconds else c for i, c in enumerate(out)]
    return out


def rerank(checks: Sequence[CompiledCheck]) -> list[CompiledCheck]:
    """The configurations that fit, the checked ones reordered by their measured step time
    (a trial ran) or else their compiled step time, among the places they hold; the others
    (unchecked, not priced, not timed) keep their places.

    The analytical model ranks every configuration; the compiled program of each checked
    one says more about it (every kernel and collective XLA kept), and a trial on the
    devices more still, so they order them.
    """
    kept = [c for c in checks if c.fits]
    timed = any(c.measured is not None for c in kept)
    seconds = (lambda c: c.measured) if timed else (lambda c: c.time and c.time.total)  # noqa: E731
    places = [i for i, c in enumerate(kept) if seconds(c) is not None]
    for i, c in zip(places, sorted((kept[i] for i in places), key=seconds)):
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


@dataclasses.dataclass(frozen=True)
class _Trial:
    """What a trial run of one checked configuration needs: its compiled step and a maker of
    fresh arguments (parameters, optimizer state, batch) for it."""

    compiled: Any
    make_args: Callable[[], tuple]

    def median_seconds(self, steps: int) -> float:
        """The median of ``steps`` timed steps after one warm-up (the arguments are made anew
        and dropped after)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # as when the check made them
            params, opt_state, batch = self.make_args()
        params, opt_state, loss = self.compiled(params, opt_state, batch, None)
        jax.block_until_ready(loss)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            params, opt_state, loss = self.compiled(params, opt_state, batch, None)
            jax.block_until_ready((params, opt_state, loss))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def synthetic_batch(example_args: Sequence, sharding, *, seed: int = 0):
    """The step's batch for a trial: ``example_args``' arrays, or for a ShapeDtypeStruct
    standard-normal floats and zeros of other dtypes (token ids, masks), put on ``sharding``.

    Example:
        >>> [x] = synthetic_batch([jax.ShapeDtypeStruct((2, 3), jnp.int32)], jax.devices()[0])
        >>> x.shape, int(x.sum())
        ((2, 3), 0)
    """
    rng = np.random.default_rng(seed)
    out = []
    for x in example_args:
        if isinstance(x, jax.ShapeDtypeStruct):
            dtype = np.dtype(x.dtype)
            floating = jnp.issubdtype(dtype, jnp.floating)
            x = rng.standard_normal(x.shape).astype(dtype) if floating else np.zeros(x.shape, dtype)
        out.append(jax.device_put(x, sharding))
    return out


def _check_one(model, example_args, pred: Prediction, limit: float, machine: Machine | None, loss_fn,
               optimizer) -> tuple[CompiledCheck, _Trial | None]:  # fmt: skip
    """Compiled bytes per device (arguments + temporaries + outputs not aliased to arguments)
    and, with a ``machine``, the program's step time on it; and what a trial run of it needs
    (``None``: it is not one program)."""
    options = pred.options
    pm = partition(model, pred.grid, *example_args)
    step = pm.train_step(loss_fn, optimizer, precision=RUNTIME_PRECISION[options.precision],
                         offload=options.offload, update_on=options.update_on, bucket_bytes=options.bucket_bytes,
                         microbatches=options.microbatches, remat="full" if options.recompute else None)  # fmt: skip
    if not step.one_program:
        return CompiledCheck(pred, limit, note="pipelined: one program per stage and task"), None
    sharding = NamedSharding(pm.mesh, P(BATCH_AXES))
    one = (lambda xs: xs[0] if len(xs) == 1 else tuple(xs))  # noqa: E731  the step's batch argument
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unusable donations, offload placement notes
        params, opt_state = step.init(pm.init(jax.random.key(0)))
        batch = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in example_args]
        compiled = step.lower(params, opt_state, one(batch)).compile()
    del params, opt_state
    b = compiled_bytes(compiled)
    priced = program_cost(compiled, pred.grid.size).time(machine) if machine is not None else None
    check = CompiledCheck(pred, limit, compiled=b["arguments"].device + b["temp"].device + b["outputs"].device
                          - min(b["aliased"].device, b["outputs"].device), time=priced)  # fmt: skip
    return check, _Trial(compiled, lambda: (*step.init(pm.init(jax.random.key(0))),
                                            one(synthetic_batch(example_args, sharding))))  # fmt: skip


def format_checks(checks: Sequence[CompiledCheck]) -> str:
    """A table in the planner's order: predicted, compiled and measured (a trial ran) step
    ms, the place :func:`rerank` gives it, predicted and compiled MiB per device, their
    ratio, kept or dropped."""
    rows = [("rank", "grid", "predicted ms", "compiled ms", "measured ms", "reranked", "predicted MiB",
             "compiled MiB", "compiled/predicted MiB", "verdict")]  # fmt: skip
    place = {id(c): i for i, c in enumerate(rerank(checks), 1)}
    for i, c in enumerate(checks, 1):
        g = c.prediction.grid
        grid = f"{g.x}×{g.y}×{g.z} data={g.data} pipe={g.pipeline}" + (f"×{g.virtual}" if g.virtual > 1 else "")
        times = (f"{c.prediction.step_seconds * 1e3:.4g}", f"{c.time.total * 1e3:.4g}" if c.time else "-",
                 f"{c.measured * 1e3:.4g}" if c.measured is not None else "-",
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

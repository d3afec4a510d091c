"""Configuration search: grid × virtual stages × recompute × schedule × offload × microbatches. Pure.

For each grid (x, y, z, data, pipeline) whose product is N: reject it if it
does not divide the model's dims (the partitioner would replicate part of a
layer); otherwise price every choice of

* virtual (interleaved) stages per pipeline rank — 1, and every ``v`` whose
  ``pipeline·v`` stages split the model's blocks evenly (1 without a pipeline);
* recompute (activation checkpointing of every block) on and off;
* the pipeline schedule — only where it changes the price: with a pipeline,
  those of ``schedules`` (:data:`PRICED_SCHEDULES` are the ones the model
  prices differently; 1F1B and GPipe are priced like ``"message"``);
* optimizer offload to host memory off, and on with the update on the host or
  streamed through the device in buckets (``update_on``);
* the number of microbatches (a divisor of the per-replica batch),

keep the choices that fit device (and host) memory, and take the one with the
least predicted step time (:func:`axonn_jax.perf.step.predict`) as the grid's
configuration. Grids are ranked by that time. Nothing here touches a device:
the compiled memory and step time of the top configurations are checked by
:func:`axonn_jax.compiled_check.check_compiled` (opt in).

Example:
    >>> from axonn_jax.perf.machines import get
    >>> from axonn_jax.perf.spec import gpt_spec
    >>> spec = gpt_spec(layers=24, hidden=4096, heads=32, seq=2048, batch=512, vocab=51200)
    >>> result = search(spec, 64, get("perlmutter"), top=3)
    >>> [p.grid.size for p in result.ranked]
    [64, 64, 64]
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from axonn_jax.partitioner.grid import PLACEMENTS, Grid
from axonn_jax.perf.machines import Machine
from axonn_jax.perf.memory import held_microbatches, memory
from axonn_jax.perf.options import SCHEDULES, UPDATE_ON, Options
from axonn_jax.perf.spec import ModelSpec
from axonn_jax.perf.step import Prediction, predict

if TYPE_CHECKING:
    from axonn_jax.perf.traced import PerGridSpec

OFFLOAD_CHOICES = ("auto", "on", "off")
RECOMPUTE_CHOICES = OFFLOAD_CHOICES
#: the schedules whose prices differ (:func:`~axonn_jax.perf.options.fill_and_drain`,
#: :func:`~axonn_jax.perf.memory.in_flight`): what ``--schedule auto`` searches
PRICED_SCHEDULES = ("message", "zb", "zb-h1")
_ON_OFF = {"auto": (False, True), "on": (True,), "off": (False,)}
UPDATE_ON_CHOICES = ("auto", *UPDATE_ON)


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The ``top`` predictions (one per grid, its best configuration), best first, and why the
    other grids were dropped."""

    ranked: tuple[Prediction, ...]
    considered: int  # grids whose product is the device count
    feasible: int  # grids that divide the model and fit memory
    rejected: dict[str, int]  # reason -> number of grids
    configurations: int = 0  # (grid, virtual, recompute, schedule, offload, microbatches) priced

    def summary(self) -> str:
        dropped = ", ".join(f"{n} {why}" for why, n in self.rejected.items()) or "none dropped"
        return (f"{self.considered} grids considered, {self.feasible} feasible ({dropped}), "
                f"{self.configurations:,} configurations priced")  # fmt: skip


def grids(devices: int, *, pipeline: bool = True) -> Iterator[Grid]:
    """Every ``Grid`` with x·y·z·data·pipeline = ``devices`` (pipeline = 1 unless ``pipeline``)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    divisors = _divisors(devices)
    for p in divisors if pipeline else [1]:
        for data in divisors:
            if (devices // p) % data:
                continue
            rest = devices // (p * data)
            for z in (d for d in divisors if rest % d == 0):
                for y in (d for d in divisors if (rest // z) % d == 0):
                    yield Grid(x=rest // (z * y), y=y, z=z, data=data, pipeline=p)


def search(
    source: ModelSpec | PerGridSpec,
    devices: int,
    machine: Machine,
    *,
    options: Options = Options(),
    top: int = 10,
    offload: str = "auto",
    update_on: str = "auto",
    pipeline: bool = True,
    microbatches: int | None = None,
    virtual: int | None = None,
    recompute: str = "auto",
    schedules: Sequence[str] | None = None,
    placement: str = "interleaved",
) -> SearchResult:
    """Rank the grids of ``devices`` devices for a model on ``machine`` (module docstring).

    Args:
        source: the model's spec, or a traced model's spec per grid (its
            :meth:`~axonn_jax.perf.traced.PerGridSpec.for_grid`: the partitioner's
            fallbacks on each grid priced).
        options: precision, bucket size and program form (``scatter_batch``);
            its schedule is the one priced unless ``schedules`` is given. Its
            recompute, offload, update_on and microbatches are replaced by the search's.
        offload, recompute: ``"auto"`` tries both, ``"on"``/``"off"`` forces it.
        update_on: where an offloaded update runs, ``"host"`` or ``"device"``
            (streamed in buckets of ``options.bucket_bytes``); ``"auto"`` tries both.
        pipeline: also search pipeline sizes > 1.
        microbatches: fix the number of microbatches instead of searching it.
        virtual: fix the stages per pipeline rank (grids with a pipeline) instead
            of searching them.
        schedules: the pipeline schedules to try (e.g. :data:`PRICED_SCHEDULES`).
        placement: of the virtual stages, ``"interleaved"`` or ``"v"`` (V-shaped:
            only ``virtual=2`` is tried on grids with a pipeline).
    """
    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"offload must be one of {OFFLOAD_CHOICES}, got {offload!r}")
    if update_on not in UPDATE_ON_CHOICES:
        raise ValueError(f"update_on must be one of {UPDATE_ON_CHOICES}, got {update_on!r}")
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, got {recompute!r}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if virtual is not None and (isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1):
        raise ValueError(f"virtual must be a positive int (stages per pipeline rank), got {virtual!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if placement == "v" and virtual not in (None, 2):
        raise ValueError(f"placement='v' needs virtual=2 (two stages per rank), got virtual={virtual}")
    schedules = tuple(schedules) if schedules else (options.schedule,)
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"schedules {unknown} are unknown; choose from {SCHEDULES}")
    offloads: list[str | None] = []  # None: no offload; else where the offloaded update runs
    if False in _ON_OFF[offload]:
        offloads.append(None)
    if True in _ON_OFF[offload]:
        offloads += [w for w in UPDATE_ON if update_on in ("auto", w)]
    limits = _Limits(machine.memory_gib * 2**30, machine.host_memory_gib * 2**30)
    rejected: collections.Counter = collections.Counter()
    best: list[Prediction] = []
    considered = priced = 0
    for grid in grids(devices, pipeline=pipeline):
        considered += 1
        try:
            spec = source.for_grid(grid)
        except ValueError:  # the partitioner cannot plan the model on this grid
            rejected["refused by the partitioner"] += 1
            continue
        if spec.problems(grid):
            rejected["do not divide the model"] += 1
            continue
        per_replica = spec.batch // grid.batch_shards
        if microbatches and per_replica % microbatches:
            rejected["do not divide the batch into microbatches"] += 1
            continue
        counts = [microbatches] if microbatches else _divisors(per_replica)
        virtuals = _virtuals(spec, grid, 2 if placement == "v" else virtual)
        if not virtuals:
            rejected["do not divide the model"] += 1
            continue
        found = None
        for v, rec, schedule, where in itertools.product(
                virtuals, _ON_OFF[recompute],
                schedules if grid.pipeline > 1 else schedules[:1], offloads):  # fmt: skip
            g = dataclasses.replace(grid, virtual=v, placement=placement if v == 2 else "interleaved")
            if schedule == "zb-v" and g.stages > 1 and g.placement != "v":
                continue  # ZB-V's order is the V's
            base = dataclasses.replace(options, recompute=rec, schedule=schedule, offload=where is not None,
                                       update_on=where or options.update_on)  # fmt: skip
            pred = _best_microbatches(spec, g, machine, base, counts, limits)
            priced += len(counts)
            if pred is not None and (found is None or pred.step_seconds < found.step_seconds):
                found = pred
        if found is None:
            rejected["do not fit memory"] += 1
            continue
        best.append(found)
    best.sort(key=lambda p: p.step_seconds)
    return SearchResult(tuple(best[:top]), considered, len(best), dict(rejected), priced)


@dataclasses.dataclass(frozen=True)
class _Limits:
    device: float  # bytes per device
    host: float  # bytes of host memory per device


def _best_microbatches(spec: ModelSpec, grid: Grid, machine: Machine, options: Options,
                       counts: list[int], limits: _Limits) -> Prediction | None:
    """The fastest of ``counts`` microbatches that fits (``None``: none fits).

    Only activations depend on the microbatches: memory is priced once, with one
    microbatch, and scaled by the microbatches held (:func:`~axonn_jax.perf.memory.held_microbatches`).
    Time: :meth:`~Prediction.step_seconds_with` extrapolates exactly from one
    priced count to the others while the program's collectives keep their
    kinds; they change where a microbatch's rows stop dividing over x or y
    (layer outputs are then all-reduced rather than reduce-scattered onto the
    batch), so one count of each such class is priced in full.
    """
    base = memory(spec, grid, dataclasses.replace(options, microbatches=1))
    if base.host > limits.host:
        return None
    per_microbatch = base.activations / held_microbatches(spec, grid, options, 1)
    fixed = base.device - base.activations
    fitting = [mb for mb in counts
               if fixed + per_microbatch * held_microbatches(spec, grid, options, mb) / mb <= limits.device]
    if not fitting:
        return None
    rows = spec.batch // grid.batch_shards

    def kind(mb: int) -> tuple[bool, ...]:  # which tensor axes a microbatch's rows divide over
        return tuple((rows // mb) % grid.axis_size(a) == 0 for a in ("x", "y"))

    priced: dict[tuple[bool, ...], Prediction] = {}
    for mb in fitting:
        if kind(mb) not in priced:
            priced[kind(mb)] = predict(spec, grid, machine, dataclasses.replace(options, microbatches=mb))
    mb = min(fitting, key=lambda m: priced[kind(m)].step_seconds_with(m))
    if priced[kind(mb)].options.microbatches == mb:
        return priced[kind(mb)]
    return predict(spec, grid, machine, dataclasses.replace(options, microbatches=mb))


def _virtuals(spec: ModelSpec, grid: Grid, fixed: int | None) -> list[int]:
    """Stages per pipeline rank to try on ``grid`` (1 without a pipeline): ``fixed`` if its
    stages do not exceed the model's blocks, else 1 and every ``v`` > 1 whose
    pipeline·v stages split the blocks evenly (the model prices balanced stages)."""
    p, layers = grid.pipeline, spec.layers
    if p == 1:
        return [1]
    if fixed is not None:
        return [fixed] if p * fixed <= layers else []
    return [1] + [v for v in range(2, layers // p + 1) if layers % (p * v) == 0]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))

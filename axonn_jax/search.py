"""Grid search: every (x, y, z, data, pipeline) for N devices, filtered and ranked. Pure.

For each grid whose product is N: reject it if it does not divide the
model's dims (the partitioner would replicate part of a layer), then pick
the number of microbatches (a divisor of the per-replica batch) and whether
to offload the optimizer so that the step fits device (and host) memory in
the least predicted time, and rank the survivors by predicted step time
(:func:`axonn_jax.perf.step.predict`).

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
from collections.abc import Iterator

from axonn_jax.partitioner.grid import Grid
from axonn_jax.perf.machines import Machine
from axonn_jax.perf.memory import in_flight, memory
from axonn_jax.perf.options import Options
from axonn_jax.perf.spec import ModelSpec
from axonn_jax.perf.step import Prediction, predict

OFFLOAD_CHOICES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The ``top`` predictions, best first, and why the other grids were dropped."""

    ranked: tuple[Prediction, ...]
    considered: int  # grids whose product is the device count
    feasible: int  # grids that divide the model and fit memory
    rejected: dict[str, int]  # reason -> number of grids

    def summary(self) -> str:
        dropped = ", ".join(f"{n} {why}" for why, n in self.rejected.items()) or "none dropped"
        return f"{self.considered} grids considered, {self.feasible} feasible ({dropped})"


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
    spec: ModelSpec,
    devices: int,
    machine: Machine,
    *,
    options: Options = Options(),
    top: int = 10,
    offload: str = "auto",
    pipeline: bool = True,
    microbatches: int | None = None,
    virtual: int = 1,
    placement: str = "interleaved",
) -> SearchResult:
    """Rank the grids of ``devices`` devices for ``spec`` on ``machine`` (module docstring).

    Args:
        options: precision and recompute (its offload and microbatches are searched).
        offload: ``"auto"`` tries both, ``"on"``/``"off"`` forces it.
        pipeline: also search pipeline sizes > 1.
        microbatches: fix the number of microbatches instead of searching it.
        virtual: stages per pipeline rank (interleaved) for the grids with a pipeline.
        placement: of those stages, ``"interleaved"`` or ``"v"`` (V-shaped, ``virtual=2``).
    """
    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"offload must be one of {OFFLOAD_CHOICES}, got {offload!r}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    offloads = {"auto": (False, True), "on": (True,), "off": (False,)}[offload]
    device_bytes = machine.memory_gib * 2**30
    host_bytes = machine.host_memory_gib * 2**30
    rejected: collections.Counter = collections.Counter()
    best: list[Prediction] = []
    considered = 0
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual must be a positive int (stages per pipeline rank), got {virtual!r}")
    for grid in grids(devices, pipeline=pipeline):
        if grid.pipeline > 1 and virtual > 1:
            grid = dataclasses.replace(grid, virtual=virtual, placement=placement)
        considered += 1
        if spec.problems(grid):
            rejected["do not divide the model"] += 1
            continue
        per_replica = spec.batch // grid.batch_shards
        counts = [microbatches] if microbatches else _divisors(per_replica)
        if microbatches and per_replica % microbatches:
            rejected["do not divide the batch into microbatches"] += 1
            continue
        found = None
        for off in offloads:
            # only activations depend on the microbatches: price memory once per choice
            base = memory(spec, grid, dataclasses.replace(options, offload=off, microbatches=1))
            if base.host > host_bytes:
                continue
            fixed = base.device - base.activations
            fitting = [
                mb for mb in counts
                if fixed + base.activations * in_flight(mb, grid.pipeline, grid.virtual,
                                                                 placement=grid.placement) / mb <= device_bytes
            ]  # fmt: skip
            if not fitting:
                continue
            first = predict(spec, grid, machine,
                            dataclasses.replace(options, offload=off, microbatches=fitting[0]))  # fmt: skip
            mb = min(fitting, key=first.step_seconds_with)
            pred = first if mb == fitting[0] else predict(
                spec, grid, machine, dataclasses.replace(options, offload=off, microbatches=mb))
            if found is None or pred.step_seconds < found.step_seconds:
                found = pred
        if found is None:
            rejected["do not fit memory"] += 1
            continue
        best.append(found)
    best.sort(key=lambda p: p.step_seconds)
    return SearchResult(tuple(best[:top]), considered, len(best), dict(rejected))




def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))

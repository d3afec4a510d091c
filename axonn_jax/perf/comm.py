"""What this framework's kernels send in one training step, per device. Pure and analytical.

:func:`collectives` lists, for a :class:`~axonn_jax.perf.spec.ModelSpec` on a
grid, every collective one device of the slowest pipeline stage takes part in,
with ring wire elements (all-gather (g−1)/g·R, reduce-scatter (g−1)/g·R_full,
all-reduce 2(g−1)/g·R, send R) and the number of calls. Counted:

==========================  ===========  ===========  ==========================
what                        collective   axes         when
==========================  ===========  ===========  ==========================
weight gather               all-gather   z            forward, per microbatch
weight re-gather            all-gather   z            backward, under recompute
weight-gradient scatter     reduce-scat  z            backward, per microbatch
layer output                all-reduce   in axis      forward (twice under
                                                      recompute)
input gradient              all-reduce   out axis     backward
norm statistics             all-reduce   y            forward (×2 recompute), bwd
embedding lookup            all-reduce   x            forward (vocabulary-parallel rows)
output gather               all-gather   x            forward (vocabulary-parallel logits)
weight-gradient shard       all-reduce   data         once per step
other parameter gradients   all-reduce   data·z       once per step
stage activations           send         pipeline     fwd + bwd, per microbatch
==========================  ===========  ===========  ==========================

Without recompute the compiled program keeps the gathered weights for the
backward pass (checked in ``tests/test_perf_model.py`` against the compiled
HLO), so there is no re-gather. Not counted: scalar reductions (the loss),
and anything a replicated fallback moves.

Example:
    >>> from axonn_jax import Grid
    >>> from axonn_jax.perf.spec import gpt_spec
    >>> spec = gpt_spec(layers=2, hidden=64, heads=4, seq=32, batch=8, vocab=256)
    >>> cs = collectives(spec, Grid(z=2, data=4), recompute=False)
    >>> sorted({c.kind for c in cs})
    ['all-gather', 'all-reduce', 'reduce-scatter']
"""

from __future__ import annotations

import dataclasses

from axonn_jax.partitioner.grid import DATA, PIPELINE, X, Y, Z, Grid
from axonn_jax.partitioner.report import ring_wire_bytes
from axonn_jax.perf.spec import ModelSpec

#: Axis nesting, innermost first (the 4D algorithm's hierarchy); groups of later axes contain earlier ones.
NESTING = ("x", "y", "z", "data", "pipeline")


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """Collectives of one kind, on one group, for one purpose, summed over a step.

    ``inner``/``size``: product of the axes nested inside the group, and the
    group's size (what eq. 7 needs). ``per_microbatch``: issued once per
    microbatch (else once per step); ``repeats``: its bytes repeat per
    microbatch too (weight gathers and scatters), instead of being split
    between the microbatches (activations).
    """

    what: str
    kind: str  # "all-gather" | "reduce-scatter" | "all-reduce" | "send"
    axes: tuple[str, ...]
    phase: str
    elements: float  # ring wire elements one device sends, all calls together
    calls: float
    inner: int
    size: int
    per_microbatch: bool = True
    repeats: bool = False

    def group(self, grid: Grid | None = None) -> tuple[int, int]:
        """``(inner, size)`` of the group (``grid`` is accepted for symmetry; unused)."""
        del grid
        return self.inner, self.size


def group_of(axes: tuple[str, ...], grid: Grid) -> tuple[int, int]:
    """``(inner, size)`` of a collective over ``axes``: pipeline sends go to the next stage."""
    if axes == (PIPELINE,):
        return grid.stage_size, 2
    innermost = min(NESTING.index(a) for a in axes)
    inner = 1
    for a in NESTING[:innermost]:
        inner *= grid.axis_size(a)
    size = 1
    for a in axes:
        size *= grid.axis_size(a)
    return inner, size


def _ring(kind: str, g: int) -> float:
    """Wire elements per element of the full (gathered / reduced) buffer (the one ring formula)."""
    return ring_wire_bytes(kind, g, 1.0 / g if kind == "reduce-scatter" else 1.0)


def collectives(
    spec: ModelSpec, grid: Grid, *, recompute: bool, microbatches: int = 1
) -> tuple[CollectiveCost, ...]:
    """Every collective of one training step on one device of the slowest stage.

    The pipeline's stages are assumed balanced: each holds ``1/pipeline`` of
    the blocks; parameters and matmuls outside the blocks (embeddings, the
    head) are charged in full, as the first and last stage hold them. ``microbatches`` splits the batch (gradient
    accumulation, or the pipeline's microbatches): weight gathers and
    scatters repeat per microbatch, gradient all-reduces run once per step.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    acc: dict[tuple, list[float]] = {}
    share = 1.0 / grid.pipeline
    mb = microbatches
    rows = spec.tokens / grid.batch_shards  # rows of the activations on one device

    def add(what, kind, axes, phase, elements, calls, per_mb=True, repeats=False):
        if elements > 0:
            entry = acc.setdefault((what, kind, axes, phase, per_mb, repeats), [0.0, 0.0])
            entry[0] += elements
            entry[1] += calls

    for p in spec.params:
        copies = p.count * (share if p.per_block else 1.0)
        if p.depth and grid.z > 1:
            full = p.use_elements(grid)
            wire = _ring("all-gather", grid.z) * full * copies * mb
            calls = copies * mb
            add("weight gather", "all-gather", (Z,), "forward", wire, calls, repeats=True)
            if recompute and p.per_block:
                add("weight re-gather", "all-gather", (Z,), "backward", wire, calls, repeats=True)
            add("weight-gradient scatter", "reduce-scatter", (Z,), "backward", wire, calls,
                repeats=True)  # fmt: skip
            add("weight-gradient shard", "all-reduce", (DATA,), "step",
                _ring("all-reduce", grid.data) * full / grid.z * copies, copies, False)  # fmt: skip
        else:
            g = grid.batch_shards
            add("other parameter gradients", "all-reduce", (DATA, Z), "step",
                _ring("all-reduce", g) * p.local_elements(grid) * copies, copies, False)  # fmt: skip

    for m in spec.matmuls:
        copies = m.count * (share if m.recomputed else 1.0)  # recomputed: inside a block
        g_in = grid.axis_size(m.in_axis) if m.in_axis else 1
        g_out = grid.axis_size(m.out_axis) if m.out_axis else 1
        again = 2 if recompute and m.recomputed else 1
        calls = copies / m.fused * mb
        if m.in_axis:
            add("layer output", "all-reduce", (m.in_axis,), "forward",
                _ring("all-reduce", g_in) * rows * m.n / g_out * copies * again,
                calls * again)  # fmt: skip
        if m.out_axis:
            add("input gradient", "all-reduce", (m.out_axis,), "backward",
                _ring("all-reduce", g_out) * rows * m.k / g_in * copies, calls)  # fmt: skip

    if spec.lookups:  # vocabulary-parallel rows: each device's partial rows summed over x
        add("embedding lookup", "all-reduce", (X,), "forward",
            _ring("all-reduce", grid.x) * rows * spec.hidden / grid.y * spec.lookups, spec.lookups * mb)
    if spec.split_outputs:
        add("output gather", "all-gather", (X,), "forward",
            _ring("all-gather", grid.x) * rows * spec.split_outputs, mb)
    if spec.norms:
        norms = spec.norms * share
        wire = _ring("all-reduce", grid.y) * rows * spec.norm_stats * norms
        again = 2 if recompute else 1
        add("norm statistics", "all-reduce", (Y,), "forward", wire * again, norms * mb * again)
        add("norm statistics", "all-reduce", (Y,), "backward", wire, norms * mb)

    if grid.pipeline > 1:  # with virtual stages a microbatch crosses each rank boundary v times
        message = rows * spec.hidden / grid.y * grid.virtual
        add("stage activations", "send", (PIPELINE,), "forward", message, mb * grid.virtual)
        add("stage gradients", "send", (PIPELINE,), "backward", message, mb * grid.virtual)
    groups = {axes: group_of(axes, grid) for (_, _, axes, *_rest) in acc}
    # gradients are all-reduced in buckets: one call per group and step (XLA combines them too)
    return tuple(
        CollectiveCost(what, kind, axes, phase, elements, calls if per_mb else 1.0,
                   *groups[axes], per_microbatch=per_mb, repeats=repeats)  # fmt: skip
        for (what, kind, axes, phase, per_mb, repeats), (elements, calls) in acc.items()
        if groups[axes][1] > 1
    )


def elements_by(cs, key: str = "kind") -> dict[str, float]:
    """Total wire elements grouped by ``kind``, ``what``, ``phase`` or ``axes``."""
    out: dict[str, float] = {}
    for c in cs:
        k = getattr(c, key)
        k = "+".join(k) if isinstance(k, tuple) else k
        out[k] = out.get(k, 0.0) + c.elements
    return out

"""What this framework's kernels send in one training step, per device. Pure and analytical.

:func:`collectives` lists, for a :class:`~axonn_jax.perf.spec.ModelSpec` on a
grid, every collective one device of the slowest pipeline stage takes part in,
with ring wire elements (all-gather (g−1)/g·R, reduce-scatter (g−1)/g·R_full,
all-reduce 2(g−1)/g·R, send R) and the number of calls. It describes the
program ``partition`` builds: by default (``scatter_batch=True``) each
layer's partial sums are reduce-scattered onto the batch dim and the next
layer all-gathers them back; with ``scatter_batch=False`` they are
all-reduced (the paper's form, eqs. 1–5). Counted:

==================================  ===========  ===========  =======================
what                                collective   axes         when
==================================  ===========  ===========  =======================
weight gather                       all-gather   z            forward, per microbatch
                                                              (one per layer: q/k/v together)
weight re-gather                    all-gather   z            backward, under recompute
whole-read weight gather            all-gather   its axis     forward, per microbatch (a
                                                              kernel stored split, read
                                                              whole: ``Param.read_whole``)
whole-read weight gradient          all-reduce   its axis     backward (a kernel gathered,
                                                              then sliced on another dim:
                                                              ``Param.read_whole_grad``)
whole-read weight gradient          reduce-scat  its axis     backward (a weight gathered to
                                                              meet rows split over its axis:
                                                              ``Param.read_whole_rows``)
whole-parameter gradient            all-reduce   its axes     backward (a whole parameter
                                                              meeting features split over
                                                              them: ``Param.grad_summed_over``)
weight-gradient scatter             reduce-scat  z            backward, per microbatch
layer output (all-reduce form)      all-reduce   in axis      forward (×2 recompute)
layer output (default)              reduce-scat  in axis      forward (×2 recompute;
                                                              q/k/v stacked in one)
layer output gradient (default)     all-gather   in axis      backward (its transpose; none of
                                                              the three for a layer whose
                                                              weight is gathered whole:
                                                              ``MatMul.weight_gathered``)
layer input (default)               all-gather   out axis     forward (×2 recompute),
                                                              unless the input is whole
input gradient                      all-reduce   out axis     backward (default: whole
                                                              inputs only; none for the
                                                              model's data: input_grad)
input gradient (default)            reduce-scat  out axis     backward: the gathered
                                                              input's transpose (OAR)
sliced output gradient              all-reduce   in axis      backward (a convolution's
                                                              whole output, or what was
                                                              computed from it while whole,
                                                              sliced over its in axis:
                                                              ``sliced_output``)
norm statistics                     all-reduce   its axis (y) forward (×2 recompute), bwd
                                                              (a weight norm's: the same rows
                                                              every microbatch, ``fixed_rows``)
batch statistics                    all-reduce   the batch    forward (×2 recompute), bwd
                                                 axes         (BatchNorm: ``BatchStatistics``)
embedding lookup                    all-reduce   x            forward (vocabulary-parallel rows)
output gather                       all-gather   x (and y)    forward (vocabulary-parallel
                                                              logits; default: their batch;
                                                              output_axis: the split one)
loss reductions (loss_rows=)        all-reduce   x            forward (max; sums and label
                                                              logits; instead of the gather)
join gradient                       all-reduce   its feature  backward (a whole activation
                                                 axes, its    added to a split one: the
                                                 rows' axis   embeddings meeting the stream
                                                 (default)    scattered over x; ``Join``)
activation regather                 all-gather   its axis     forward (a split activation
                                                              gathered whole for a reshape
                                                              or split: ``Regather``)
activation regather gradient        all-reduce   its axis     backward (its gradient)
partial sums                        reduce-      its axes     forward (a scatter-add's output:
                                    scatter or                ``PartialSums``; all-reduced
                                    all-reduce                where not scattered)
partial sums gradient               all-gather   its axes     backward (of a scattered one)
                                    all-reduce   its axes     backward (an all-reduced one
                                                              sliced over them again:
                                                              ``PartialSums.sliced``)
weight-gradient shard               all-reduce   data         once per step
other parameter gradients           all-reduce   data·z       once per step
scattered-row parameter gradients   all-reduce   its rows'    once per step (biases, norm
  (default)                                      axis         parameters on scattered rows)
stage activations                   send         pipeline     fwd + bwd, per microbatch
==================================  ===========  ===========  =======================

A layer scatters over its input axis only when that axis divides the samples
of one device's microbatch (else the program all-reduces, as the model does).
``calls`` is what is issued (one per fused q/k/v input gradient and q/k/v
weight gather / gradient reduce-scatter, per norm, per gradient bucket); ``transfers`` counts the collectives as ``pm.report()``
lists them, one per value.

Without recompute the compiled program keeps the gathered weights for the
backward pass (checked in ``tests/test_perf_model.py`` against the compiled
HLO), so there is no re-gather. Not counted: scalar reductions (the loss),
and what the partitioner's replicated fallbacks (``plan.fallbacks``) move besides
the two above.

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
import math
from fractions import Fraction

from axonn_jax.partitioner.grid import DATA, PIPELINE, X, Y, Z, Grid
from axonn_jax.partitioner.report import ring_wire_bytes
from axonn_jax.perf.spec import ModelSpec, Param, split_axes, split_size

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
    #: collectives before any combining, as ``pm.report()`` lists them (one per value:
    #: each norm statistic, each gradient, each of q/k/v); ``calls`` is what is issued
    transfers: float = 0.0

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
    spec: ModelSpec, grid: Grid, *, recompute: bool, microbatches: int = 1, scatter_batch: bool = True,
    loss_rows: int = 0,
) -> tuple[CollectiveCost, ...]:
    """Every collective of one training step on one device of the slowest stage.

    The pipeline's stages are assumed balanced: each holds ``1/pipeline`` of
    the blocks; parameters and matmuls outside the blocks (embeddings, the
    head) are charged in full, as the first and last stage hold them. ``microbatches`` splits the batch (gradient
    accumulation, or the pipeline's microbatches): weight gathers and
    scatters repeat per microbatch, gradient all-reduces run once per step.
    ``scatter_batch``: the program's option (``partition(..., scatter_batch=)``):
    layer outputs reduce-scattered onto the batch (default) or all-reduced.
    ``loss_rows``: the rows a softmax cross-entropy planned with the model reads
    (``batch·(seq−1)`` for a next-token loss): its vocabulary-split logits are not
    gathered, and its max, exponential sums and label logits are all-reduced over
    x instead (0: the loss runs after the gathered outputs, the default).
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    step = _Step(spec, grid, recompute, microbatches, scatter_batch)
    step.loss_rows = loss_rows
    step.parameters()
    step.matmuls()
    step.model_edges()
    step.pipeline()
    return step.costs()


class _Step:
    """Accumulates the collectives of one step (see :func:`collectives`)."""

    def __init__(self, spec: ModelSpec, grid: Grid, recompute: bool, mb: int, scatter_batch: bool):
        self.spec, self.grid, self.recompute, self.mb = spec, grid, recompute, mb
        self.share = 1.0 / grid.pipeline
        self.rows = spec.tokens / grid.batch_shards  # rows of the activations on one device
        local_batch = spec.batch // (grid.batch_shards * mb)
        #: the tensor axes a layer's partial sums are reduce-scattered over (onto the batch)
        self.scattered = {a for a in (X, Y) if scatter_batch and grid.axis_size(a) > 1
                          and local_batch % grid.axis_size(a) == 0}  # fmt: skip
        self.acc: dict[tuple, list[float]] = {}
        self.loss_rows = 0  # rows of a loss planned with the model (collectives(loss_rows=))

    def add(self, what, kind, axes, phase, elements, calls, per_mb=True, repeats=False, transfers=None):
        if elements > 0:
            # calls start exact: a gather group's calls, shared out among its weights, add up whole
            key = (what, kind, axes, phase, per_mb, repeats)
            entry = self.acc.setdefault(key, [0.0, Fraction(0), Fraction(0)])
            entry[0] += elements
            entry[1] += calls
            entry[2] += calls if transfers is None else transfers

    def parameters(self) -> None:
        """Weight gathers and scatters over z, gradient all-reduces over data (and z), and the
        gathers of kernels stored split but read whole."""
        grid, mb = self.grid, self.mb
        for p in self.spec.params:
            copies = p.count * (self.share if p.per_block else 1.0)
            g = p.read_whole_split(grid)
            if g > 1:
                wire = _ring("all-gather", g) * p.use_elements(grid) * g * copies * mb
                calls = Fraction(p.count * mb) / (grid.pipeline if p.per_block else 1)
                for phase in ("forward", "backward") if self.recompute and p.per_block else ("forward",):
                    self.add("whole-read weight gather", "all-gather", (p.read_whole,), phase, wire, calls,
                             repeats=True)  # fmt: skip
                if p.read_whole_grad:  # each device's slice of the whole gradient, summed
                    self.add("whole-read weight gradient", "all-reduce", (p.read_whole,), "backward",
                             _ring("all-reduce", g) * p.use_elements(grid) * g * copies * mb, calls,
                             repeats=True)  # fmt: skip
                if p.read_whole_rows and p.read_whole in self.scattered:  # of each device's rows
                    self.add("whole-read weight gradient", "reduce-scatter", (p.read_whole,), "backward",
                             _ring("reduce-scatter", g) * p.use_elements(grid) * g * copies * mb, calls,
                             repeats=True)  # fmt: skip
            if p.grad_summed_over:  # met features split over them: partial sums, before any z scatter
                self.add("whole-parameter gradient", "all-reduce", p.grad_summed_over, "backward",
                         _ring("all-reduce", split_size(p.grad_summed_over, grid)) * p.use_elements(grid)
                         * copies * mb, p.count * mb)  # fmt: skip
            if p.depth and grid.z > 1:
                full = p.use_elements(grid)
                wire = _ring("all-gather", grid.z) * full * copies * mb
                # the weights of a gather group (q/k/v, a block) share one gather: exact shares
                calls = Fraction(p.count * mb) / p.fused / (grid.pipeline if p.per_block else 1)
                self.add("weight gather", "all-gather", (Z,), "forward", wire, calls, repeats=True)
                if self.recompute and p.per_block:
                    self.add("weight re-gather", "all-gather", (Z,), "backward", wire, calls,
                             repeats=True)  # fmt: skip
                shared = self._bucket_share(p)  # a bucket of blocks: one reduce-scatter
                self.add("weight-gradient scatter", "reduce-scatter", (Z,), "backward", wire,
                         calls * shared, repeats=True)  # fmt: skip
                self.add("weight-gradient shard", "all-reduce", (DATA,), "step",
                         _ring("all-reduce", grid.data) * full / grid.z * copies,
                         copies / p.fused * shared, False)  # fmt: skip
                continue
            if not p.trainable:  # model state: no gradient
                continue
            local = p.local_elements(grid) * copies
            self.add("other parameter gradients", "all-reduce", (DATA, Z), "step",
                     _ring("all-reduce", grid.batch_shards) * local, copies, False)  # fmt: skip
            if p.scatter_axis in self.scattered:  # its rows were a 1/g share of the batch
                g = grid.axis_size(p.scatter_axis)
                self.add("scattered-row parameter gradients", "all-reduce", (p.scatter_axis,), "step",
                         _ring("all-reduce", g) * local, copies, False)  # fmt: skip

    def _bucket_share(self, p: Param) -> Fraction:
        """Weight-gradient reductions per gather group of ``p``: a pipeline stage's blocks
        reduce ``p.bucket`` at a time (``Overlap.bucket_blocks``), the last bucket maybe fewer."""
        blocks = max(1, self.spec.layers // self.grid.stages)
        return Fraction(1) if p.bucket <= 1 else Fraction(math.ceil(blocks / p.bucket), blocks)

    def matmuls(self) -> None:
        """Each layer's forward reduction and backward input-gradient all-reduce (§1), in the
        all-reduce form or the default reduce-scatter-onto-the-batch + all-gather form."""
        grid = self.grid
        for m in self.spec.matmuls:
            rows = self.rows * m.m / self.spec.tokens  # a convolution's positions, a pooler's rows
            copies = m.count * (self.share if m.recomputed else 1.0)  # recomputed: inside a block
            g_in = m.in_split(grid)
            g_out = grid.axis_size(m.out_axis) if m.out_axis else 1
            again = 2 if self.recompute and m.recomputed else 1
            calls = copies * self.mb
            output = rows * m.n / g_out  # the layer's partial sums on one device, whole batch
            if m.weight_gathered:  # its weight gathered whole over in_axis: whole products
                pass
            elif m.in_axis in self.scattered and m.scatters:
                # onto the batch, q/k/v stacked in one; the backward all-gathers the output
                # gradients (the transpose; runtime.param_reads.reduce_scatter_together)
                self.add("layer output", "reduce-scatter", (m.in_axis,), "forward",
                         _ring("reduce-scatter", g_in) * output * copies * again,
                         calls / m.fused * again)  # fmt: skip
                self.add("layer output gradient", "all-gather", (m.in_axis,), "backward",
                         _ring("all-gather", g_in) * output * copies, calls / m.fused)  # fmt: skip
            elif m.in_axis:
                self.add("layer output", "all-reduce", m.in_axes, "forward",
                         _ring("all-reduce", g_in) * output * copies * again,
                         calls / m.fused * again, transfers=calls * again)  # fmt: skip
                for s in m.sliced_output:  # computed from the whole output, sliced over the axis again
                    alike = sum(t.axis == s.axis for t in m.sliced_output)  # one all-reduce per axis
                    self.add("sliced output gradient", "all-reduce", (s.axis,), "backward",
                             _ring("all-reduce", grid.axis_size(s.axis)) * s.values(self.rows, self.mb, grid)
                             * copies, calls / alike)  # fmt: skip
            layer_input = rows * m.input_per_row / g_in
            whole = copies
            if m.out_axis in self.scattered and m.scatters:  # the input, scattered by an earlier layer, gathered
                gathered = (m.count - m.whole_inputs) * (self.share if m.recomputed else 1.0) / m.fused
                whole = m.whole_inputs * (self.share if m.recomputed else 1.0)
                self.add("layer input", "all-gather", (m.out_axis,), "forward",
                         _ring("all-gather", g_out) * layer_input * gathered * again,
                         gathered * self.mb * again)  # fmt: skip
                # its transpose: the input gradients of the copies reading it, summed, are
                # reduce-scattered back onto the batch (OAR, runtime.executor._partial_gathers)
                self.add("input gradient", "reduce-scatter", (m.out_axis,), "backward",
                         _ring("reduce-scatter", g_out) * layer_input * gathered, gathered * self.mb)  # fmt: skip
            if m.out_axis and m.input_grad:  # none for the model's data
                self.add("input gradient", "all-reduce", (m.out_axis,), "backward",
                         _ring("all-reduce", g_out) * layer_input * whole, whole * self.mb / m.fused,
                         transfers=whole * self.mb)  # fmt: skip

    def model_edges(self) -> None:
        """Lookups, the outputs' gathers, activations gathered whole, norm statistics and the
        stream's joins."""
        spec, grid, rows, mb = self.spec, self.grid, self.rows, self.mb
        if spec.lookups:  # vocabulary-parallel rows: each device's partial rows summed over x
            whole = spec.lookup_elements or spec.lookups * spec.tokens * spec.hidden
            looked_up = _ring("all-reduce", grid.x) * whole / grid.batch_shards / grid.y
            self.add("embedding lookup", "all-reduce", (X,), "forward", looked_up, spec.lookups * mb)
        if spec.fixed_lookup_elements:  # indexed by position: the same elements every microbatch
            fixed = _ring("all-reduce", grid.x) * spec.fixed_lookup_elements / grid.y * mb
            self.add("embedding lookup", "all-reduce", (X,), "forward", fixed, mb)
        split, batch = spec.output_axis, spec.output_batch_axis
        if spec.split_outputs and self.loss_rows:  # the loss planned with the model: reduced over x
            self._planned_loss()
        elif spec.split_outputs:  # the last layer's outputs: features split, batch scattered
            logits = rows * spec.split_outputs  # (the GPT's head: over x and y)
            if batch in self.scattered:
                self.add("output gather", "all-gather", (batch,), "forward",
                         _ring("all-gather", grid.axis_size(batch)) * logits / grid.axis_size(split), mb)  # fmt: skip
            self.add("output gather", "all-gather", (split,), "forward",
                     _ring("all-gather", grid.axis_size(split)) * logits, mb)  # fmt: skip
        for r in spec.regathers:  # a split activation gathered whole (a replicated fallback)
            if r.scattered_rows and r.axis not in self.scattered:
                continue  # rows not scattered on this grid: nothing to gather
            g = grid.axis_size(r.axis)
            split = math.prod(grid.axis_size(a) for a in r.split_over)
            split *= grid.axis_size(r.rows_axis) if r.rows_axis in self.scattered else 1
            whole = rows * r.per_token * r.count * math.prod(grid.axis_size(a) for a in r.whole_rows) / split
            self.add("activation regather", "all-gather", (r.axis,), "forward", _ring("all-gather", g) * whole, r.count * mb)
            if r.grad:
                grad = whole if r.grad_per_token is None else whole * r.grad_per_token / r.per_token
                self.add("activation regather gradient", "all-reduce", (r.axis,), "backward",
                         _ring("all-reduce", g) * grad, r.count * mb)  # fmt: skip
        for ps in spec.partial_sums:  # each device's share added into a whole output
            axes = ps.axes + ((ps.rows_axis,) if ps.rows_axis in self.scattered else ())
            g = math.prod(grid.axis_size(a) for a in axes)
            partial = spec.tokens * ps.per_token / math.prod(grid.axis_size(a) for a in ps.split_over)
            if not ps.scattered(axes, grid):
                self.add("partial sums", "all-reduce", axes, "forward", _ring("all-reduce", g) * partial, mb)
                for per_token, split in ps.sliced:  # sliced over those axes again: its gradient there
                    sliced = spec.tokens * per_token / math.prod(grid.axis_size(a) for a in split)
                    self.add("partial sums gradient", "all-reduce", axes, "backward",
                             _ring("all-reduce", g) * sliced, mb)  # fmt: skip
                continue
            self.add("partial sums", "reduce-scatter", axes, "forward", _ring("reduce-scatter", g) * partial, mb)
            if ps.grad:
                self.add("partial sums gradient", "all-gather", axes, "backward", _ring("all-gather", g) * partial, mb)
        for group in spec.norms:
            self._norms(group)
        for b in spec.batch_statistics:
            self._batch_statistics(b)
        for j in spec.joins:  # sliced over its rows, then its features: reduced in reverse
            whole = rows * j.per_token / math.prod(grid.axis_size(a) for a in j.split_over)
            r = j.rows_axis if j.rows_axis in self.scattered else None
            for f in (f for f in j.features if grid.axis_size(f) > 1):
                self.add("join gradient", "all-reduce", (f,), "backward",
                         _ring("all-reduce", grid.axis_size(f)) * whole / (grid.axis_size(r) if r else 1), mb)
            if r:
                self.add("join gradient", "all-reduce", (r,), "backward",
                         _ring("all-reduce", grid.axis_size(r)) * whole, mb)  # fmt: skip

    def _planned_loss(self) -> None:
        """Softmax cross-entropy over the x-split logits: the max (one all-reduce), then the
        exponential sums and the label's logit (one, combined), on the device's rows."""
        grid, split, batch = self.grid, self.spec.output_axis, self.spec.output_batch_axis
        rows = self.loss_rows / grid.batch_shards / (grid.axis_size(batch) if batch in self.scattered else 1)
        self.add("loss reductions", "all-reduce", (split,), "forward",
                 _ring("all-reduce", grid.axis_size(split)) * 3 * rows, 2 * self.mb, transfers=3 * self.mb)  # fmt: skip

    def _norms(self, group) -> None:
        """A :class:`~axonn_jax.perf.spec.NormGroup`'s statistics, forward and backward."""
        grid, axes = self.grid, split_axes(group.axis)  # one axis, or x and y
        norms = group.count * (self.share if group.rows_axis else 1)  # whole rows: the first stage
        scattered = group.rows_axis in self.scattered
        rows = (group.fixed_rows * self.mb if group.fixed_rows  # the same every microbatch
                else self.rows * group.rows_per_token / (grid.axis_size(group.rows_axis) if scattered else 1))
        wire = _ring("all-reduce", split_size(axes, grid)) * group.stats * norms * rows
        calls, stats = norms * self.mb, norms * self.mb * group.stats
        again = 2 if self.recompute else 1
        self.add("norm statistics", "all-reduce", axes, "forward", wire * again, calls * again,
                 transfers=stats * again)  # fmt: skip
        self.add("norm statistics", "all-reduce", axes, "backward", wire, calls, transfers=stats)

    def _batch_statistics(self, b) -> None:
        """A :class:`~axonn_jax.perf.spec.BatchStatistics`' all-reduces over the batch axes."""
        grid = self.grid
        g = math.prod(grid.axis_size(a) for a in b.axes)
        values = b.elements / math.prod(grid.axis_size(a) for a in b.split_over)
        wire = _ring("all-reduce", g) * values * b.stats * b.count * self.mb
        calls = b.stats * b.count * self.mb
        again = 2 if self.recompute else 1
        self.add("batch statistics", "all-reduce", b.axes, "forward", wire * again, calls * again)
        if b.grad:
            self.add("batch statistics", "all-reduce", b.axes, "backward", wire, calls)

    def pipeline(self) -> None:
        grid, mb = self.grid, self.mb
        if grid.pipeline > 1:  # with virtual stages a microbatch crosses each rank boundary v times
            message = self.rows * self.spec.hidden / grid.y * grid.virtual
            self.add("stage activations", "send", (PIPELINE,), "forward", message, mb * grid.virtual)
            self.add("stage gradients", "send", (PIPELINE,), "backward", message, mb * grid.virtual)

    def costs(self) -> tuple[CollectiveCost, ...]:
        groups = {axes: group_of(axes, self.grid) for (_, _, axes, *_rest) in self.acc}
        # gradients are all-reduced in buckets: one call per group and step (XLA combines them too)
        return tuple(
            CollectiveCost(what, kind, axes, phase, elements, float(calls) if per_mb else 1.0,
                           *groups[axes], per_microbatch=per_mb, repeats=repeats,
                           transfers=float(transfers))  # fmt: skip
            for (what, kind, axes, phase, per_mb, repeats), (elements, calls, transfers) in self.acc.items()
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

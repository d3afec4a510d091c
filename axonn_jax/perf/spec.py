"""What the performance model needs to know about a model: a :class:`ModelSpec`. Pure.

A spec lists the parameters (shape, which tensor axis splits each dim where
the parameter is used, whether it is additionally split over z), the matmuls
of one training step (m × k times k × n, and which axes split k and n), the
activations kept for the backward pass, and a few scalars (tokens, batch,
layers). It is grid-independent: :mod:`~axonn_jax.perf.comm`,
:mod:`~axonn_jax.perf.memory` and :mod:`~axonn_jax.perf.step` evaluate it for
any :class:`~axonn_jax.Grid`.

Two builders: :func:`gpt_spec` (analytical, instant, for the CLI's model
flags) and :func:`axonn_jax.perf.traced.spec_from_model` (read from a traced
:class:`~axonn_jax.Plan`, for any Flax model).

Example:
    >>> spec = gpt_spec(layers=2, hidden=64, heads=4, seq=32, batch=8, vocab=256)
    >>> spec.num_params
    118528
    >>> spec.tokens
    256
"""

from __future__ import annotations

import dataclasses
import functools
import math

from axonn_jax.partitioner.blocks import BUCKET_BLOCKS
from axonn_jax.partitioner.grid import BATCH_AXES, X, Y, Grid

#: Axis names a parameter or matmul dim can be split over in the spec.
TENSOR_SPLITS = (X, Y)
#: Axis names a value can be gathered or summed over: the tensor splits and the batch axes.
VALUE_SPLITS = TENSOR_SPLITS + BATCH_AXES


def split_axes(axis: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The axes of a split: none, one axis, or a tuple of them (a dim the partitioner splits
    over both x and y, moving an axis that does not divide one dim onto another)."""
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def split_size(axis: str | tuple[str, ...] | None, grid: Grid) -> int:
    """Devices a dim split over ``axis`` (see :func:`split_axes`) is split among on ``grid``."""
    return math.prod(grid.axis_size(a) for a in split_axes(axis))


def _check_axes(owner: str, field: str, *axes, optional: bool = True,
                allowed: tuple[str, ...] = TENSOR_SPLITS) -> None:  # fmt: skip
    """Raise ``ValueError`` naming ``owner`` and ``field`` for an axis that is not one of
    ``allowed`` (``optional``: None is allowed)."""
    for axis in (a for split in axes for a in (split if isinstance(split, tuple) else (split,))):
        if not (optional and axis is None) and axis not in allowed:
            raise ValueError(f"{owner}: {field} {axis!r} is not one of {allowed}")


@dataclasses.dataclass(frozen=True)
class Param:
    """A parameter as it is used: ``axes[d]`` splits dim ``d`` (``None``: not split; a
    tuple of axes: split over each, x·y, where the partitioner moves an axis that does not
    divide one dim onto another and both are larger than 1 on the grid).

    ``depth`` marks matmul and embedding weights, which are also split over z
    (gathered for use; their gradient is reduce-scattered over z).
    ``count`` identical copies; ``per_block``: inside a repeated block
    (recomputed, so re-gathered, under activation checkpointing).
    """

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    depth: bool = False
    count: int = 1
    per_block: bool = True
    #: the tensor axis the batch rows it is applied on are reduce-scattered over in the
    #: default program (``scatter_batch``): a bias after a layer, a norm on the residual
    #: stream; its gradient is then also all-reduced over that axis (None: whole rows)
    scatter_axis: str | None = None
    #: depth-split weights gathered in one all-gather with this one (the weights of the
    #: matmuls reading the same input: q/k/v, gate/up; by default all of a repeated
    #: block's, ``runtime/executor.py: gather_points``): one all-gather, one
    #: reduce-scatter and one data all-reduce per ``fused`` copies
    fused: int = 1
    #: consecutive blocks of a pipeline stage whose gather groups share one weight-gradient
    #: reduce-scatter and data all-reduce (``Overlap.bucket_blocks``; the depth weights of
    #: a block's gather group, the table gathered with block 0's too); 1: one per group
    bucket: int = 1
    #: the tensor axis it is stored split over but read whole (a convolution kernel's input
    #: channels, split like the activations' but meeting whole images, ``rules.conv``):
    #: all-gathered over it at every use; its gradient is computed whole and sliced
    read_whole: str | None = None
    #: the use splits another dim over :attr:`read_whole` (a convolution kernel stored with
    #: its output channels split over the axis that splits the input channels it meets):
    #: its gradient, of one slice on each device, is all-reduced whole over that axis
    read_whole_grad: bool = False
    #: the use meets input rows split over :attr:`read_whole` (``MatMul.weight_gathered``: a
    #: tied output head after a layer of the same orientation): each device's gradient of
    #: the whole weight is of its rows, reduce-scattered over the axis (the gather's
    #: transpose, ``runtime.executor._partial_gathers``)
    read_whole_rows: bool = False
    #: False for model state (BatchNorm's running statistics): stored, never differentiated,
    #: so no gradient of it is reduced; nor for a parameter the step never reads (wav2vec2's
    #: ``masked_spec_embed`` without a mask): its gradient is zeros, reduced nowhere
    trainable: bool = True
    #: the tensor axes splitting the features of a value this parameter, whole over them,
    #: meets in an elementwise equation (wav2vec2's ``weight_g``, broadcast over the y-split
    #: output channels of its weight-normed kernel): each device's gradient is a partial sum,
    #: all-reduced over them backward (the gradient of rows scattered over an axis:
    #: :attr:`scatter_axis`)
    grad_summed_over: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"parameter {self.name!r}: {len(self.axes)} axes for shape {self.shape}")
        owner = f"parameter {self.name!r}"
        _check_axes(owner, "axis", *self.axes)
        _check_axes(owner, "scatter_axis", self.scatter_axis)
        _check_axes(owner, "read_whole", self.read_whole)
        _check_axes(owner, "grad_summed_over", *self.grad_summed_over)
        object.__setattr__(self, "_size", math.prod(self.shape))

    @property
    def size(self) -> int:
        return self._size

    def use_elements(self, grid: Grid) -> float:
        """Elements of one copy on one device where it is used (after the z gather)."""
        return self._size / math.prod(split_size(axis, grid) for axis in self.axes)

    def local_elements(self, grid: Grid) -> float:
        """Elements of one copy stored on one device."""
        return self.use_elements(grid) / (grid.z if self.depth else 1)

    def read_whole_split(self, grid: Grid) -> int:
        """Devices the :attr:`read_whole` dim is stored split over on ``grid``: 1 where its
        axis does not divide it (the partitioner then splits another dim over that axis:
        a ViT's 3 image channels on y=2, its output channels over x·y)."""
        return next((grid.axis_size(axis) for size, axis in zip(self.shape, self.axes)
                     if axis and axis == self.read_whole and size % grid.axis_size(axis) == 0), 1)  # fmt: skip

    def divides(self, grid: Grid) -> bool:
        """True if every split dim divides (a :attr:`read_whole` dim need not: see
        :meth:`read_whole_split`), and (for depth weights) some dim also takes z."""
        for size, axis in zip(self.shape, self.axes):
            if axis and size % split_size(axis, grid) and axis != self.read_whole:
                return False
        if not self.depth or grid.z == 1:
            return True
        return any(
            size % (split_size(axis, grid) * grid.z) == 0
            for size, axis in zip(self.shape, self.axes)
        )


@dataclasses.dataclass(frozen=True)
class Sliced:
    """A value whole over ``axis`` that an equation slices over it, meeting one split over
    it: backward its gradient, as sliced (whole), is all-reduced over ``axis``.

    ``elements``: per token where ``rows`` (it has the batch's rows, split like them), else
    per microbatch (a BatchNorm's statistics, one per channel); the tensor axes in
    ``split_over`` still split it (the channels a convolution's weight splits, unless they
    were gathered whole to meet the value it is sliced for).

    Example:
        >>> Sliced("y", 32.0, rows=False).values(rows=64, microbatches=2, grid=Grid(y=4))
        64.0
    """

    axis: str
    elements: float
    split_over: tuple[str, ...] = ()
    rows: bool = True

    def __post_init__(self) -> None:
        _check_axes("sliced value", "axis", self.axis, optional=False)
        _check_axes("sliced value", "split_over", *self.split_over, optional=False)

    def values(self, rows: float, microbatches: int, grid: Grid) -> float:
        """Its elements on one device over a step, ``rows``: the batch's rows on one device."""
        whole = rows * self.elements if self.rows else microbatches * self.elements
        return whole / math.prod(grid.axis_size(a) for a in self.split_over)


@dataclasses.dataclass(frozen=True)
class MatMul:
    """``O[m, n] = I[m, k] · W[k, n]`` with a parameter ``W`` (whole batch: m = all tokens).

    ``in_axis`` splits k (and the input's feature dim), ``out_axis`` splits n;
    a normal layer is ``(y, x)``, a transposed one ``(x, y)``. The forward
    reduces the output over ``in_axis`` (an all-reduce, or by default a
    reduce-scatter onto the batch); the backward all-reduces dI over
    ``out_axis``. ``recomputed``: part of a block that activation
    checkpointing runs forward again in the backward pass. ``fused``: this
    many of the ``count`` copies read one input (q, k, v): their input is
    gathered once and their input gradients are reduced in one call.
    ``whole_inputs``: copies whose input is not reduce-scattered onto the
    batch by an earlier layer (it comes from the model's inputs or a lookup),
    so the default program has no batch all-gather to run before them.
    ``scatters``: the default program reduce-scatters its output onto the batch
    (a convolution's output is all-reduced). ``input_width``: input elements
    per output row when they are not ``k`` (a convolution, priced as the
    implicit GEMM of its ``m`` output positions: its input is read once, not
    once per kernel tap); 0 means ``k``. ``input_grad``: the backward computes
    the input's gradient (False where the input depends on no parameter, the
    model's data: nothing reads that gradient, so the compiled step has neither
    its matmul nor its all-reduce). ``sliced_output``: see the field.
    """

    name: str
    m: int
    k: int
    n: int
    in_axis: str | None
    out_axis: str | None
    count: int = 1
    recomputed: bool = True
    fused: int = 1
    whole_inputs: int = 0
    scatters: bool = True
    input_width: float = 0.0
    input_grad: bool = True
    #: a convolution's output, all-reduced whole over :attr:`in_axes`, that a later equation
    #: slices over one of them (a BatchNorm or a residual add of channels split over it): the
    #: values sliced there, computed from it while whole, whose gradients are all-reduced
    sliced_output: tuple[Sliced, ...] = ()
    #: a second tensor axis splitting the input channels with ``in_axis`` (a convolution
    #: after one whose output channels are split over x·y): the partial sums are reduced
    #: over both
    in_also: str | None = None
    #: its weight, stored with k split over :attr:`in_axis`, is all-gathered whole over it
    #: (``Param.read_whole``) to meet input rows an earlier layer of the same orientation
    #: reduce-scattered over that axis (``rules._consistent`` keeps the rows split and gives
    #: up k's split: a tied output head, BERT's MLM decoder, on y grids): its products are
    #: whole, so the forward reduces nothing and the backward gathers no output gradient.
    #: The input's rows stay split over :attr:`in_axis` (so :meth:`in_split` still divides
    #: them), and the weight's gradient is reduce-scattered (``Param.read_whole_rows``)
    weight_gathered: bool = False

    @property
    def in_axes(self) -> tuple[str, ...]:
        """The axes splitting k, whose partial sums the forward reduces."""
        return tuple(a for a in (self.in_axis, self.in_also) if a)

    def in_split(self, grid: Grid) -> int:
        """Devices splitting k on ``grid``.

        >>> MatMul("conv", 8, 16, 16, "x", None, in_also="y").in_split(Grid(x=2, y=4))
        8
        """
        return math.prod(grid.axis_size(a) for a in self.in_axes)

    @property
    def passes(self) -> int:
        """Matmuls of this shape per copy and step without recompute: forward, the weight
        gradient and (``input_grad``) the input gradient."""
        return 3 if self.input_grad else 2

    @property
    def input_per_row(self) -> float:
        """Input elements per output row (``k`` for a dense layer)."""
        return self.input_width or self.k

    @property
    def flops(self) -> float:
        """Forward FLOPs of one copy on the whole batch."""
        return 2.0 * self.m * self.k * self.n


#: Kinds of kept activations: the block input (kept even under activation
#: checkpointing), the rest of a block (recomputed under checkpointing, so only
#: one block's worth is alive), and everything outside the blocks.
ACTIVATION_KINDS = ("checkpoint", "block", "other")


@dataclasses.dataclass(frozen=True)
class Activation:
    """Activation elements kept per token for backward, split over ``axis`` (batch over data·z).

    ``itemsize`` overrides the activation dtype (e.g. 4 for float32 logits).
    ``rows_axis``: the default program holds its rows reduce-scattered onto the
    batch over this tensor axis (a dense layer's output: ``scatter_batch``).
    """

    name: str
    per_token: float
    axis: str | None
    count: int = 1
    kind: str = "block"
    itemsize: int | None = None
    rows_axis: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"activation {self.name!r}: kind {self.kind!r} not in {ACTIVATION_KINDS}")

    def local_per_token(self, grid: Grid) -> float:
        """Elements of all ``count`` copies one device holds per token of its batch shard."""
        split = (grid.axis_size(self.axis) if self.axis else 1) * (
            grid.axis_size(self.rows_axis) if self.rows_axis else 1)
        return self.per_token * self.count / split


@dataclasses.dataclass(frozen=True)
class Regather:
    """A value split over ``axis`` that the program gathers whole for an operation that
    cannot keep the split (the partitioner's rule drops the axis): a reshape merging a
    split minor dim into a major one (``rules.reshape``: a CNN's flatten of its y-split
    channels before the head), a split along the split dim (``rules.split``: a fused qkv
    product, HF GPT-2's), a concatenation of differently split values, a lookup by index
    into a value whose rows the batch axes split (a graph's node features, gathered for
    its edges: ``axis`` a batch axis).

    Forward: an all-gather over ``axis`` of ``per_token`` elements per token (the whole
    value, less the share of the tensor axes in ``split_over``, which still split other
    dims, and of ``rows_axis`` where the default program holds its rows reduce-scattered
    onto the batch over it; times the batch axes in ``whole_rows``, over which its rows
    are gathered whole, this one's or an earlier gather's); backward (``grad``: the value
    depends on a parameter): its
    gradient, partial on each device of the axis, all-reduced over it where the whole
    value meets a split one, ``grad_per_token`` elements per token (by default
    ``per_token``; more where the value grew while whole: Llama's key/value heads
    repeated for its query heads).
    """

    name: str
    per_token: float
    axis: str
    count: int = 1
    grad: bool = True
    split_over: tuple[str, ...] = ()
    rows_axis: str | None = None
    grad_per_token: float | None = None
    whole_rows: tuple[str, ...] = ()
    #: the gather of rows the default program holds reduce-scattered over ``axis`` (and only
    #: where it does), before a gather over the batch axes makes them whole
    scattered_rows: bool = False

    def __post_init__(self) -> None:
        owner = f"regather {self.name!r}"
        _check_axes(owner, "axis", self.axis, optional=False, allowed=VALUE_SPLITS)
        _check_axes(owner, "split_over", *self.split_over, optional=False)
        _check_axes(owner, "rows_axis", self.rows_axis)
        _check_axes(owner, "whole_rows", *self.whole_rows, optional=False, allowed=BATCH_AXES)


@dataclasses.dataclass(frozen=True)
class PartialSums:
    """An operation that each device computes from its share of the inputs into a whole
    output, summed over ``axes``: a scatter-add (``segment_sum``, ``.at[...].add``), which
    adds each device's edges into all the nodes (``rules.scatter_add``).

    ``per_token``: the output's elements per token (whole rows); the tensor axes in
    ``split_over`` still split it. Forward: reduce-scattered onto its ``rows`` (the length
    of the dim it is scattered onto; 0: none) where the axes divide them (backward: its
    gradient all-gathered again, where it has one, ``grad``), else all-reduced.

    ``sliced``: where an all-reduced output is sliced again over the axes it was summed
    over (a graph's globals, repeated onto its edges, concatenated with the edges' rows),
    the elements per token of each value sliced and the tensor axes still splitting it
    there. Backward each one's gradient is all-reduced over the same axes.
    """

    name: str
    per_token: float
    axes: tuple[str, ...]
    rows: int = 0
    grad: bool = True
    split_over: tuple[str, ...] = ()
    rows_axis: str | None = None  # its inputs' rows scattered onto the batch over it: summed too
    sliced: tuple[tuple[float, tuple[str, ...]], ...] = ()

    def scattered(self, axes: tuple[str, ...], grid: Grid) -> bool:
        """Whether ``grid``'s program reduce-scatters the sums over ``axes`` (``rules.scatter_add``)."""
        return self.rows > 0 and self.rows % math.prod(grid.axis_size(a) for a in axes) == 0

    def __post_init__(self) -> None:
        owner = f"partial sums {self.name!r}"
        _check_axes(owner, "axes", *self.axes, optional=False, allowed=VALUE_SPLITS)
        _check_axes(owner, "split_over", *self.split_over, optional=False)
        _check_axes(owner, "rows_axis", self.rows_axis)
        for _, split in self.sliced:
            _check_axes(owner, "sliced", *split, optional=False)


@dataclasses.dataclass(frozen=True)
class Join:
    """A whole activation with a gradient added to one the default program holds split:
    the embeddings meeting block 0's output, whose rows are reduce-scattered onto the batch
    (the residual stream), or HF T5's position bias, looked up whole, meeting the attention
    scores split over heads. The program slices it to the device's part: its rows where
    the default program holds them reduce-scattered over ``rows_axis``, then its features
    over each of ``features``. Backward it all-reduces its gradient over each, in reverse:
    over each feature axis (the rows already sliced), then over ``rows_axis`` (whole).

    ``per_token``: its elements per token (the tensor axes in ``split_over`` still split
    it: the stream's hidden, y). One value sliced at several joins (the bias every block
    of a stack adds) is one join: its uses' gradients are summed before the all-reduce.
    """

    name: str
    per_token: float
    features: tuple[str, ...] = ()
    rows_axis: str | None = None
    split_over: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        owner = f"join {self.name!r}"
        _check_axes(owner, "features", *self.features, optional=False)
        _check_axes(owner, "split_over", *self.split_over, optional=False)
        _check_axes(owner, "rows_axis", self.rows_axis)


@dataclasses.dataclass(frozen=True)
class NormGroup:
    """``count`` normalisations over a dim split by ``axis``, ``stats`` per-row statistics
    each (LayerNorm: mean and mean square, 2; RMSNorm 1), all-reduced over ``axis`` in one
    call per norm, forward and backward. ``rows_axis``: the tensor axis the default
    program holds their rows reduce-scattered over (a transformer's stream: x); None for
    norms on whole rows (block 0's first, before any layer scatters the stream), which the
    first pipeline stage runs, while the others are shared out among the stages.
    ``rows_per_token``: the rows each normalises, per token of the spec (1; Whisper's and
    wav2vec2's stream has fewer rows than their inputs have frames). ``axis`` may be a
    tuple: a dim split over x·y (:class:`Param`), its statistics all-reduced over both.
    ``fixed_rows``: rows that are not the batch's, the same every microbatch (a weight
    norm over a kernel's split dim: wav2vec2's positional convolution, one row per kernel
    position); 0: the batch's (``rows_per_token``).
    """

    count: int
    stats: float = 2
    axis: str | tuple[str, ...] = Y
    rows_axis: str | None = None
    rows_per_token: float = 1.0
    fixed_rows: int = 0

    def __post_init__(self) -> None:
        _check_axes("norm group", "axis", self.axis, optional=False)
        _check_axes("norm group", "rows_axis", self.rows_axis)
        if not self.rows_per_token > 0:
            raise ValueError(f"norm group: rows_per_token must be > 0, got {self.rows_per_token!r}")


@dataclasses.dataclass(frozen=True)
class BatchStatistics:
    """``count`` normalisations over the batch (BatchNorm): ``stats`` statistics each
    (mean and mean square: 2), each of ``elements`` values (its channels) reduced over the
    batch dims, which ``axes`` split (the batch axes; a tensor axis too where the rows are
    reduce-scattered onto the batch over it). Each statistic is all-reduced over ``axes``
    once per microbatch forward (twice under recompute), and where it has a gradient
    (``grad``) once backward: the transpose of its broadcast over the rows. The tensor axes
    in ``split_over`` split its elements (channels split like their activation).

    Example:
        >>> BatchStatistics(6, 2, 16.0, ("data", "z")).axes
        ('data', 'z')
    """

    count: int
    stats: int
    elements: float
    axes: tuple[str, ...]
    grad: bool = True
    split_over: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_axes("batch statistics", "axes", *self.axes, optional=False, allowed=VALUE_SPLITS)
        _check_axes("batch statistics", "split_over", *self.split_over, optional=False)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything the performance model reads about a model (see module docstring)."""

    name: str
    params: tuple[Param, ...]
    matmuls: tuple[MatMul, ...]
    activations: tuple[Activation, ...]
    batch: int  # leading (sample) dim of the inputs; split over data·z
    tokens: int  # rows of the activations for the whole batch (batch × seq)
    layers: int  # repeated blocks (a pipeline has at most this many stages)
    hidden: int  # activation elements per token crossing a block boundary (split over y)
    attention_flops: float = 0.0  # forward FLOPs of activation × activation matmuls
    attention_axis: str | None = X  # the axis that splits their heads
    #: normalisations over a split dim (each all-reduces its statistics over that dim's axis)
    norms: tuple[NormGroup, ...] = ()
    lookups: int = 0  # vocabulary-parallel lookups (each all-reduces its [tokens, hidden/y] rows over x)
    #: their outputs' elements for the whole batch, where they are not ``tokens × hidden``
    #: each (an encoder–decoder's decoder tokens; 0: ``lookups × tokens × hidden``)
    lookup_elements: float = 0.0
    #: elements of vocabulary-parallel lookups indexed by position, not by sample (T5's
    #: relative-position bias, [query, key, heads]): split over y, all-reduced over x once
    #: per microbatch, whatever the batch
    fixed_lookup_elements: float = 0.0
    #: per-token elements of model outputs whose features are split over ``output_axis``
    #: (vocabulary-parallel logits: x), which the model's apply all-gathers to return them
    #: whole (and their batch, reduce-scattered over the other tensor axis by the last layer)
    split_outputs: float = 0
    output_axis: str = X
    #: whole activations added to split ones (the embeddings meeting the scattered stream)
    joins: tuple[Join, ...] = ()
    #: activations gathered whole over a tensor axis (replicated fallbacks of the partitioner)
    regathers: tuple[Regather, ...] = ()
    #: outputs computed in part on each device and summed (a graph's scatter-adds)
    partial_sums: tuple[PartialSums, ...] = ()
    #: normalisations over the batch: statistics all-reduced over the batch axes (BatchNorm)
    batch_statistics: tuple[BatchStatistics, ...] = ()

    def __post_init__(self) -> None:
        for m in self.matmuls:
            _check_axes(f"matmul {m.name!r}", "axis", m.in_axis, m.out_axis, m.in_also)
        if self.batch < 1 or self.tokens < 1 or self.layers < 1:
            raise ValueError(
                f"spec {self.name!r}: batch={self.batch}, tokens={self.tokens}, "
                f"layers={self.layers} must all be >= 1"
            )

    @property
    def num_params(self) -> int:
        return sum(p.size * p.count for p in self.params)

    def train_flops(self, *, recompute: bool) -> float:
        """FLOPs of one training step on the whole batch (forward + backward [+ recompute])."""
        total = 0.0
        for m in self.matmuls:
            total += m.count * m.flops * (m.passes + (1 if recompute and m.recomputed else 0))
        return total + self.attention_flops * (4 if recompute else 3)

    @property
    def output_batch_axis(self) -> str:
        """The other tensor axis: the last layer reduce-scatters its output rows over it."""
        return Y if self.output_axis == X else X

    def for_grid(self, grid: Grid) -> ModelSpec:
        """This spec: it is the same on every grid (:class:`~axonn_jax.perf.traced.PerGridSpec`
        has one per grid)."""
        return self

    def problems(self, grid: Grid) -> list[str]:
        """Why ``grid`` cannot split this model exactly (empty: it can)."""
        out = self.batch_and_stage_problems(grid)
        for p in self.params:
            if not p.divides(grid):
                out.append(f"parameter {p.name} {p.shape} split {p.axes} (+z) does not divide {grid}")
        return out

    def batch_and_stage_problems(self, grid: Grid) -> list[str]:
        """The part of :meth:`problems` no plan for ``grid`` can change: the batch over
        data·z, the stages over the blocks."""
        out = []
        if self.batch % grid.batch_shards:
            out.append(f"batch {self.batch} is not divisible by data·z = {grid.batch_shards}")
        if grid.stages > self.layers:
            stages = f"pipeline={grid.pipeline}" + (f" × virtual={grid.virtual}" if grid.virtual > 1 else "")
            out.append(f"{stages} stages exceed the {self.layers} blocks")
        return out


def _bucketed(bucket: int, *args, **kwargs) -> Param:
    """A GPT parameter: its depth weights (a block's, the table) bucketed by ``bucket`` blocks."""
    return Param(*args, **kwargs, bucket=bucket if kwargs.get("depth") else 1)


def gpt_spec(
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    batch: int,
    vocab: int,
    ffn: int | None = None,
    tied: bool = True,
    bias: bool = True,
    name: str | None = None,
    block_gathers: bool = True,
    bucket_blocks: int = BUCKET_BLOCKS,
) -> ModelSpec:
    """The spec of :class:`axonn_jax.models.GPT` (pre-norm LayerNorm blocks, learned positions).

    ``batch`` is in sequences of ``seq`` tokens. Parameters, matmuls and
    layouts are exactly what the partitioner plans for that model
    (``tests/test_perf_model.py`` checks this against a traced plan).
    ``block_gathers``: a block's six depth-split weights (q, k, v, out, fc_in,
    fc_out) share one all-gather (``Overlap.gather_blocks``), else q/k/v share one;
    the embedding table joins the first group (block 0's, or its q/k/v).
    ``bucket_blocks``: with block gathers, the blocks whose weight gradients share one
    reduce-scatter (``Overlap.bucket_blocks``; ``Param.bucket``).
    """
    for key, value in dict(layers=layers, hidden=hidden, heads=heads, seq=seq,
                           batch=batch, vocab=vocab).items():  # fmt: skip
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"gpt_spec: {key} must be a positive int, got {value!r}")
    if hidden % heads:
        raise ValueError(
            f"gpt_spec: hidden={hidden} is not divisible by heads={heads}; choose a hidden "
            "size that is a multiple of the number of heads"
        )
    f = 4 * hidden if ffn is None else ffn
    h, hd, L, m = hidden, hidden // heads, layers, batch * seq
    # depth weights sharing a gather (block 0's with the embedding table, read before it)
    first, qkv, one = (7, 6, 6) if block_gathers else (4, 3, 1)
    bucket = bucket_blocks if block_gathers else 1
    P = functools.partial(_bucketed, bucket)

    def kernels(name, shape, axes, per_block, fused0, fused):
        """A block weight's copies: block 0's (gathered with the table) and the others'."""
        out = [P(f"block_0/{name}", shape, axes, depth=True, count=per_block, fused=fused0)]
        if L > 1:
            out.append(P(f"block/{name}", shape, axes, depth=True, count=per_block * (L - 1), fused=fused))
        return out

    params = [
        P("embed/embedding", (vocab, h), (X, Y), depth=True, per_block=False, fused=first),
        P("pos_embed", (seq, h), (None, Y), per_block=False),
        P("norm_final/scale", (h,), (Y,), per_block=False, scatter_axis=X),
        P("norm_final/bias", (h,), (Y,), per_block=False, scatter_axis=X),
        *kernels("attn/qkv/kernel", (h, heads, hd), (Y, X, None), 3, first, qkv),
        *kernels("attn/out/kernel", (heads, hd, h), (X, None, Y), 1, first if block_gathers else 1, one),
        *kernels("mlp/fc_in/kernel", (h, f), (Y, X), 1, first if block_gathers else 1, one),
        *kernels("mlp/fc_out/kernel", (f, h), (X, Y), 1, first if block_gathers else 1, one),
        # the first norm of block 0 sees the embeddings' whole rows; the others sit on the
        # stream that the blocks' transposed layers reduce-scatter over x
        P("block_0/norm_1/scale+bias", (h,), (Y,), count=2),
        P("block/norm/scale+bias", (h,), (Y,), count=4 * L - 2, scatter_axis=X),
    ]
    if bias:  # each bias is added to its layer's output: rows reduce-scattered over its in axis
        params += [
            P("block/attn/qkv/bias", (heads, hd), (X, None), count=3 * L, scatter_axis=Y),
            P("block/attn/out/bias", (h,), (Y,), count=L, scatter_axis=X),
            P("block/mlp/fc_in/bias", (f,), (X,), count=L, scatter_axis=Y),
            P("block/mlp/fc_out/bias", (h,), (Y,), count=L, scatter_axis=X),
        ]
    if not tied:
        params.append(Param("head/kernel", (h, vocab), (Y, X), depth=True, per_block=False))
    M = MatMul
    matmuls = [
        M("attn/qkv", m, h, h, Y, X, count=3 * L, fused=3, whole_inputs=3),  # block 0: embeddings
        M("attn/out", m, h, h, X, Y, count=L),
        M("mlp/fc_in", m, h, f, Y, X, count=L),
        M("mlp/fc_out", m, f, h, X, Y, count=L),
        M("head", m, h, vocab, Y, X, recomputed=False),
    ]
    A = Activation
    activations = [
        A("block input", h, Y, count=L, kind="checkpoint"),
        A("norm outputs and mlp input", 3 * h, Y, count=L),
        A("q, k, v, attention output", 4 * h, X, count=L),
        A("attention probabilities", heads * seq, X, count=L),
        A("gelu input and output", 2 * f, X, count=L),
        A("logits", vocab, X, kind="other", itemsize=4),
    ]
    return ModelSpec(
        name=name or f"GPT {L}L/{h}H/{heads}A seq {seq} batch {batch} vocab {vocab}",
        params=tuple(params),
        matmuls=tuple(matmuls),
        activations=tuple(activations),
        batch=batch,
        tokens=m,
        layers=L,
        hidden=h,
        attention_flops=L * 2 * (2.0 * m * seq * h),  # QKᵀ and AV, unmasked
        attention_axis=X,
        # LayerNorm (mean and mean of squares) over the y-split hidden dim: block 0's first
        # on whole rows, the others on the stream's rows (scattered over x)
        norms=(NormGroup(2 * L, 2, Y, X), NormGroup(1, 2, Y, None)),
        lookups=1,  # the token embedding (vocabulary-parallel over x)
        split_outputs=vocab,  # the logits
        # the embeddings + block 0's attention output (attn/out and fc_out are transposed:
        # they scatter the stream over x)
        joins=(Join("embeddings", hidden, rows_axis=X, split_over=(Y,)),),
    )

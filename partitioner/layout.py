"""Layouts: which mesh axes split each dimension of a value. Pure.

A :data:`Layout` is a tuple with one entry per dimension; each entry is a tuple
of mesh axis names, major first (``(('data', 'z'), (), ('y',))`` is a
``[batch, seq, hidden]`` activation with the batch over data·z and the hidden
dim over y). An axis appears at most once in a layout. Axes of size 1 are kept
(they are logical: they carry the normal/transposed alternation even when
that axis is not used) and cost nothing.

Example:
    >>> from axonn_jax.partitioner.grid import Grid
    >>> local_shape((8, 4, 32), ((("data", "z")), (), ("y",)), Grid(z=2, y=4, data=2))
    (2, 4, 8)
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner.grid import BATCH_AXES, Z, Grid

Layout = tuple[tuple[str, ...], ...]


def replicated(ndim: int) -> Layout:
    return ((),) * ndim


def used_axes(layout: Layout) -> set[str]:
    return {a for dim in layout for a in dim}


def factor(axes: tuple[str, ...], grid: Grid) -> int:
    return math.prod(grid.axis_size(a) for a in axes)


def local_shape(shape, layout: Layout, grid: Grid) -> tuple[int, ...]:
    return tuple(size // factor(axes, grid) for size, axes in zip(shape, layout))


def divides(size: int, axes: tuple[str, ...], grid: Grid) -> bool:
    return size % factor(axes, grid) == 0


def to_spec(layout: Layout) -> P:
    """The PartitionSpec of a layout (size-1 axes included; they are harmless)."""
    entries = []
    for axes in layout:
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def merge(layouts: list[Layout]) -> Layout:
    """Most-sharded common layout of same-shaped values (first wins on conflict).

    A dim takes the longest axes tuple offered for it whose axes are not
    already used on another dim; replicated → sharded costs nothing (a local
    slice), so merging only ever gathers the loser of a real conflict.
    """
    ranked = sorted(layouts, key=lambda lay: -sum(len(d) for d in lay))
    ndim = len(ranked[0])
    out: list[tuple[str, ...]] = [()] * ndim
    taken: set[str] = set()
    for layout in ranked:
        for dim, axes in enumerate(layout):
            if out[dim] or not axes or taken & set(axes):
                continue
            out[dim] = axes
            taken |= set(axes)
    return tuple(out)


def common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    """The leading axes two dims' splits share: ``(x, y)`` and ``(x,)`` → ``(x,)``."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def without(layout: Layout, dims) -> Layout:
    """The layout with ``dims`` made unsharded."""
    dims = set(dims)
    return tuple(() if d in dims else axes for d, axes in enumerate(layout))


def describe(layout: Layout) -> str:
    """``[(data,z), -, y]`` — compact text for reports."""
    return "[" + ", ".join(",".join(a) if a else "-" for a in layout) + "]"


def live(layout: Layout, grid: Grid) -> Layout:
    """``layout`` without its size-1 axes (logical only: nothing to communicate)."""
    return tuple(tuple(a for a in axes if grid.axis_size(a) > 1) for axes in layout)


def use_layout(storage: Layout) -> Layout:
    """A parameter's layout where it is read: its stored layout without the depth (z) split."""
    return tuple(axes[:-1] if axes and axes[-1] == Z else axes for axes in storage)


def output_layout(layout: Layout) -> Layout:
    """Model outputs keep a (data, z) batch split on dim 0; everything else is gathered."""
    if layout and layout[0][: len(BATCH_AXES)] == BATCH_AXES:
        return (BATCH_AXES,) + replicated(len(layout) - 1)
    return replicated(len(layout))

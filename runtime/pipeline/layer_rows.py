"""The rows of a stacked parameter a pipeline stage is given, and their gradient made whole.

A scan over stacked layers cut between pipeline stages
(:mod:`~axonn_jax.partitioner.scan_cuts`) has each stage read only its range of
the stack's layers; such a stage is given just those rows
(:attr:`~axonn_jax.partitioner.flows.StageFlow.param_rows`), so it gathers,
reads and differentiates its own layers, and its gradient has their shape. The
parameter's home keeps the whole leaf: :func:`rows_given` cuts the rows out of it
(once per step), :func:`whole_gradient` puts a stage's gradient back at its rows
(zeros elsewhere, as the gradient of the whole stack through a slice would be).
Across processes, the stages' gradients of such a parameter then meet row by row
(:func:`owned_rows`, ``HostCollectives.sum_shared``): each process receives the
rows the other processes' stages read, not their whole gradients to add.

Example:
    >>> rows_given(flow, i, leaf)                              # doctest: +SKIP
    >>> whole_gradient(g, rows=(2, 4), like=leaf)             # doctest: +SKIP
    >>> owned_rows([f0, f1], users=[(0, 1)], shared=[0])       # doctest: +SKIP
    {0: {0: (0, 2), 1: (2, 4)}}
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from axonn_jax.partitioner.flows import StageFlow


def rows_given(flow: StageFlow, i: int, leaf):
    """Parameter ``i`` as stage ``flow`` is given it: ``leaf`` itself, or its rows."""
    rows = flow.rows_of(i)
    return leaf if rows is None else _rows(leaf, *rows)


def whole_gradient(g: jax.Array, rows: tuple[int, int] | None, like: jax.Array) -> jax.Array:
    """A stage's gradient of rows ``rows`` (``None``: of the whole leaf) as a gradient of the
    whole leaf ``like``, on its sharding."""
    if rows is None:
        return g
    return _padded(rows[0], like.shape[0], like.sharding)(g)


def owned_rows(flows: Sequence[StageFlow], users: Sequence[Sequence[int]],
               shared: Sequence[int]) -> dict[int, dict[int, tuple[int, int]]]:
    """Parameter → {stage: its rows}, for the shared parameters that every stage using
    them is given rows of, no two stages the same rows: each row's gradient is then one
    stage's alone (zero in every other)."""
    out = {}
    for i in shared:
        ranges = {t: flows[t].rows_of(i) for t in users[i]}
        spans = sorted(r for r in ranges.values() if r is not None)
        if len(spans) == len(ranges) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])):
            out[i] = ranges
    return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def _rows(leaf, first: int, end: int):
    return jax.lax.slice_in_dim(leaf, first, end)


@functools.cache
def _padded(first: int, total: int, sharding) -> jax.stages.Wrapped:
    def pad(g):
        widths = [(first, total - first - g.shape[0])] + [(0, 0)] * (g.ndim - 1)
        return jnp.pad(g, widths)

    return jax.jit(pad, out_shardings=sharding)

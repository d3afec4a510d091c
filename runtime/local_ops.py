"""Local kernels: equations a rule computes differently from the plain primitive.

A rule (:mod:`axonn_jax.partitioner.rules`) names a kernel in ``Step.local``
when binding the primitive on the local shards would not give this device's
block of the result. Each kernel takes the equation, its operands (already in
the rule's target layouts), the rule's :class:`~axonn_jax.partitioner.rules.Step`
and the grid, and returns the local outputs *before* the rule's reductions
(the executor applies ``Step.reduce`` after it).

Example::

    outs = KERNELS[step.local](eqn, values, step, grid, bind)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from axonn_jax.partitioner.grid import Grid
from axonn_jax.partitioner.layout import factor
from axonn_jax.partitioner.rules import Step
from axonn_jax.runtime.random_bits import local_bits
from axonn_jax.runtime.shard_index import shard_index

#: ``bind(values, params) -> list of outputs``: the executor's binding of the plain primitive
Bind = Callable[[list, dict], list]


def sharded_lookup(eqn, values: list, step: Step, grid: Grid, bind: Bind) -> list:
    """Vocabulary-parallel ``gather``: look up the rows this device holds, zeros elsewhere.

    Each looked-up dim split over some axes is offset by this device's first
    row; indices outside the local rows are clamped and their results zeroed,
    so the sum over the rows' axes (``step.reduce``) is the plain lookup.
    """
    operand, indices = values[:2]
    dn = eqn.params["dimension_numbers"]
    valid = None
    for m, dim in enumerate(dn.start_index_map):
        axes = step.targets[0][dim]
        if not any(grid.axis_size(a) > 1 for a in axes):
            continue
        rows = operand.shape[dim]
        column = indices[..., m] - shard_index(axes, grid) * rows
        inside = (column >= 0) & (column < rows)
        valid = inside if valid is None else valid & inside
        indices = indices.at[..., m].set(jnp.clip(column, 0, rows - 1))
    (out,) = bind([operand, indices, *values[2:]], step.params)
    if valid is None:
        return [out]
    batch_dims = tuple(d for d in range(out.ndim) if d not in dn.offset_dims)
    mask = lax.broadcast_in_dim(valid, out.shape, batch_dims)
    return [jnp.where(mask, out, jnp.zeros_like(out))]


def split_pieces(eqn, values: list, step: Step, grid: Grid, bind: Bind) -> list:
    """``split`` of a gathered dim, each piece then cut to this device's block of it."""
    outs = bind(values, step.params)
    axis = eqn.params["axis"] % outs[0].ndim
    cut = []
    for out, layout in zip(outs, step.outs):
        axes = layout[axis]
        size = out.shape[axis] // factor(axes, grid)
        cut.append(lax.dynamic_slice_in_dim(out, shard_index(axes, grid) * size, size, axis=axis))
    return cut


def scatter_add_once(eqn, values: list, step: Step, grid: Grid, bind: Bind) -> list:
    """``scatter-add`` of this device's updates, into the operand on one device only.

    The rule sums the devices' results over ``step.reduce``; the operand (zeros
    for ``segment_sum``) takes part on the first device of those axes, so it is
    counted once. Scatter-add is linear: the sum is the plain result.
    """
    axes = [a for a in step.reduce[0] if grid.axis_size(a) > 1]
    first = functools.reduce(jnp.logical_and, [lax.axis_index(a) == 0 for a in axes])
    operand = jnp.where(first, values[0], jnp.zeros_like(values[0]))
    return bind([operand, *values[1:]], step.params)


def model_collective(eqn, values: list, step: Step, grid: Grid, bind: Bind) -> list:
    """A collective over the model's own axis names: what it is on one device (the identity)."""
    if eqn.primitive.name == "axis_index":
        return [jnp.zeros((), eqn.outvars[0].aval.dtype)]
    if eqn.primitive.name == "all_gather" and not eqn.params["tiled"]:
        return [jnp.expand_dims(values[0], eqn.params["all_gather_dimension"])]
    return list(values)


def random_bits(eqn, values: list, step: Step, grid: Grid, bind: Bind) -> list:
    """Only this device's block of the bits (see :mod:`axonn_jax.runtime.random_bits`)."""
    return [local_bits(values[0], eqn.params["bit_width"], tuple(eqn.params["shape"]),
                       step.outs[0], grid)]  # fmt: skip


def split_extremum(eqn, values: list, step: Step, grid: Grid, bind: Bind) -> list:
    """``reduce_max`` / ``reduce_min`` over dims split across devices (a softmax's max over
    vocabulary-split logits): each device's extremum, then ``pmax`` / ``pmin`` over the dims' axes.

    Differentiable as the plain primitive is: the tangent averaged over every
    position, on any device, that attains the extremum (JAX's rule for
    ``reduce_max``), with the counts and sums ``psum``-ed over the same axes.
    """
    dims = tuple(sorted(eqn.params["axes"]))
    axes = tuple(a for d in dims for a in step.targets[0][d] if grid.axis_size(a) > 1)
    combine = lax.pmax if eqn.primitive.name == "reduce_max" else lax.pmin

    @jax.custom_jvp
    def extremum(x):
        (local,) = bind([x], step.params)
        return combine(local, axes)

    @extremum.defjvp
    def _jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        ans = extremum(x)
        hits = (x == lax.expand_dims(ans, dims)).astype(t.dtype)
        counts = lax.psum(jnp.sum(hits, axis=dims), axes)
        return ans, lax.psum(jnp.sum(t * hits, axis=dims), axes) / counts

    return [extremum(values[0])]


KERNELS: dict[str, Callable[..., list[jax.Array]]] = {
    "sharded_lookup": sharded_lookup,
    "split_pieces": split_pieces,
    "random_bits": random_bits,
    "scatter_add_once": scatter_add_once,
    "model_collective": model_collective,
    "split_extremum": split_extremum,
}

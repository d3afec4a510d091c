"""Reading stored parameter shards for use: the depth (z) all-gather, one per gather group.

A parameter stored split over z is gathered before use; the gather's
transpose is its weight-gradient reduce-scatter over z, and marking it
varying over the batch axes first makes autodiff all-reduce that gradient
over ``data`` at shard size. :func:`read_params` reads several parameters at
once (a gather group: by default all of a repeated block's weights, else the
weights of matmuls that read the same input: q/k/v, gate/up): the
shards of one dtype are flattened into one vector, gathered with one
all-gather, and split back, so the group issues one all-gather forward and
one reduce-scatter (and one data all-reduce) backward instead of one per
parameter. The values are the same elements moved, so they are unchanged,
and so are the gradients (each element's sum over z and data is the same sum).

Example (inside ``shard_map`` over a mesh with ``z``)::

    q, k, v = read_params([_Stored(wq, s), _Stored(wk, s), _Stored(wv, s)], grid)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from axonn_jax.partitioner.grid import BATCH_AXES, DATA, Z, Grid
from axonn_jax.partitioner.layout import Layout
from axonn_jax.runtime.grad_buckets import GradBucket, routed_gather
from axonn_jax.runtime.varying import vma


def depth_dims(storage: Layout) -> list[int]:
    """The dims of a stored layout split over z last (the depth split)."""
    return [d for d, axes in enumerate(storage) if axes and axes[-1] == Z]


def needs_gather(storage: Layout, grid: Grid) -> bool:
    """True if reading a parameter stored in ``storage`` all-gathers its depth (z) split."""
    return grid.z > 1 and bool(depth_dims(storage))


def read_param(x: jax.Array, storage: Layout, grid: Grid) -> jax.Array:
    """Local parameter shard → its use layout (depth gathered, batch axes varying)."""
    if needs_gather(storage, grid):
        return lax.all_gather(_vary_data(x, grid), Z, axis=depth_dims(storage)[0], tiled=True)
    missing = tuple(a for a in BATCH_AXES if grid.axis_size(a) > 1 and a not in vma(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def read_params(shards: Sequence[jax.Array], storages: Sequence[Layout], grid: Grid,
                buckets: Mapping | None = None, ids: Sequence = ()) -> list:  # fmt: skip
    """:func:`read_param` of each shard, the depth gathers of one dtype in one all-gather.

    ``buckets``: the open :class:`~axonn_jax.runtime.grad_buckets.GradBucket` per
    :func:`bucket_key`, ``ids``: each shard's member id in them. The gradients of a
    gather whose shards a bucket covers go to the bucket's one reduce-scatter.
    """
    out: list = [None] * len(shards)
    together: dict = {}
    for k, (x, storage) in enumerate(zip(shards, storages)):
        if needs_gather(storage, grid):
            together.setdefault(bucket_key(x), []).append(k)
        else:
            out[k] = read_param(x, storage, grid)
    for key, ks in together.items():
        bucket = (buckets or {}).get(key)
        members = [ids[k] for k in ks] if bucket is not None else []
        grad_to = None
        if bucket is not None and bucket.covers(members):
            grad_to = bucket.columns(members)
        elif len(ks) == 1:
            out[ks[0]] = read_param(shards[ks[0]], storages[ks[0]], grid)
            continue
        vary = _data_to_vary(shards[ks[0]], grid)
        gathered = all_gather_together([shards[k] for k in ks], [depth_dims(storages[k])[0] for k in ks],
                                       Z, vary=vary, grad_to=grad_to)  # fmt: skip
        for k, value in zip(ks, gathered):
            out[k] = value
    return out


def all_gather_together(xs: Sequence[jax.Array], dims: Sequence[int], axis: str,
                        vary: tuple[str, ...] = (), grad_to: jax.Array | None = None) -> list:  # fmt: skip
    """``[lax.all_gather(x, axis, axis=d, tiled=True) for x, d in zip(xs, dims)]`` as one
    all-gather (of the concatenated flattened arrays), so one reduce-scatter transposes it.

    ``xs`` share a dtype and their varying axes. ``vary``: axes the concatenation is
    first marked varying over (its gradient is then all-reduced over them in one piece).
    ``grad_to``: a gradient bucket's sink columns of ``xs``
    (:func:`~axonn_jax.runtime.grad_buckets.routed_gather`): the gathered gradients go
    there, to the bucket's reduce-scatter, and not to ``xs``.
    """
    flat = jnp.concatenate([x.reshape(1, -1) for x in xs], axis=1)
    flat = lax.pcast(flat, vary, to="varying") if vary else flat
    # (axis size, total): one row per device; tiled, so its transpose keeps the (1, total) shape
    if grad_to is None:
        rows = lax.all_gather(flat, axis, axis=0, tiled=True)
    else:
        rows = routed_gather(grad_to, flat, axis)
    out = []
    for x, d, piece in zip(xs, dims, lax.split(rows, [x.size for x in xs], axis=1)):
        piece = jnp.moveaxis(piece.reshape(rows.shape[0], *x.shape), 0, d)
        out.append(piece.reshape(*x.shape[:d], rows.shape[0] * x.shape[d], *x.shape[d + 1 :]))
    return out


def bucket_key(shard: jax.Array) -> tuple:
    """The shards gathered in one call, and bucketed in one sink: one dtype and varying axes."""
    return jnp.result_type(shard), vma(shard)


def open_buckets(shards: Mapping, grid: Grid) -> dict:
    """:class:`~axonn_jax.runtime.grad_buckets.GradBucket` per :func:`bucket_key` of
    ``shards`` (member id → depth-split shard, in bucket order), marked varying over
    ``data`` as :func:`read_params` marks each gather."""
    flats: dict = {}
    for k, x in shards.items():
        flats.setdefault(bucket_key(x), {})[k] = x.reshape(1, -1)
    return {key: GradBucket.open(members, Z, _data_to_vary(next(iter(members.values())), grid))
            for key, members in flats.items()}  # fmt: skip


def _data_to_vary(x: jax.Array, grid: Grid) -> tuple[str, ...]:
    """``(data,)`` if ``x`` is not yet varying over a ``data`` axis of the grid, else ``()``."""
    return (DATA,) if grid.data > 1 and DATA not in vma(x) else ()


def _vary_data(x: jax.Array, grid: Grid) -> jax.Array:
    """``x`` typed varying over ``data`` (its gradient all-reduced over data at shard size)."""
    vary = _data_to_vary(x, grid)
    return lax.pcast(x, vary, to="varying") if vary else x


def reduce_scatter_together(xs: Sequence[jax.Array], axes: tuple[str, ...], dim: int) -> list:
    """``[lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True) for x in xs]``, the
    arrays of one shape, dtype and varying axes stacked into one reduce-scatter (whose
    transpose is one all-gather); each element is the same sum, so the values are unchanged.
    """
    out: list = [None] * len(xs)
    alike: dict = {}
    for k, x in enumerate(xs):
        alike.setdefault((x.shape, jnp.result_type(x), vma(x)), []).append(k)
    for ks in alike.values():
        if len(ks) == 1:
            out[ks[0]] = lax.psum_scatter(xs[ks[0]], axes, scatter_dimension=dim, tiled=True)
            continue
        stacked = lax.psum_scatter(jnp.stack([xs[k] for k in ks]), axes, scatter_dimension=dim + 1,
                                   tiled=True)  # fmt: skip
        for j, k in enumerate(ks):
            out[k] = stacked[j]
    return out

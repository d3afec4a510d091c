"""Weight-gradient buckets: one z reduce-scatter for the gathers of several blocks.

A block's depth-split weights are all-gathered over z in one call
(:func:`~axonn_jax.runtime.param_reads.all_gather_together`), and autodiff
transposes that gather into one reduce-scatter of their gradients per block.
A bucket routes the gradients of several blocks' gathers past their
transposes into one reduce-scatter:

* the *sink* (:func:`sink`) of the bucket's concatenated shards: forward,
  zeros of the gathered shape ``(z, n)`` typed varying over z (nothing
  moves); backward, one ``psum_scatter`` of its cotangent over z, the
  gradient of every shard in the bucket;
* a *route* per gather (:func:`routed_gather`): forward, the all-gather of
  the shards (under ``stop_gradient``); backward, its cotangent handed to
  the sink's columns of those shards.

The sink's cotangent is complete once the bucket's first block is through
its backward, so the bucket reduces then, holding its unreduced (z times
larger) gradients until that point. Each element is the same sum over z, so
values are those of one reduce-scatter per block.

Example (inside ``shard_map`` over a mesh with ``z``)::

    bucket = GradBucket.open({0: a, 1: b}, "z")   # a, b: (1, n_a), (1, n_b) flat shards
    a_rows = routed_gather(bucket.columns([0], [a.size]), a, "z")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from axonn_jax.runtime.varying import vary, vma


def sink(flat: jax.Array, axis: str) -> jax.Array:
    """Zeros ``(axis size, n)`` for the ``(1, n)`` ``flat``, typed varying over ``axis``; the
    transpose reduce-scatters their cotangent over ``axis`` onto ``flat`` (one call)."""

    @jax.custom_vjp
    def zeros(flat):
        return vary(jnp.zeros((lax.axis_size(axis), flat.shape[1]), flat.dtype), vma(flat) | {axis})

    def fwd(flat):
        return zeros(flat), None

    def bwd(_, ct):
        return (lax.psum_scatter(ct, axis, scatter_dimension=0, tiled=True),)

    zeros.defvjp(fwd, bwd)
    return zeros(flat)


def routed_gather(grad_to: jax.Array, flat: jax.Array, axis: str) -> jax.Array:
    """``lax.all_gather(flat, axis, axis=0, tiled=True)``, its gradient handed to ``grad_to``
    (the sink's columns of ``flat``, same shape as the result) instead of to ``flat``."""

    @jax.custom_vjp
    def gathered(grad_to, flat):
        return lax.all_gather(flat, axis, axis=0, tiled=True)

    def fwd(grad_to, flat):
        return gathered(grad_to, flat), None

    def bwd(_, ct):
        return ct, None

    gathered.defvjp(fwd, bwd)
    return gathered(grad_to, lax.stop_gradient(flat))


@dataclasses.dataclass
class GradBucket:
    """A bucket's sink ``rows`` (``(z, n)``) and each member's first column in it."""

    rows: jax.Array
    offsets: dict[int, int]

    @classmethod
    def open(cls, flats: Mapping[int, jax.Array], axis: str, vary_over: tuple[str, ...] = ()) -> GradBucket:
        """The sink of ``flats`` (member id → ``(1, size)`` shard, one dtype and varying axes)
        concatenated in order, first marked varying over ``vary_over`` (its gradient is then
        all-reduced over them in one piece, as ``all_gather_together(vary=)`` does)."""
        offsets, at = {}, 0
        for k, x in flats.items():
            offsets[k], at = at, at + x.shape[1]
        flat = jnp.concatenate(list(flats.values()), axis=1)
        flat = lax.pcast(flat, vary_over, to="varying") if vary_over else flat
        return cls(sink(flat, axis), offsets)

    def covers(self, members: Sequence[int]) -> bool:
        """True if every one of ``members`` has columns in the sink."""
        return all(k in self.offsets for k in members)

    def columns(self, members: Sequence[int], sizes: Sequence[int]) -> jax.Array:
        """The sink's columns of ``members`` (of ``sizes`` elements), concatenated in order."""
        pieces, start, end = [], None, None
        for k, size in zip(members, sizes):
            at = self.offsets[k]
            if at != end:  # not adjacent to the previous member: a new slice
                if start is not None:
                    pieces.append(self.rows[:, start:end])
                start = at
            end = at + size
        pieces.append(self.rows[:, start:end])
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)

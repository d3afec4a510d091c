"""Weight-gradient buckets: one z reduce-scatter for the gathers of several blocks.

A block's depth-split weights are all-gathered over z in one call
(:func:`~axonn_jax.runtime.param_reads.all_gather_together`), and autodiff
transposes that gather into one reduce-scatter of their gradients per block.
A bucket routes the gradients of several blocks' gathers past their
transposes into one reduce-scatter:

* the *sink* (:func:`sink`) of the bucket's concatenated shards: forward,
  zeros of each shard's gathered shape ``(z, size)`` typed varying over z
  (nothing moves); backward, one ``psum_scatter`` over z of their
  cotangents, concatenated: the gradient of every shard in the bucket;
* a *route* per gather (:func:`routed_gather`): forward, the all-gather of
  the shards (under ``stop_gradient``); backward, its cotangent handed to
  the sink's zeros of those shards.

The sink's cotangent is complete once the bucket's first block is through
its backward, so the bucket reduces then, holding its unreduced (z times
larger) gradients until that point. Each element is the same sum over z, so
values are those of one reduce-scatter per block.

Example (inside ``shard_map`` over a mesh with ``z``)::

    bucket = GradBucket.open({0: a, 1: b}, "z")   # a, b: (1, n_a), (1, n_b) flat shards
    a_rows = routed_gather(bucket.columns([0]), a, "z")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from axonn_jax.runtime.varying import vary, vma


def sink(flat: jax.Array, sizes: Sequence[int], axis: str) -> list:
    """Zeros ``(axis size, size)`` per consecutive piece of ``sizes`` elements of the ``(1, n)``
    ``flat``, typed varying over ``axis``; the transpose reduce-scatters their cotangents,
    concatenated, over ``axis`` onto ``flat`` (one call)."""

    @jax.custom_vjp
    def zeros(flat):
        axes = vma(flat) | {axis}
        return [vary(jnp.zeros((lax.axis_size(axis), size), flat.dtype), axes) for size in sizes]

    def fwd(flat):
        return zeros(flat), None

    def bwd(_, cts):
        return (lax.psum_scatter(jnp.concatenate(cts, axis=1), axis, scatter_dimension=0, tiled=True),)

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
    """A bucket's sink: each member's zeros ``(z, size)`` whose cotangent is its gradient."""

    pieces: dict[int, jax.Array]

    @classmethod
    def open(cls, flats: Mapping[int, jax.Array], axis: str, vary_over: tuple[str, ...] = ()) -> GradBucket:
        """The sink of ``flats`` (member id → ``(1, size)`` shard, one dtype and varying axes)
        concatenated in order, first marked varying over ``vary_over`` (its gradient is then
        all-reduced over them in one piece, as ``all_gather_together(vary=)`` does)."""
        flat = jnp.concatenate(list(flats.values()), axis=1)
        flat = lax.pcast(flat, vary_over, to="varying") if vary_over else flat
        return cls(dict(zip(flats, sink(flat, [x.shape[1] for x in flats.values()], axis))))

    def covers(self, members: Sequence[int]) -> bool:
        """True if every one of ``members`` has a piece in the sink."""
        return all(k in self.pieces for k in members)

    def columns(self, members: Sequence[int]) -> jax.Array:
        """The sink's pieces of ``members``, concatenated in order: the gathered shape of
        their concatenated shards, where :func:`routed_gather` hands their gradient."""
        pieces = [self.pieces[k] for k in members]
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)

"""Varying manual axes: the ``shard_map`` type of a local shard.

Inside ``shard_map`` every value is typed with the mesh axes it *varies* over
(its vma). Primitives bound directly, as the executor does, need operands
typed alike; ``jnp`` functions insert the casts themselves, an interpreter
must do it. The transpose of such a cast is the gradient reduction over the
axes it adds.

Example (inside ``shard_map`` over an axis "x"):
    >>> y = vary(jnp.float32(0), frozenset({"x"}))      # doctest: +SKIP
    >>> vma(y)                                          # doctest: +SKIP
    frozenset({'x'})
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def vma(x) -> frozenset:
    """The mesh axes ``x`` varies over (shard_map's varying-manual-axes type).

    ``x``: a value, or the ``ShapeDtypeStruct`` of one (``jax.eval_shape``).
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        mat = getattr(x, "manual_axis_type", None)
    else:
        mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def vary(value, axes: frozenset, dtype=None):
    """``value`` marked varying over ``axes`` (those it does not vary over yet)."""
    missing = tuple(sorted(axes - vma(value)))
    if not missing:
        return value
    return lax.pcast(jnp.asarray(value, dtype=dtype), missing, to="varying")


def match_vma(values: Sequence, dtypes: Sequence) -> list:
    """Every value marked varying over the union of their varying axes.

    ``dtypes`` (one per value) type the Python scalars among ``values``.
    """
    together = frozenset().union(*(vma(v) for v in values))
    if not together:
        return list(values)
    return [vary(value, together, dtype) for value, dtype in zip(values, dtypes)]

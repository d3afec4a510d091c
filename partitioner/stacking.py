"""Stacked weight dims: which dims of a matmul's output are taken apart afterwards. Pure.

Fused projections stack several weights along a small dim: Gemma's
``kv_einsum`` kernel ``(2, kv_heads, hidden, head_dim)`` computes k and v in
one einsum whose output is then unstacked (``key, value = kv``), a fused qkv
kernel ``(3, heads, hidden, head_dim)`` likewise, in any position of the
stack dim. Splitting the layer's output features over that stack dim would put
k on some devices and v on others, to be gathered back right away; the heads
or features next to it are the dim to split. :func:`stacking_dims` finds, for
each ``dot_general``, the output dims that a later ``slice``/``split``/
``dynamic_slice`` takes apart (followed through casts, transposes and
reshapes that keep the dim), and the rules split another free dim of the
weight when one divides (``rules.Context.stacked``).

Example:
    >>> import jax, jax.numpy as jnp
    >>> def f(x, w):
    ...     k, v = jnp.einsum("BSD,CKDH->CBSKH", x, w)
    ...     return k + v
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 3, 8)), jnp.ones((2, 4, 8, 5))).jaxpr
    >>> [sorted(dims) for dims in stacking_dims(jaxpr).values()]
    [[0]]
"""

from __future__ import annotations

from axonn_jax.partitioner import rules as R

#: ops whose output is the input's value in another shape, dim for dim
_FOLLOW = frozenset(["convert_element_type", "copy", "copy_p", "reduce_precision", "transpose",
                     "reshape"])  # fmt: skip


def stacking_dims(jaxpr) -> dict:
    """``{dot_general output var: frozenset of its dims that a later op takes apart}``."""
    track: dict = {}  # var -> (dot_general output var, dim map: var dim -> output dim or None)
    found: dict = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            out = eqn.outvars[0]
            track[out] = (out, tuple(range(len(R.shape_of(out)))))
            continue
        live = [v for v in eqn.invars if not R.is_literal(v)]
        if not live or live[0] not in track:
            continue
        source, dims = track[live[0]]
        if name in _FOLLOW and len(live) == 1:
            mapped = _follow(eqn, dims)
            if mapped is not None:
                track[eqn.outvars[0]] = (source, mapped)
            continue
        cut = {dims[d] for d in _taken_apart(eqn) if dims[d] is not None}
        if cut:
            found.setdefault(source, set()).update(cut)
    return {var: frozenset(dims) for var, dims in found.items()}


def _follow(eqn, dims):
    name = eqn.primitive.name
    if name == "transpose":
        return tuple(dims[p] for p in eqn.params["permutation"])
    if name != "reshape":
        return dims
    groups = R.reshape_groups(R.shape_of(eqn.invars[0]), R.shape_of(eqn.outvars[0]))
    if groups is None or eqn.params.get("dimensions") is not None:
        return None
    out = [None] * len(R.shape_of(eqn.outvars[0]))
    for gi, go in groups:
        if len(gi) == 1 and len(go) == 1:
            out[go[0]] = dims[gi[0]]
    return tuple(out)


def _taken_apart(eqn) -> list[int]:
    """Dims of the first operand that ``eqn`` cuts into pieces."""
    name = eqn.primitive.name
    shape = R.shape_of(eqn.invars[0])
    if name == "slice":
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        return [d for d in range(len(shape)) if limit[d] - start[d] < shape[d]]
    if name == "split":
        return [eqn.params["axis"] % len(shape)]
    if name == "dynamic_slice":
        return [d for d, n in enumerate(eqn.params["slice_sizes"]) if n < shape[d]]
    return []

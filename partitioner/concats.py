"""Concatenations taken apart: ops on a concatenation run on its pieces. Pure.

A fused cell concatenates several weights along their output features, does
one matmul and splits the result again (Flax's ``OptimizedLSTMCell``: the
four gate kernels ``[hidden, hidden]`` become one ``[hidden, 4·hidden]``
kernel, the product is split into the gates). The ``concatenate`` rule can
only un-split the concatenated dim, so the kernels would be gathered and the
matmul repeated on every tensor-parallel device. :func:`take_apart` rewrites
the jaxpr instead, exactly: a concatenation stays a list of pieces while what
reads it works piece by piece, and the pieces go on:

* ``dot_general`` with a concatenation along a *free* dim of one operand →
  one product per piece (columns of a product do not mix: exact);
* elementwise ops whose operands are concatenations along the same dim in
  the same pieces (or broadcast along it, or scalars) → one op per piece;
* ``broadcast_in_dim``, ``reshape`` (keeping the dim as one of its own),
  ``transpose`` and ``convert_element_type`` move the dim along;
* ``split`` / ``slice`` whose boundaries fall on piece boundaries read the
  pieces (a split into the concatenated kernels' sizes gives each gate its
  own product: ``dot(h, W_i)``);
* ``concatenate`` of concatenations along the same dim flattens.

Anything else reads the concatenation whole: it is materialised there (one
``concatenate`` of the pieces, as the model wrote it). A concatenation that
is read whole somewhere and whose pieces no ``split``/``slice`` reads (a
first walk finds those) stays as written, so a class token concatenated to a
sequence keeps taking the sequence's split; one that nothing reads is dropped.

Every piece op is the model's op on a block of its operands: the same sums
and products as the fused form (only the matmul kernel XLA picks for the
narrower shapes may round differently). Each weight is then planned as its
own 4D layer (its columns over the layer's output axis), in scan bodies as
elsewhere (bodies are rewritten too), and autodiff of the pieces gives the
backward the same structure.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def cell(h, a, b):
    ...     x, y = jnp.split(h @ jnp.concatenate([a, b], axis=1), 2, axis=1)
    ...     return x * y
    >>> closed = jax.make_jaxpr(cell)(jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones((3, 4)))
    >>> [e.primitive.name for e in take_apart(closed).jaxpr.eqns]
    ['dot_general', 'dot_general', 'mul']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax

from axonn_jax.partitioner.jaxprs import CONTROL_FLOW, is_literal, with_subjaxprs
from axonn_jax.partitioner.rules import ELEMENTWISE, reshape_groups, shape_of


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A value that is the concatenation of ``parts`` along ``dim`` (not yet concatenated)."""

    dim: int
    parts: tuple
    #: the ``concatenate`` equations (their ids) this value's pieces come from
    origins: frozenset = frozenset()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(np.shape(p)[self.dim] for p in self.parts)

    def whole(self):
        """The concatenation itself."""
        return self.parts[0] if len(self.parts) == 1 else lax.concatenate(list(self.parts), self.dim)


def take_apart(closed) -> Any:
    """``closed`` (a ClosedJaxpr) with concatenations taken apart (module docstring); same signature.

    Two walks: the first takes every concatenation apart and records those read
    whole and those whose pieces a ``split``/``slice`` reads; the second keeps
    the ones only read whole as written.
    """
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    trial = _Env()
    jax.make_jaxpr(lambda *a: _run(closed.jaxpr, closed.consts, a, trial))(*avals)
    final = _Env(as_written=frozenset(trial.read_whole - trial.read_apart), final=True)
    return jax.make_jaxpr(lambda *a: _run(closed.jaxpr, closed.consts, a, final))(*avals)


class _Env:
    """Values of a jaxpr's variables: concrete (traced) values or :class:`Pieces`.

    ``as_written``: the concatenations (ids of their equations) not to take
    apart; ``final``: the last walk (control-flow bodies are taken apart too).
    A walk records in ``read_whole`` / ``read_apart`` the concatenations whose
    pieces were concatenated / read apart by a ``split`` or ``slice``.
    """

    def __init__(self, as_written: frozenset = frozenset(), final: bool = False):
        self.values: dict = {}
        self.wholes: dict = {}  # var -> its Pieces materialised once
        self.as_written, self.final = as_written, final
        self.read_whole: set = set()
        self.read_apart: set = set()

    def read(self, v):
        """``v``'s value, a :class:`Pieces` left as it is."""
        return v.val if is_literal(v) else self.values[v]

    def whole(self, v):
        """``v``'s value, a :class:`Pieces` concatenated (once per variable)."""
        value = self.read(v)
        if not isinstance(value, Pieces):
            return value
        if v not in self.wholes:
            self.wholes[v] = value.whole()
            self.read_whole |= value.origins
        return self.wholes[v]


def _run(jaxpr, consts, args, env: _Env) -> list:
    from axonn_jax.partitioner.trace import source_context

    env.values.update(zip(jaxpr.constvars, consts))
    env.values.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        with source_context(eqn.source_info):  # warnings keep naming the model's line
            outs = _apart(eqn, env)
            if outs is None:
                outs = _bind(eqn, [env.whole(v) for v in eqn.invars], final=env.final)
        env.values.update(zip(eqn.outvars, outs))
    return [env.whole(v) for v in jaxpr.outvars]


def _bind(eqn, values: list, final: bool = False, **changed) -> list:
    params = dict(eqn.params, **changed)
    if final and eqn.primitive.name in CONTROL_FLOW:  # bodies taken apart too; same signature
        params = with_subjaxprs(eqn, take_apart)
    outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _apart(eqn, env: _Env) -> list | None:
    """The outputs of ``eqn`` computed piece by piece, or None when it needs its operands whole."""
    name = eqn.primitive.name
    if name == "concatenate":
        return _concatenate(eqn, env)
    if not any(isinstance(env.read(v), Pieces) for v in eqn.invars):
        return None
    if name in ELEMENTWISE and not eqn.primitive.multiple_results:
        return _elementwise(eqn, env)
    handler = _HANDLERS.get(name)
    return handler(eqn, env) if handler is not None else None


def _each(pieces: Pieces, dim: int, make: Callable[[int, Any], Any]) -> Pieces:
    """``Pieces`` along ``dim`` of ``make(k, part)`` for each part ``k``."""
    return Pieces(dim, tuple(make(k, part) for k, part in enumerate(pieces.parts)), pieces.origins)


def _elementwise(eqn, env: _Env) -> list | None:
    """Operands in the same pieces along one dim, or of size 1 there (broadcast), or scalars."""
    values = [env.read(v) for v in eqn.invars]
    found = [v for v in values if isinstance(v, Pieces)]
    dim, sizes = found[0].dim, found[0].sizes
    if any((p.dim, p.sizes) != (dim, sizes) for p in found):
        return None
    for var, value in zip(eqn.invars, values):
        shape = shape_of(var) if not is_literal(var) else np.shape(value)
        if not isinstance(value, Pieces) and shape and shape[dim] != 1:
            return None
    part = lambda k, value: value.parts[k] if isinstance(value, Pieces) else value  # noqa: E731
    outs = [_bind(eqn, [part(k, v) for v in values])[0] for k in range(len(sizes))]
    return [Pieces(dim, tuple(outs), frozenset().union(*(p.origins for p in found)))]


def _dot_general(eqn, env: _Env) -> list | None:
    """One product per piece of an operand concatenated along a free dim (the weight first)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (env.read(v) for v in eqn.invars)
    lfree = [d for d in range(len(shape_of(eqn.invars[0]))) if d not in lc and d not in lb]
    rfree = [d for d in range(len(shape_of(eqn.invars[1]))) if d not in rc and d not in rb]
    if isinstance(rhs, Pieces) and rhs.dim in rfree:
        other = env.whole(eqn.invars[0])
        dim = len(lb) + len(lfree) + rfree.index(rhs.dim)
        return [_each(rhs, dim, lambda k, part: _bind(eqn, [other, part])[0])]
    if isinstance(lhs, Pieces) and lhs.dim in lfree:
        other = env.whole(eqn.invars[1])
        dim = len(lb) + lfree.index(lhs.dim)
        return [_each(lhs, dim, lambda k, part: _bind(eqn, [part, other])[0])]
    return None


def _broadcast_in_dim(eqn, env: _Env) -> list | None:
    value = env.read(eqn.invars[0])
    out_shape = tuple(eqn.params["shape"])
    dim = eqn.params["broadcast_dimensions"][value.dim]
    if len(eqn.invars) != 1 or out_shape[dim] != sum(value.sizes):
        return None
    return [_each(value, dim, lambda k, part: _bind(
        eqn, [part], shape=out_shape[:dim] + (value.sizes[k],) + out_shape[dim + 1:])[0])]


def _reshape(eqn, env: _Env) -> list | None:
    """A reshape that keeps the concatenated dim as one dim of its own (others may merge or split)."""
    value = env.read(eqn.invars[0])
    in_shape, out_shape = shape_of(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    groups = reshape_groups(in_shape, out_shape) or []
    kept = [go[0] for gi, go in groups if gi == [value.dim] and len(go) == 1]
    if eqn.params.get("dimensions") is not None or len(eqn.invars) != 1 or not kept:
        return None
    dim = kept[0]
    return [_each(value, dim, lambda k, part: _bind(
        eqn, [part], new_sizes=out_shape[:dim] + (value.sizes[k],) + out_shape[dim + 1:])[0])]


def _transpose(eqn, env: _Env) -> list | None:
    value = env.read(eqn.invars[0])
    dim = list(eqn.params["permutation"]).index(value.dim)
    return [_each(value, dim, lambda k, part: _bind(eqn, [part])[0])]


def _ranges(value: Pieces, bounds: list[tuple[int, int]], env: _Env) -> list | None:
    """Each ``(start, stop)`` range along the dim as its run of pieces, or None if one cuts a piece."""
    edges = list(np.cumsum((0,) + value.sizes))
    out = []
    for start, stop in bounds:
        if start not in edges or stop not in edges:
            return None
        run = value.parts[edges.index(start):edges.index(stop)]
        out.append(run[0] if len(run) == 1 else Pieces(value.dim, run, value.origins))
    env.read_apart |= value.origins
    return out


def _split(eqn, env: _Env) -> list | None:
    value = env.read(eqn.invars[0])
    if eqn.params["axis"] % len(shape_of(eqn.invars[0])) != value.dim:
        return None
    edges = list(np.cumsum((0,) + tuple(eqn.params["sizes"])))
    return _ranges(value, list(zip(edges[:-1], edges[1:])), env)


def _slice(eqn, env: _Env) -> list | None:
    """A slice along the concatenated dim only (others whole, stride 1)."""
    value = env.read(eqn.invars[0])
    shape = shape_of(eqn.invars[0])
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params.get("strides") or (1,) * len(shape)
    cut = [d for d in range(len(shape)) if (start[d], limit[d], strides[d]) != (0, shape[d], 1)]
    if cut != [value.dim] or strides[value.dim] != 1:
        return None
    return _ranges(value, [(start[value.dim], limit[value.dim])], env)


def _concatenate(eqn, env: _Env) -> list | None:
    """A concatenation is its pieces (flattening those concatenated along the same dim), when
    it is one to take apart."""
    if id(eqn) in env.as_written:
        return None
    dim = eqn.params["dimension"]
    parts: list = []
    origins = {id(eqn)}
    for v in eqn.invars:
        value = env.read(v)
        if isinstance(value, Pieces) and value.dim == dim:
            parts.extend(value.parts)
            origins |= value.origins
        else:
            parts.append(env.whole(v))
    return [Pieces(dim, tuple(parts), frozenset(origins))]


_HANDLERS: dict[str, Callable[[Any, _Env], list | None]] = {
    "dot_general": _dot_general,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "split": _split,
    "slice": _slice,
}

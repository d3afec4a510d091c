"""Run a pointwise custom-JVP call on local shards, its derivative rule intact.

The partitioner keeps calls such as ``jax.nn.relu`` whole
(:mod:`axonn_jax.partitioner.pointwise`). Their body and rule were traced at the
global shape; being pointwise, they mean the same on any shard, except that a
broadcast of a scalar names the global shape. :func:`bind_custom_jvp` rebuilds
the call as a ``jax.custom_jvp`` at the shard's shape: body and rule are
evaluated equation by equation with each such broadcast retargeted.

Example (inside the executor's ``shard_map``; ``eqn`` is a kept relu call):
    >>> bind_custom_jvp(eqn.params, [x_shard])   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax import lax
from jax.extend import core as jex_core

from axonn_jax.partitioner.jaxprs import CALL_PRIMITIVES, call_body
from axonn_jax.partitioner.pointwise import jvp_rule
from axonn_jax.runtime.varying import match_vma


def evaluate(jaxpr, consts, args: Sequence, shape: tuple[int, ...], whole: tuple[int, ...]) -> list:
    """Evaluate a pointwise ``jaxpr`` traced at the global shape ``whole`` on values of the
    local ``shape`` (or scalars)."""
    env = {}
    fills = {}  # a broadcast of one scalar to another shape (jax.vmap's rules): that scalar

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "broadcast_in_dim":  # a scalar (or a fill) to the global shape
            (v,) = eqn.invars
            literal = isinstance(v, jex_core.Literal)
            scalar = read(v) if literal or v not in fills else fills[v]
            if tuple(eqn.outvars[0].aval.shape) != tuple(whole):  # a fill broadcast again later
                fills[eqn.outvars[0]] = scalar
                continue
            outs = [lax.broadcast_in_dim(scalar, shape, ())]
        elif eqn.primitive.name in CALL_PRIMITIVES:  # an inner custom rule is not the one in force
            inner, inner_consts = call_body(eqn)
            outs = evaluate(inner, inner_consts, [read(v) for v in eqn.invars][-len(inner.invars):], shape, whole)
        else:
            values = match_vma([read(v) for v in eqn.invars], [v.aval.dtype for v in eqn.invars])
            outs = eqn.primitive.bind(*values, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def bind_custom_jvp(params: dict, values: Sequence[jax.Array]) -> list:
    """The kept ``custom_jvp_call`` with ``params`` on local operands ``values``."""
    call = params["call_jaxpr"]
    num_consts = params["num_consts"]
    shape = next(v.shape for v in values if getattr(v, "ndim", 0))
    whole = tuple(call.jaxpr.outvars[0].aval.shape)

    @jax.custom_jvp
    def call_local(*args):
        return evaluate(call.jaxpr, call.consts, args, shape, whole)

    @call_local.defjvp
    def call_local_jvp(primals, tangents):
        primals, tangents = primals[num_consts:], tangents[num_consts:]
        rule, rule_consts, out_zeros = jvp_rule(params, len(primals))
        outs = evaluate(rule, rule_consts, [*primals, *tangents], shape, whole)
        out_primals, nonzero = outs[: len(out_zeros)], iter(outs[len(out_zeros):])
        out_tangents = [lax.zeros_like_array(p) if zero else next(nonzero)
                        for p, zero in zip(out_primals, out_zeros)]  # fmt: skip
        return out_primals, out_tangents

    return call_local(*values)

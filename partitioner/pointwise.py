"""Pointwise custom-JVP calls, kept whole so that their derivative rule survives.

``jax.nn.relu`` and user functions decorated with ``jax.custom_jvp`` carry a
derivative rule that autodiff of their body would not give: relu's derivative
at 0 is 0, while autodiff of ``max(x, 0)`` gives 0.5. Inlining such a call
would silently change gradients wherever an input is exactly 0 (zero padding,
masked rows, zero-initialised biases).

:func:`keeps_whole` says which calls the inliner keeps as one equation: a
``custom_jvp_call`` whose body is *pointwise*: every value in it has the shape
of the call's outputs or is a scalar, and every operation is elementwise (or a
broadcast of a scalar, or a nested call of the same kind). Such a call means
the same thing on any shard of its operands, so the sharding rules treat it as
one elementwise operation and the runtime re-evaluates its body and its rule
at the shard's shape (:mod:`axonn_jax.runtime.pointwise`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(jax.nn.relu)(jnp.zeros((4, 3)))
    >>> keeps_whole(closed.jaxpr.eqns[0])
    True
"""

from __future__ import annotations

from axonn_jax.partitioner.jaxprs import CALL_PRIMITIVES, CONTROL_FLOW, call_body, subjaxprs
from axonn_jax.partitioner.rules import ELEMENTWISE, POINTWISE_CALLS, is_literal, shape_of


def keeps_whole(eqn) -> bool:
    """True for a ``custom_jvp_call`` whose body is pointwise (see the module docstring)."""
    if eqn.primitive.name not in POINTWISE_CALLS:
        return False
    shapes = {shape_of(v) for v in eqn.outvars}
    if len(shapes) != 1 or () in shapes:
        return False
    (shape,) = shapes
    if any(shape_of(v) not in (shape, ()) for v in eqn.invars):
        return False
    num_primals = len(eqn.invars) - eqn.params["num_consts"]
    return is_pointwise(call_body(eqn)[0], shape) and is_pointwise(
        jvp_rule(eqn.params, num_primals)[0], shape
    )


def jvp_rule(params: dict, num_primals: int) -> tuple:
    """``(jaxpr, consts, out_zeros)`` of a ``custom_jvp_call``'s rule, every tangent nonzero.

    The jaxpr maps ``(*primals, *tangents)`` (the call's ``num_primals`` operands
    after its ``num_consts`` leading constants) to ``(*outputs, *nonzero output
    tangents)``; ``out_zeros[i]`` says that output ``i``'s tangent is identically zero.
    """
    return params["jvp_jaxpr_fun"].call_wrapped(*[False] * num_primals)


def is_pointwise(jaxpr, shape: tuple[int, ...]) -> bool:
    """Every value of ``jaxpr`` has ``shape``, is a scalar or is one scalar broadcast (a
    fill, possibly broadcast again: ``jax.vmap`` of relu's rule fills a zero at the
    unbatched shape, then broadcasts it over the batch); every operation is elementwise."""
    values = [*jaxpr.invars, *jaxpr.constvars, *jaxpr.outvars]
    fills = set()  # broadcasts of one scalar
    for eqn in jaxpr.eqns:
        values += [v for v in eqn.invars if not is_literal(v)] + list(eqn.outvars)
        name = eqn.primitive.name
        if name in CALL_PRIMITIVES:  # a nested call: its body is checked too
            if not is_pointwise(call_body(eqn)[0], shape):
                return False
        elif name == "broadcast_in_dim":
            if any(shape_of(v) != () and v not in fills for v in eqn.invars):
                return False
            fills.update(eqn.outvars)
        elif name not in ELEMENTWISE:
            return False
    return all(shape_of(v) in (shape, ()) or v in fills for v in values)


def replaced_rules(closed) -> tuple[str, ...]:
    """One note per custom-derivative call that inlining replaces by autodiff of its body.

    Exact where the rule is the derivative of the body (most numerically
    motivated rules); not for a rule that deliberately differs, such as a
    straight-through estimator. Such a rule is kept only when pointwise.
    """
    notes: list[str] = []

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if keeps_whole(eqn):
                continue
            inner = call_body(eqn)
            if name.startswith("custom_") and name.endswith("_call"):
                info = getattr(inner[0], "debug_info", None) if inner else None
                function = getattr(info, "func_name", None) or "?"
                notes.append(
                    f"{name.removesuffix('_call')} function '{function}' is inlined: its "
                    "derivative rule is replaced by autodiff of its body (only pointwise "
                    "custom_jvp rules, like jax.nn.relu's, are kept); check its gradients if "
                    "the rule is not the derivative of the body"
                )
            if inner is not None:
                walk(inner[0])
            elif name in CONTROL_FLOW:  # loop bodies and branches are inlined too
                for sub in subjaxprs(eqn):
                    walk(sub)

    walk(closed.jaxpr)
    return tuple(dict.fromkeys(notes))

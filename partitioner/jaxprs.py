"""What the partitioner and the runtime ask of a jaxpr, in one place. Pure.

* :data:`CALL_PRIMITIVES`: equations that call a sub-jaxpr once (``pjit``,
  custom derivatives, remat, ...): their body can be inlined or walked into.
* :data:`CONTROL_FLOW`: ``scan``, ``while``, ``cond``, whose bodies run a
  number of times (or one branch of several) and are kept as one equation.
* :func:`call_body`, :func:`subjaxprs`, :func:`with_subjaxprs`: a call's body,
  every sub-jaxpr of an equation, an equation's parameters with its
  sub-jaxprs replaced.
* :func:`dependencies` / :func:`dependents`: which inputs each value is
  computed from (the one dependency walk).

Example:
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda a, b: jax.jit(jnp.sin)(a) + b)(1.0, 2.0)
    >>> [e.primitive.name for e in closed.jaxpr.eqns]
    ['jit', 'add']
    >>> call_body(closed.jaxpr.eqns[0])[0].eqns[0].primitive.name
    'sin'
    >>> out = closed.jaxpr.outvars[0]
    >>> sorted(dependencies(closed.jaxpr, [frozenset("a"), frozenset("b")])[out])
    ['a', 'b']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core as jex_core

#: primitives that call one sub-jaxpr once, with the equation's operands (the last ones)
CALL_PRIMITIVES = frozenset(["jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
                             "custom_jvp_call", "custom_vjp_call", "custom_vmap_call",
                             "custom_lin"])  # fmt: skip
#: control flow kept as one equation: its bodies run several times, or one branch of several
CONTROL_FLOW = frozenset(["scan", "while", "cond"])
#: parameters of a call equation that hold its body
_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def is_literal(var) -> bool:
    """True for a constant written into the jaxpr (it has a value, not a name)."""
    return isinstance(var, jex_core.Literal)


def open_jaxpr(jaxpr) -> Any:
    """The ``Jaxpr`` of a ``ClosedJaxpr`` (a ``Jaxpr`` passes through)."""
    return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


def call_body(eqn) -> tuple | None:
    """``(jaxpr, consts)`` of a call equation's body (None for anything else)."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    for key in _BODY_KEYS:
        inner = eqn.params.get(key)
        if inner is not None:
            if isinstance(inner, jex_core.ClosedJaxpr):
                return inner.jaxpr, inner.consts
            return inner, ()
    return None


def _is_jaxpr(item) -> bool:
    return isinstance(item, (jex_core.ClosedJaxpr, jex_core.Jaxpr))


def subjaxprs(eqn) -> list:
    """Every sub-jaxpr an equation holds (open ``Jaxpr`` s): bodies, branches, loop conditions."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if _is_jaxpr(item):
                found.append(open_jaxpr(item))
    return found


def with_subjaxprs(eqn, replace: Callable) -> dict:
    """``eqn.params`` with each ``ClosedJaxpr`` ``c`` among them replaced by ``replace(c)``.

    Used to rebuild control flow with rewritten bodies (the signature must not change).
    """
    params = {}
    for key, value in eqn.params.items():
        if isinstance(value, jex_core.ClosedJaxpr):
            value = replace(value)
        elif isinstance(value, tuple) and value and all(isinstance(v, jex_core.ClosedJaxpr) for v in value):
            value = tuple(replace(v) for v in value)
        params[key] = value
    return params


def dependencies(jaxpr, inputs: Sequence[frozenset], *, branches: bool = False) -> dict:
    """Variable → the labels of the inputs it is computed from.

    ``inputs[i]`` labels ``jaxpr.invars[i]`` (constants have none). Calls are
    followed into their bodies; any other equation (control flow included)
    gives each output the union of its operands' labels, except, with
    ``branches``, a ``cond``: each output takes the index's labels and those its
    own output of each branch is computed from (``lax.cond(count == 0, init,
    update, tree)`` keeps every leaf's update its own).
    """
    env: dict = dict(zip(jaxpr.invars, inputs))

    def read(v) -> frozenset:
        return frozenset() if is_literal(v) else env.get(v, frozenset())

    def outputs(inner, ins) -> list[frozenset]:
        found = dependencies(inner, ins, branches=branches)
        return [frozenset() if is_literal(v) else found.get(v, frozenset()) for v in inner.outvars]

    for eqn in jaxpr.eqns:
        body = call_body(eqn)
        if body is not None:
            inner, _ = body
            outs = outputs(inner, [read(v) for v in eqn.invars][-len(inner.invars):] if inner.invars else [])
        elif branches and eqn.primitive.name == "cond":
            index, operands = read(eqn.invars[0]), [read(v) for v in eqn.invars[1:]]
            per_branch = [outputs(b.jaxpr, operands) for b in eqn.params["branches"]]
            outs = [index.union(*found) for found in zip(*per_branch)]
        else:
            union = frozenset().union(*(read(v) for v in eqn.invars))
            outs = [union] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return env


def dependents(jaxpr, roots: Sequence) -> frozenset:
    """Variables of ``jaxpr`` computed (transitively) from any of the variables ``roots``."""
    roots = set(roots)
    labels = [frozenset([0]) if v in roots else frozenset() for v in jaxpr.invars]
    found = {v for v, deps in dependencies(jaxpr, labels).items() if deps}
    return frozenset(found | (roots - set(jaxpr.invars)))

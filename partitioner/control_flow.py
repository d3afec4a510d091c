"""Sharding rules of control flow: ``scan``, ``while``, ``cond`` bodies planned like the model. Pure.

A body is walked with the same per-primitive rules as the model
(:func:`layouts_of`), from the layouts its inputs arrive in:

* **scan**: constants keep their layout; each ``xs`` operand enters one
  iteration slice at a time, so its leading (iteration) dim is never split and
  the slice takes the rest of its layout; ``ys`` leave stacked the same way.
  The carry takes one layout for every iteration: a *fixed point* of the body
  (:func:`fixed_point`), found by walking the body from the initial carry's
  layout until what comes out is what went in. Stacked parameters (the
  ``[layers, ...]`` leaves of ``nn.scan`` / ``nnx.scan`` over an
  ``nnx.vmap``-made stack) are ``xs``: each iteration reads one layer's weight,
  planned as a 4D layer inside the body.
* **while**: the carry the same way (a fixed point of the body); the
  condition is walked on the carry's layout.
* **cond** / **switch**: every branch from the operands' layouts; each output
  leaves every branch in one layout (the most split that the branches offer,
  :func:`~axonn_jax.partitioner.layout.merge`).

:func:`rule` gives the :class:`~axonn_jax.partitioner.rules.Step` of the
equation with ``Step.loop`` set to the :class:`LoopLayouts` the runtime runs
each body with (``runtime/executor.py``: the body is interpreted on local
shards inside ``lax.scan`` / ``lax.while_loop`` / ``lax.switch``).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from axonn_jax.partitioner.grid import Grid
    >>> from axonn_jax.partitioner.rules import Context
    >>> f = lambda c, xs: jax.lax.scan(lambda c, x: (c * x, c), c, xs)
    >>> eqn = jax.make_jaxpr(f)(jnp.ones((8, 4)), jnp.ones((3, 8, 4))).jaxpr.eqns[0]
    >>> step = rule(eqn, [(("data", "z"), ()), ((), ("data", "z"), ())], Context(Grid(z=2, data=2)))
    >>> step.outs
    [(('data', 'z'), ()), ((), ('data', 'z'), ())]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.layout import Layout, common_prefix, merge, replicated, without

#: rounds of the carry fixed-point search before settling on the common part of what was seen
MAX_ROUNDS = 8

#: how a body input is fed: a constant (same every time), the carry, or one slice of xs
CONST, CARRY, SLICE = "const", "carry", "slice"


@dataclasses.dataclass(frozen=True)
class BodyLayouts:
    """How one body runs: the layout of each input, and of each output where it leaves."""

    ins: tuple[Layout, ...]
    outs: tuple[Layout, ...]


@dataclasses.dataclass(frozen=True)
class LoopLayouts:
    """The bodies of a control-flow equation: ``(body,)`` for scan, ``(cond, body)`` for
    while, one per branch for cond."""

    bodies: tuple[BodyLayouts, ...]


@dataclasses.dataclass(frozen=True)
class Body:
    """One body of a control-flow equation and where its inputs come from.

    ``inputs[i] = (kind, k)``: body input ``i`` is operand ``k`` of the
    equation, fed as :data:`CONST`, :data:`CARRY` or :data:`SLICE` (scan xs);
    ``carry_outs`` is how many leading outputs are the next carry.
    """

    jaxpr: object  # jax.extend.core.Jaxpr
    consts: tuple
    inputs: tuple[tuple[str, int], ...]
    carry_outs: int = 0


def bodies(eqn) -> tuple[Body, ...]:
    """The bodies of a ``scan`` / ``while`` / ``cond`` equation, in :class:`LoopLayouts` order."""
    p, name = eqn.params, eqn.primitive.name
    if name == "scan":
        nc, nk = p["num_consts"], p["num_carry"]
        kinds = [CONST] * nc + [CARRY] * nk + [SLICE] * (len(eqn.invars) - nc - nk)
        closed = p["jaxpr"]
        return (Body(closed.jaxpr, tuple(closed.consts), tuple((k, i) for i, k in enumerate(kinds)), nk),)
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        carry = [(CARRY, i) for i in range(cn + bn, len(eqn.invars))]
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        return (Body(cond.jaxpr, tuple(cond.consts), tuple([(CONST, i) for i in range(cn)] + carry)),
                Body(body.jaxpr, tuple(body.consts),
                     tuple([(CONST, cn + i) for i in range(bn)] + carry), len(carry)))  # fmt: skip
    if name == "cond":
        ins = tuple((CONST, i) for i in range(1, len(eqn.invars)))
        return tuple(Body(b.jaxpr, tuple(b.consts), ins) for b in p["branches"])
    raise KeyError(name)


def carry_operands(eqn) -> list[int]:
    """Operand positions of the carry (empty for cond)."""
    return sorted({k for body in bodies(eqn) for kind, k in body.inputs if kind == CARRY})


def layouts_of(jaxpr, in_layouts: Sequence[Layout], ctx: R.Context) -> dict:
    """The layout of every variable of ``jaxpr`` from its inputs' layouts, by the rules alone.

    Constants of the jaxpr are replicated. Nested control flow is planned by
    :func:`rule` (through :func:`~axonn_jax.partitioner.rules.rule`).
    """
    lay: dict = {}
    for var, layout in zip(jaxpr.invars, in_layouts):
        lay[var] = layout
    for var in jaxpr.constvars:
        lay[var] = replicated(len(R.shape_of(var)))
    for eqn in jaxpr.eqns:
        layouts = [replicated(len(R.shape_of(v))) if R.is_literal(v) else lay[v] for v in eqn.invars]
        step = R.rule(eqn, layouts, ctx)
        for var, out in zip(eqn.outvars, step.outs):
            lay[var] = out
    return lay


def body_inputs(body: Body, operands: Sequence[Layout], carry: dict[int, Layout]) -> list[Layout]:
    """The layout of each input of ``body``: operand layouts (an xs slice drops dim 0), the carry's."""
    ins = []
    for kind, k in body.inputs:
        if kind == CARRY:
            ins.append(carry[k])
        elif kind == SLICE:
            ins.append(without(operands[k], {0})[1:])
        else:
            ins.append(operands[k])
    return ins


def fixed_point(step: Callable[[list], list], start: Sequence) -> list:
    """The carry layouts ``c`` with ``step(c) == c``, searched from ``start``.

    ``step`` maps the carry's layouts to the layouts the body returns it in.
    The search follows ``step`` for up to :data:`MAX_ROUNDS` rounds; when it
    cycles (layers that alternate normal/transposed an odd number of times) or
    does not settle, the carry takes the common part of the layouts of the
    cycle (:func:`meet`): every dim split the same way in all of them. Any
    layout is exact (the body's result is relaid out to it), a fixed point
    needs no relayout between iterations.
    """
    seen = [tuple(start)]
    for _ in range(MAX_ROUNDS):
        out = tuple(step(list(seen[-1])))
        if out == seen[-1]:
            return list(out)
        if out in seen:
            return meet(seen[seen.index(out):])
        seen.append(out)
    return meet(seen)


def meet(candidates: Sequence[Sequence[Layout]]) -> list[Layout]:
    """Per value and dim, the axes every candidate splits it over (their common prefix)."""
    out = []
    for layouts in zip(*candidates):
        dims = []
        for axes in zip(*layouts):
            common = axes[0]
            for other in axes[1:]:
                common = common_prefix(common, other)
            dims.append(common)
        out.append(tuple(dims))
    return out


def out_layouts(body: Body, ins: Sequence[Layout], ctx: R.Context) -> list[Layout]:
    """The layouts ``body`` computes its outputs in (a literal output is replicated)."""
    lay = layouts_of(body.jaxpr, ins, ctx)
    return [replicated(len(R.shape_of(v))) if R.is_literal(v) else lay[v] for v in body.jaxpr.outvars]


def rule(eqn, layouts: list[Layout | None], ctx: R.Context) -> R.Step:
    """The :class:`~axonn_jax.partitioner.rules.Step` of a control-flow equation."""
    operands = [replicated(len(R.shape_of(v))) if lay is None else lay for v, lay in zip(eqn.invars, layouts)]
    found = bodies(eqn)
    carrying = [b for b in found if b.carry_outs]
    carry_at = carry_operands(eqn)
    carry = {k: operands[k] for k in carry_at}
    if carrying:
        body = carrying[0]

        def step(layouts: list) -> list:
            outs = out_layouts(body, body_inputs(body, operands, dict(zip(carry_at, layouts))), ctx)
            return outs[: body.carry_outs]

        carry = dict(zip(carry_at, fixed_point(step, [carry[k] for k in carry_at])))
    plans, outs = [], []
    for body in found:
        ins = body_inputs(body, operands, carry)
        outs.append(out_layouts(body, ins, ctx))
        plans.append(ins)
    name = eqn.primitive.name
    if name == "cond":
        results = [merge(list(per_branch)) for per_branch in zip(*outs)]
        leave = [results] * len(found)
    elif name == "while":
        results = [carry[k] for k in carry_at]
        leave = [outs[0], results]
    else:  # scan: the carry, then ys stacked along a new unsplit dim 0
        results = [carry[k] for k in carry_at]
        leave = [results + outs[0][len(carry_at):]]
        results = results + [((),) + y for y in outs[0][len(carry_at):]]
    targets: list[Layout | None] = []
    for k, var in enumerate(eqn.invars):
        if R.is_literal(var):
            targets.append(None)
        elif k in carry:
            targets.append(carry[k])
        elif name == "scan" and k >= eqn.params["num_consts"] + eqn.params["num_carry"]:
            targets.append(without(operands[k], {0}))
        elif name == "cond" and k == 0:
            targets.append(replicated(len(R.shape_of(var))))
        else:
            targets.append(operands[k])
    loop = LoopLayouts(tuple(BodyLayouts(tuple(ins), tuple(out)) for ins, out in zip(plans, leave)))
    return R.Step(targets, results, [()] * len(results), dict(eqn.params), loop=loop)

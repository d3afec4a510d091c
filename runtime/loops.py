"""Control flow on local shards: ``scan``, ``while``, ``cond`` re-traced around planned bodies.

The executor interprets each body on local shards in the layouts the
planner chose (:mod:`axonn_jax.partitioner.control_flow`), so a body is a
Python function here and the loop is rebuilt with ``lax.scan`` /
``lax.while_loop`` / ``lax.switch``: autodiff, remat and the varying-axes
types of ``shard_map`` then work as for any JAX loop. A ``scan`` goes through
:mod:`~axonn_jax.runtime.loop_weight_grads`, which traces its body once and
takes the weights' gradients out of the loop.

A carry must have one type for every iteration, varying axes included, but
a body may make a value vary over more mesh axes than it came in with (a
parameter read marks it varying over the batch axes, a slice of a split dim
over that dim's axes). :func:`settle` marks the initial carry varying over
those axes first (``jax.eval_shape`` of the body until nothing changes).

Example (inside the executor)::

    outs = run(eqn, operand_values, lambda b, inputs: executor.run_body(...))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax import lax

from axonn_jax.runtime import loop_weight_grads
from axonn_jax.runtime.varying import vary, vma

#: ``run_body(b, inputs) -> outputs``: body ``b`` of the equation on local values
RunBody = Callable[[int, list], list]


def run(eqn, values: Sequence, run_body: RunBody) -> list:
    """The outputs of control-flow equation ``eqn`` on local operand ``values``."""
    return _KINDS[eqn.primitive.name](eqn, list(values), run_body)


def settle(carry_out: Callable[[list], list], init: Sequence) -> list:
    """``init`` marked varying over every axis the body's carry output varies over.

    Repeats until the carry's types are a fixed point of the body (at most
    one round per mesh axis, since each round only adds axes).
    """
    init = list(init)
    while True:
        outs = jax.eval_shape(carry_out, init)
        need = [vma(i) | vma(o) for i, o in zip(init, outs)]
        if all(n == vma(i) for n, i in zip(need, init)):
            return init
        init = [vary(i, n) for i, n in zip(init, need)]


def _typed_like(outs: Sequence, init: Sequence) -> list:
    """A body's carry outputs typed as the carry came in (they vary over no more axes)."""
    return [vary(o, vma(i)) for o, i in zip(outs, init)]


def scan(eqn, values: list, run_body: RunBody) -> list:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = values[:nc], values[nc : nc + nk], values[nc + nk :]

    def body(consts, carry, x):
        outs = run_body(0, list(consts) + list(carry) + list(x))
        return outs[:nk], outs[nk:]

    init = settle(lambda c, xs=xs: body(consts, c, [a[0] for a in xs])[0], init) if nk else init

    def typed(consts, carry, x):
        out, ys = body(consts, carry, x)
        return _typed_like(out, init), ys

    carry, ys = loop_weight_grads.scan(typed, consts, init, xs, length=p["length"], reverse=p["reverse"],
                                       unroll=p["unroll"], _split_transpose=p.get("_split_transpose", False))  # fmt: skip
    return list(carry) + list(ys)


def while_loop(eqn, values: list, run_body: RunBody) -> list:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = values[:cn], values[cn : cn + bn], values[cn + bn :]

    def body(carry):
        return run_body(1, body_consts + list(carry))

    init = settle(body, init)
    out = lax.while_loop(lambda c: run_body(0, cond_consts + list(c))[0],
                         lambda c: _typed_like(body(c), init), init)  # fmt: skip
    return list(out)


def cond(eqn, values: list, run_body: RunBody) -> list:
    index, operands = values[0], values[1:]
    count = len(eqn.params["branches"])
    shapes = [jax.eval_shape(lambda ops, b=b: run_body(b, ops), operands) for b in range(count)]
    common = [frozenset().union(*(vma(s[k]) for s in shapes)) for k in range(len(shapes[0]))]

    def branch(b: int):
        return lambda *ops: [vary(x, axes) for x, axes in zip(run_body(b, list(ops)), common)]

    return list(lax.switch(index, [branch(b) for b in range(count)], *operands))


_KINDS = {"scan": scan, "while": while_loop, "cond": cond}

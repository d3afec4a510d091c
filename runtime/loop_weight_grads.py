"""A loop's weight gradients in one matmul after it, instead of a sum inside it.

Reverse-mode autodiff of ``lax.scan`` adds the gradient of every loop
constant into a carry, once per iteration. For a weight ``W`` that a body
reads in a matmul ``a_t @ W`` (an RNN's kernels), that is a ``W``-sized add
per iteration on every device: with the batch split over ``D`` devices, each
holding ``B/D`` rows, one iteration's weight gradient costs ``2B + D`` flops
per weight entry across the devices against the plain model's ``2B + 1``.

Here the loop is differentiated as cuDNN differentiates an LSTM: the body
reads ``W`` as a constant, each such matmul's output gets a zero "tap" added
(an ``xs`` of the loop, so its gradient — the matmul's output gradient
``g_t`` — comes out stacked), the matmul's other operand ``a_t`` is kept
(also stacked), and after the loop ``dW = Σ_t a_tᵀ g_t`` is one matmul over
time × batch. The same flops as the per-iteration matmuls, none of the adds;
the memory of the stacked ``a_t`` (an RNN's hidden states), which the plain
backward does not keep. Only weights whose every use in the body is such a
matmul are handled this way; the others keep JAX's own rule.

Example (inside ``shard_map``; ``body(consts, carry, x) -> (carry, y)``)::

    carry, ys = scan(body, [kernel], [h0], [xs], length=16, reverse=False, unroll=1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core

from axonn_jax.partitioner.trace import source_context
from axonn_jax.runtime.varying import vary

#: ``body(consts, carry, x) -> (carry, ys)``, lists of local arrays
Body = Callable[[list, list, list], tuple]


#: one-operand linear equations a weight may pass through on its way to a matmul
#: (a cast to the compute dtype, a varying-axes mark, a transpose or reshape)
FOLLOWED = frozenset(["convert_element_type", "copy", "copy_p", "reduce_precision", "pvary", "pcast",
                      "transpose", "reshape", "squeeze"])  # fmt: skip


@dataclass(frozen=True)
class Tap:
    """A matmul of the body (equation ``eqn``) reading loop constant ``const`` as operand
    ``side`` (0 or 1), through the equations ``chain`` (a cast, say; in order)."""

    eqn: int
    const: int
    side: int
    chain: tuple[int, ...] = ()


def scan(body: Body, consts: Sequence, init: Sequence, xs: Sequence, **options) -> tuple[list, list]:
    """``lax.scan(partial(body, consts), init, xs, **options)``, weight gradients after the loop.

    ``options``: ``length``, ``reverse``, ``unroll`` (and ``_split_transpose``) of ``lax.scan``.
    """
    consts, init, xs = list(consts), list(init), list(xs)
    step_avals = [core.mapped_aval(options["length"], 0, jax.typeof(x)) for x in xs]
    closed = jax.make_jaxpr(body)(consts, init, step_avals)  # the body, traced once
    taps = find_taps(closed.jaxpr, len(consts)) if options["length"] else []
    if not taps:
        return _plain_scan(closed, consts, init, xs, options)
    tapped = sorted({t.const for t in taps})
    rest = [k for k in range(len(consts)) if k not in tapped]
    run = _loop(closed, taps, tapped, rest, len(init), options)
    return run([consts[k] for k in tapped], [consts[k] for k in rest], init, xs, list(closed.consts))


def find_taps(jaxpr: core.Jaxpr, num_consts: int) -> list[Tap]:
    """The matmuls reading a float loop constant against a value that changes per iteration.

    The constant may reach the matmul through :data:`FOLLOWED` equations. It
    qualifies only if every use of it, and of those equations' outputs, is such
    a matmul or such an equation (not an output of the body, not read by any
    other equation or a nested body).
    """
    reaches = {v: (k, ()) for k, v in enumerate(jaxpr.invars[:num_consts])}  # var -> (const, chain)
    invariant = set(jaxpr.invars[:num_consts]) | set(jaxpr.constvars)
    found: list[Tap] = []
    other_uses: set[int] = set()
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if not isinstance(v, core.Literal)]
        if all(v in invariant for v in ins):
            invariant.update(eqn.outvars)
        reads = [(side, v) for side, v in enumerate(eqn.invars) if v in ins and v in reaches]
        if not reads:
            continue
        if eqn.primitive.name in FOLLOWED and len(ins) == 1:
            k, chain = reaches[ins[0]]
            reaches[eqn.outvars[0]] = (k, chain + (i,))
            continue
        if is_matmul(eqn) and len(reads) == 1:
            side, v = reads[0]
            other = eqn.invars[1 - side]
            k, chain = reaches[v]
            if jnp.issubdtype(v.aval.dtype, jnp.floating) and not isinstance(other, core.Literal) \
                    and other not in invariant:  # fmt: skip
                found.append(Tap(i, k, side, chain))
                continue
        other_uses.update(reaches[v][0] for _, v in reads)
    # a constant returned by the body, itself or through a chain (w.T as an output)
    other_uses.update(reaches[v][0] for v in jaxpr.outvars if not isinstance(v, core.Literal) and v in reaches)
    return [t for t in found if t.const not in other_uses]


def is_matmul(eqn: core.JaxprEqn) -> bool:
    """A ``dot_general`` of two operands, or a ``custom_vjp`` call wrapping exactly one (the
    executor's :func:`~axonn_jax.runtime.overlap.contraction`: varying-axes marks, then the
    matmul) — linear in each operand either way."""
    if eqn.primitive.name == "dot_general":
        return True
    inner = eqn.params.get("call_jaxpr") if eqn.primitive.name == "custom_vjp_call" else None
    if inner is None or len(eqn.invars) != 2 or len(eqn.outvars) != 1:
        return False
    names = [e.primitive.name for e in inner.jaxpr.eqns]
    return names.count("dot_general") == 1 and all(n in FOLLOWED for n in names if n != "dot_general")


def _product(eqn: core.JaxprEqn, side: int, weight):
    """The matmul ``eqn`` as a function of its other operand, ``weight`` held as operand ``side``."""
    if eqn.primitive.name == "dot_general":
        bind = partial(eqn.primitive.bind, **eqn.params)
    else:
        inner = eqn.params["call_jaxpr"]
        bind = lambda a, b: core.jaxpr_as_fun(inner)(a, b)[0]  # noqa: E731
    return lambda a: bind(a, weight) if side == 1 else bind(weight, a)


def _plain_scan(closed: core.ClosedJaxpr, consts: list, init: list, xs: list,
                options: dict) -> tuple[list, list]:  # fmt: skip
    """``lax.scan`` of the traced body, differentiated by JAX's own rule."""
    jaxpr, n = closed.jaxpr, len(init)

    def step(carry, x):
        env = _evaluate(jaxpr, closed.consts, consts + list(carry) + list(x), {})
        outs = [_read(env, v) for v in jaxpr.outvars]
        return outs[:n], outs[n:]

    carry, ys = lax.scan(step, init, xs, **options)
    return list(carry), list(ys)


def _loop(closed: core.ClosedJaxpr, taps: list[Tap], tapped: list[int], rest: list[int],
          num_carry: int, options: dict) -> Callable:  # fmt: skip
    """The loop as a ``custom_vjp`` of (tapped weights, other constants, init, xs, jaxpr consts)."""
    jaxpr = closed.jaxpr
    position = {k: j for j, k in enumerate(tapped)}
    by_eqn = {t.eqn: t for t in taps}
    # the matmuls' other operands, each kept once; those that are a slice of xs are read from xs
    operands = list(dict.fromkeys(jaxpr.eqns[t.eqn].invars[1 - t.side] for t in taps))
    n_in = len(jaxpr.invars) - num_carry - len(rest) - len(tapped)
    xs_vars = jaxpr.invars[len(jaxpr.invars) - n_in :]
    kept = [v for v in operands if v not in xs_vars]

    def iteration(weights, others, jconsts, carry, x, tap_values, keep: bool):
        consts = _merge(weights, others, tapped, rest)
        added = dict(zip(sorted(by_eqn), tap_values)) if keep else {}
        env = _evaluate(jaxpr, jconsts, consts + list(carry) + list(x), added)
        outs = [_read(env, v) for v in jaxpr.outvars]
        held = [env[v] for v in kept] if keep else []
        return outs[:num_carry], (outs[num_carry:], held)

    def forward(weights, others, init, xs, jconsts, taps_in, keep: bool):
        def step(carry, slices):
            x, tap_values = slices
            return iteration(weights, others, jconsts, carry, x, tap_values, keep)

        carry, (ys, held) = lax.scan(step, init, (xs, taps_in or []), **options)
        return (list(carry), list(ys)), held

    @jax.custom_vjp
    def run(weights, others, init, xs, jconsts):
        return forward(weights, others, init, xs, jconsts, None, False)[0]

    def run_fwd(weights, others, init, xs, jconsts):
        zeros = _zero_taps(jaxpr, taps, options)
        outs, pullback, held = jax.vjp(partial(forward, weights, keep=True), others, init, xs,
                                       jconsts, zeros, has_aux=True)  # fmt: skip
        return outs, (pullback, held, weights, xs)

    def run_bwd(residuals, cotangents):
        pullback, held, weights, xs = residuals
        d_others, d_init, d_xs, d_jconsts, d_taps = pullback(cotangents)
        stacks = dict(zip(kept, held)) | {v: x for v, x in zip(xs_vars, xs) if v in operands}
        d_weights = [None] * len(tapped)
        for tap, grad_out in zip(sorted(by_eqn), d_taps):
            t = by_eqn[tap]
            eqn = jaxpr.eqns[t.eqn]
            j = position[t.const]
            part = _weight_gradient(jaxpr, t, stacks[eqn.invars[1 - t.side]], weights[j], grad_out)
            d_weights[j] = part if d_weights[j] is None else d_weights[j] + part
        return d_weights, d_others, d_init, d_xs, d_jconsts

    run.defvjp(run_fwd, run_bwd)
    return run


def _merge(weights: Sequence, others: Sequence, tapped: list[int], rest: list[int]) -> list:
    consts: list = [None] * (len(tapped) + len(rest))
    for k, w in zip(tapped, weights):
        consts[k] = w
    for k, c in zip(rest, others):
        consts[k] = c
    return consts


def _zero_taps(jaxpr: core.Jaxpr, taps: list[Tap], options: dict) -> list:
    """One zero array per tapped matmul, stacked over the iterations, typed like its output."""
    out = []
    for i in sorted(t.eqn for t in taps):
        aval = jaxpr.eqns[i].outvars[0].aval
        zero = jnp.zeros((options["length"], *aval.shape), aval.dtype)
        out.append(vary(zero, frozenset(aval.mat.varying)))
    return out


def _evaluate(jaxpr: core.Jaxpr, consts: Sequence, args: Sequence, taps: dict) -> dict:
    """``jax.core.eval_jaxpr`` whose equation ``i`` (a matmul) also carries the tap ``taps[i]``."""
    env: dict = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    for i, eqn in enumerate(jaxpr.eqns):
        params = eqn.primitive.get_bind_params(eqn.params)
        with source_context(eqn.source_info), eqn.ctx.manager:
            ans = eqn.primitive.bind(*[_read(env, v) for v in eqn.invars], **params)
        outs = list(ans) if eqn.primitive.multiple_results else [ans]
        if i in taps:
            outs[0] = _tapped(outs[0], taps[i])
        env.update(zip(eqn.outvars, outs))
    return env


def _read(env: dict, var):
    return var.val if isinstance(var, core.Literal) else env[var]


@jax.custom_jvp
def _tapped(out, tap):
    """``out``, with the tangent of ``tap`` added to its own: the tap's gradient is ``out``'s."""
    return out


@_tapped.defjvp
def _tapped_jvp(primals, tangents):
    return primals[0], tangents[0] + tangents[1]


def _weight_gradient(jaxpr: core.Jaxpr, tap: Tap, operand_stack, weight, grad_out):
    """``Σ_t`` of the tapped matmul's gradient for the weight: one matmul (and the reduction of a
    varying-axes mark inside it, once), then the chain's transpose.

    ``operand_stack``: the matmul's other operand per iteration; ``grad_out``: its output's
    gradient per iteration (both stacked on a leading iteration dim).
    """
    eqn = jaxpr.eqns[tap.eqn]

    def chain(w):
        for i in tap.chain:
            link = jaxpr.eqns[i]
            w = link.primitive.bind(w, **link.primitive.get_bind_params(link.params))
        return w

    def stacked(w):
        return jax.vmap(_product(eqn, tap.side, w))(operand_stack)

    read, back = jax.vjp(chain, weight)
    return back(jax.linear_transpose(stacked, read)(grad_out)[0])[0]

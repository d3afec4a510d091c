"""One pipeline stage run with a finiteness check after every equation.

:class:`ProbedStage` executes a :class:`~axonn_jax.runtime.pipeline.stage_program.StageFlow`
with the 4D executor inside ``shard_map`` on the stage's mesh, exactly like
the training programs, and additionally

* in the forward pass, records for every floating-point equation output
  whether it holds a NaN (2) or an Inf (1) on any device;
* in the backward pass, records the same for the gradient (cotangent) of each
  of those outputs: every output passes through an identity ``probe`` whose
  backward reports the badness of its incoming cotangent as the gradient of a
  dummy scalar ``token`` (one per output), so one ``jax.vjp`` returns the
  flags of the whole backward pass without changing any value.

Flags are maxima over the stage's devices, identical on every process.

Example:
    >>> stage = ProbedStage(flow, executor, grid, mesh)            # doctest: +SKIP
    >>> outs, flags = stage.forward(params, args, inbound)        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from axonn_jax.partitioner.flows import StageFlow
from axonn_jax.partitioner.layout import Layout
from axonn_jax.runtime.executor import Executor, _Lazy
from axonn_jax.partitioner.flows import is_float
from axonn_jax.runtime.sharded import manual_axes, on_mesh, sharding
from axonn_jax.runtime.varying import vma

NAN, INF, FINITE = 2.0, 1.0, 0.0


def badness(x) -> jax.Array:
    """float32 scalar: 2 if ``x`` holds a NaN, 1 if an Inf (and no NaN), else 0."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.float32(FINITE)
    return jnp.where(jnp.any(jnp.isnan(x)), NAN, jnp.where(jnp.any(jnp.isinf(x)), INF, FINITE)
                     ).astype(jnp.float32)  # fmt: skip


def _invariant(flag: jax.Array) -> jax.Array:
    """The maximum over the devices ``flag`` varies over (one value everywhere)."""
    axes = tuple(sorted(vma(flag)))
    return lax.pmax(flag, axes) if axes else flag


@jax.custom_vjp
def probe(x: jax.Array, token: jax.Array) -> jax.Array:
    """Identity in ``x``; the gradient of ``token`` is the badness of ``x``'s cotangent."""
    del token
    return x


def _probe_fwd(x, token):
    del token
    return x, None


def _probe_bwd(_, ct):
    return ct, _invariant(badness(ct))


probe.defvjp(_probe_fwd, _probe_bwd)


def is_drop(var) -> bool:
    """Whether ``var`` is a dropped output (``_`` in a jaxpr: nothing reads it)."""
    return type(var).__name__ == "DropVar"


class ProbedStage:
    """Forward (and backward) of one stage with per-equation NaN/Inf flags."""

    def __init__(self, flow: StageFlow, executor: Executor, mesh):
        self.flow, self.executor, self.grid, self.mesh = flow, executor, executor.grid, mesh
        #: (position in flow.eqns, output index) of every checked value
        self.slots: list[tuple[int, int]] = [
            (i, k) for i, eqn in enumerate(flow.eqns) for k, v in enumerate(eqn.outvars)
            if not is_drop(v) and is_float(v.aval)
        ]  # fmt: skip
        self.manual = manual_axes(mesh, self.grid)
        self.diff_in, self.diff_out = flow.diff_in, flow.diff_out
        self._body = self._shard_mapped()
        self.forward = jax.jit(self._forward)
        self.forward_vjp = jax.jit(self._forward_vjp)
        self.backward = jax.jit(self._backward)

    @property
    def num_tokens(self) -> int:
        return max(len(self.slots), 1)

    def sharding(self, layout: Layout) -> jax.sharding.NamedSharding:
        return sharding(self.mesh, self.grid, layout)

    # --- the stage as a function of local shards --------------------------
    def _local(self, params, args, inbound, tokens):
        flow, ex = self.flow, self.executor
        env, lay = ex.bind(params, args, param_vars=flow.params, arg_vars=flow.args)
        for var, x, layout in zip(flow.inbound, inbound, flow.inbound_layouts):
            env[var], lay[var] = x, layout
        flags: list = []
        slots = iter(enumerate(self.slots))
        pending = next(slots, None)
        for i, eqn in enumerate(flow.eqns):
            ex.run([eqn], env, lay)
            while pending is not None and pending[1][0] == i:
                t, (_, k) = pending
                var = eqn.outvars[k]
                value = ex.value(var, env, lay)  # runs a deferred parameter chain
                if isinstance(value, _Lazy):  # a broadcast not built yet: its operand is checked
                    flags.append(jnp.float32(FINITE))
                else:
                    flags.append(badness(value))
                    env[var] = probe(value, tokens[t])
                pending = next(slots, None)
        outs = ex.outputs(env, lay, flow.outbound, flow.outbound_layouts)
        return outs, self._combine(flags)

    def _combine(self, flags: Sequence[jax.Array]) -> jax.Array:
        if not flags:
            return jnp.zeros((1,), jnp.float32)
        if not self.manual:
            return jnp.stack(flags)
        axes = self.manual

        def everywhere(f):
            missing = tuple(sorted(axes - vma(f)))
            return lax.pcast(f, missing, to="varying") if missing else f

        return lax.pmax(jnp.stack([everywhere(f) for f in flags]), tuple(sorted(axes)))

    def _shard_mapped(self):
        ex, flow = self.executor, self.flow
        flags = ((),)  # one replicated vector: a token or flag per checked value
        return on_mesh(self._local, self.mesh, self.grid,
                       in_layouts=[[ex.param_storage[i] for i in flow.params],
                                   [ex.arg_layouts[j] for j in flow.args],
                                   list(flow.inbound_layouts), flags],
                       out_layouts=(list(flow.outbound_layouts), flags))  # fmt: skip

    # --- programs ----------------------------------------------------------
    def _tokens(self) -> jax.Array:
        return jnp.zeros((self.num_tokens,), jnp.float32)

    def _forward(self, params, args, inbound):
        """(outbound values, forward flags per slot)."""
        return self._body(params, args, inbound, self._tokens())

    def _forward_vjp(self, params, args, inbound):
        """(outbound values, forward flags, vjp) — vjp: outbound cotangents → backward results."""

        def f(params, diff, tokens):
            merged = list(inbound)
            for i, x in zip(self.diff_in, diff):
                merged[i] = x
            outs, flags = self._body(params, args, merged, tokens)
            return [outs[i] for i in self.diff_out], (outs, flags)

        diff = [inbound[i] for i in self.diff_in]
        _, vjp, (outs, flags) = jax.vjp(f, params, diff, self._tokens(), has_aux=True)
        return outs, flags, vjp

    @staticmethod
    def _backward(vjp, cotangents):
        """(badness of each parameter gradient, inbound cotangents, backward flags per slot)."""
        g_params, g_in, g_tokens = vjp(cotangents)
        return [badness(g) for g in g_params], g_in, g_tokens

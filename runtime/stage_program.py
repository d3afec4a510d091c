"""Per-stage compiled programs of a pipelined model.

A pipeline stage is a contiguous range of the model's equations
(:class:`axonn_jax.partitioner.stages.Stage`). :func:`stage_flows` works out,
without devices, what each stage reads and sends: the parameters and model
arguments it uses, the activations that arrive from the previous stage
(``inbound``) and those it passes on (``outbound``, including values it only
forwards to a later stage). A parameter's cast/reshape chain is re-run by every
stage that uses it, so no parameter-derived value ever travels as an activation.

:class:`StageProgram` compiles, once, the three programs the dispatch queue
runs on one microbatch: ``forward`` (outbound values + the residuals for the
backward), ``backward`` (parameter and inbound gradients from the outbound
cotangents), and on the last stage ``forward_backward`` (loss and gradients
in one program). Each runs the 4D executor inside ``shard_map`` on the stage's
own mesh.

Example:
    >>> flows = stage_flows(jaxpr, plan.stages, num_params, layouts)  # doctest: +SKIP
    >>> [len(f.inbound) for f in flows]                              # doctest: +SKIP
    [0, 1]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from axonn_jax.grid import Grid
from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.layout import Layout, to_spec
from axonn_jax.partitioner.stages import param_like_producers
from axonn_jax.runtime.executor import Executor, live


@dataclasses.dataclass(frozen=True)
class StageFlow:
    """What one stage computes, reads and sends (jaxpr variables; no devices)."""

    index: int
    eqns: tuple  # equations this stage executes, in model order
    params: tuple[int, ...]  # indices into the model's parameter leaves
    args: tuple[int, ...]  # indices into the model's (flattened) call arguments
    inbound: tuple  # variables received from the previous stage
    outbound: tuple  # variables sent to the next stage (model outputs on the last)
    inbound_layouts: tuple[Layout, ...]
    outbound_layouts: tuple[Layout, ...]


def stage_flows(jaxpr, stages, num_params: int, layouts: dict, out_layouts) -> list[StageFlow]:
    """Split ``jaxpr`` (inlined, params first) into per-stage data flows."""
    made_by = param_like_producers(jaxpr, num_params)
    params = {v: i for i, v in enumerate(jaxpr.invars[:num_params])}
    args = {v: j for j, v in enumerate(jaxpr.invars[num_params:])}
    stage_of: dict = {}  # activation variable → stage defining it
    own: list[list] = []
    for st in stages:
        eqns = [e for e in jaxpr.eqns[st.start : st.stop] if e.outvars[0] not in made_by]
        for e in eqns:
            for v in e.outvars:
                stage_of[v] = st.index
        own.append(eqns)

    def live_inputs(eqns):
        for e in eqns:
            yield from (v for v in e.invars if not R.is_literal(v))

    # needs[s]: activations used at stage >= s but defined before s
    last = len(stages) - 1
    final = [v for v in jaxpr.outvars if not R.is_literal(v)]
    needs: list[list] = [[] for _ in stages]
    for s in range(len(stages)):
        later = [v for t in range(s, len(stages)) for v in live_inputs(own[t])] + final
        seen = set()
        for v in later:
            if v in stage_of and stage_of[v] < s and v not in seen:
                seen.add(v)
                needs[s].append(v)
    flows = []
    for st, eqns in zip(stages, own):
        s = st.index
        used = list(live_inputs(eqns)) + (final if s == last else [])
        prelude, stack, visited = [], [v for v in used if v in made_by], set()
        while stack:  # parameter cast chains this stage must re-run
            v = stack.pop()
            e = made_by[v]
            if id(e) in visited:
                continue
            visited.add(id(e))
            prelude.append(e)
            stack.extend(u for u in e.invars if not R.is_literal(u) and u in made_by)
        order = {id(e): k for k, e in enumerate(jaxpr.eqns)}
        prelude.sort(key=lambda e: order[id(e)])
        roots = set(used) | {u for e in prelude for u in e.invars if not R.is_literal(u)}
        outbound = tuple(needs[s + 1]) if s < last else tuple(jaxpr.outvars)
        flows.append(
            StageFlow(
                index=s,
                eqns=tuple(prelude + eqns),
                params=tuple(sorted(params[v] for v in roots if v in params)),
                args=tuple(sorted(args[v] for v in roots if v in args)),
                inbound=tuple(needs[s]),
                outbound=outbound,
                inbound_layouts=tuple(layouts[v] for v in needs[s]),
                outbound_layouts=tuple(layouts[v] for v in needs[s + 1]) if s < last
                else tuple(out_layouts),
            )
        )
    return flows


def is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


class StageProgram:
    """The compiled programs of one stage, on its mesh.

    ``loss_fn(outputs, batch) -> scalar`` is applied on the last stage to the
    model outputs (rebuilt with ``out_tree``) and the microbatch ``batch``.
    """

    def __init__(
        self,
        flow: StageFlow,
        executor: Executor,
        grid: Grid,
        mesh: jax.sharding.Mesh,
        *,
        last: bool,
        out_tree=None,
        loss_fn: Callable | None = None,
        remat: Callable[[Callable], Callable] | None = None,
    ):
        self.flow, self.executor, self.grid, self.mesh = flow, executor, grid, mesh
        self.last = last
        self.out_tree, self.loss_fn = out_tree, loss_fn
        self._remat = remat or (lambda f: f)
        self.diff_in = [i for i, v in enumerate(flow.inbound) if is_float(v.aval)]
        self.diff_out = [i for i, v in enumerate(flow.outbound)
                         if not R.is_literal(v) and is_float(v.aval)]  # fmt: skip
        self._body = self._shard_mapped()
        self.forward = jax.jit(self._forward)
        self.backward = jax.jit(self._backward)
        self.forward_backward = jax.jit(self._forward_backward)
        self.compiled = False  # True once compile() replaced the jits by executables

    # --- shardings -------------------------------------------------------
    def spec(self, layout: Layout):
        return to_spec(live(layout, self.grid))

    def sharding(self, layout: Layout) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(layout))

    def param_sharding(self, i: int) -> NamedSharding:
        """Where parameter ``i`` (model leaf index) is read by this stage."""
        return self.sharding(self.executor.param_storage[i])

    @property
    def inbound_shardings(self) -> list[NamedSharding]:
        return [self.sharding(l) for l in self.flow.inbound_layouts]

    @property
    def outbound_shardings(self) -> list[NamedSharding]:
        return [self.sharding(l) for l in self.flow.outbound_layouts]

    def inbound_avals(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=s)
                for v, s in zip(self.flow.inbound, self.inbound_shardings)]  # fmt: skip

    # --- the stage as a function of local shards --------------------------
    def _shard_mapped(self) -> Callable:
        flow, ex = self.flow, self.executor
        storage = [ex.param_storage[i] for i in flow.params]
        arg_layouts = [ex.arg_layouts[j] for j in flow.args]

        def body(params, args, inbound):
            env, lay = ex.bind(params, args, param_vars=flow.params, arg_vars=flow.args)
            for var, x, layout in zip(flow.inbound, inbound, flow.inbound_layouts):
                env[var], lay[var] = x, layout
            ex.run(flow.eqns, env, lay)
            return ex.outputs(env, lay, flow.outbound, flow.outbound_layouts)

        manual = frozenset(a for a in self.mesh.axis_names if self.grid.axis_size(a) > 1)
        if not manual:
            return body
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=([self.spec(s) for s in storage], [self.spec(a) for a in arg_layouts],
                      [self.spec(l) for l in flow.inbound_layouts]),  # fmt: skip
            out_specs=[self.spec(l) for l in flow.outbound_layouts],
            axis_names=manual,
        )

    def _split(self, inbound):
        return [inbound[i] for i in self.diff_in]

    def _merge(self, inbound, diff):
        merged = list(inbound)
        for i, x in zip(self.diff_in, diff):
            merged[i] = x
        return merged

    def _stage_fn(self, args, inbound):
        """f(params, differentiable inbound) → (differentiable outbound, the rest)."""

        def f(params, diff):
            outs = self._body(params, args, self._merge(inbound, diff))
            return [outs[i] for i in self.diff_out], outs

        return self._remat(f)

    # --- the compiled programs --------------------------------------------
    def _forward(self, params, args, inbound):
        """One microbatch forward: (outbound values, residuals for :meth:`backward`)."""
        f = self._stage_fn(args, inbound)
        _, vjp, outs = jax.vjp(f, params, self._split(inbound), has_aux=True)
        return outs, vjp

    @staticmethod
    def _backward(vjp, cotangents):
        """Gradients ``(params, differentiable inbound)`` from outbound cotangents."""
        return vjp(cotangents)

    def _forward_backward(self, params, args, inbound, batch):
        """Last stage: loss of one microbatch and gradients for params and inbound."""
        f = self._stage_fn(args, inbound)

        def loss(params, diff):
            _, outs = f(params, diff)
            return self.loss_fn(jax.tree.unflatten(self.out_tree, outs), batch)

        value, (g_params, g_in) = jax.value_and_grad(loss, argnums=(0, 1))(
            params, self._split(inbound)
        )
        return value, g_params, g_in

    def compile(self, params, args, batch=None) -> None:
        """Compile this stage's programs ahead of time (before any message is exchanged).

        ``params``/``args``/``batch`` are arrays or ShapeDtypeStructs of one
        microbatch; afterwards :attr:`forward`, :attr:`backward` and
        :attr:`forward_backward` are the compiled executables, so the first step
        measures (and times out on) communication only, not a peer's compilation.
        """
        inbound = self.inbound_avals()
        if self.last:
            self.forward_backward = self.forward_backward.lower(params, args, inbound, batch).compile()
        else:
            forward = self.forward.lower(params, args, inbound).compile()
            _, residuals = forward.out_info
            self.backward = self.backward.lower(residuals, self.outbound_cotangent_avals()).compile()
            self.forward = forward
        self.compiled = True

    def outbound_cotangent_avals(self) -> list[jax.ShapeDtypeStruct]:
        shardings = self.outbound_shardings
        return [jax.ShapeDtypeStruct(self.flow.outbound[i].aval.shape,
                                     self.flow.outbound[i].aval.dtype, sharding=shardings[i])
                for i in self.diff_out]  # fmt: skip


def place(value: Any, sharding: NamedSharding) -> jax.Array:
    """Put a host or device array onto ``sharding`` (only this process's shards)."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if isinstance(value, jax.Array) and value.is_fully_addressable:
        return jax.device_put(value, sharding)
    array = np.asarray(value)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def batch_sharding(mesh, grid: Grid, shape: Sequence[int]) -> NamedSharding:
    """Dim 0 over the live batch axes (data, z) when it divides, else replicated."""
    from jax.sharding import PartitionSpec as P

    from axonn_jax.grid import BATCH_AXES

    axes = tuple(a for a in BATCH_AXES if grid.axis_size(a) > 1)
    parts = int(np.prod([grid.axis_size(a) for a in axes])) if axes else 1
    if shape and axes and shape[0] % parts == 0:
        return NamedSharding(mesh, P(axes))
    return NamedSharding(mesh, P())

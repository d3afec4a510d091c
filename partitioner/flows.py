"""Per-stage data flows of a pipelined model, and the layout of every value. Pure.

A pipeline stage is a contiguous range of the model's equations
(:class:`~axonn_jax.partitioner.stages.Stage`). :func:`stage_flows` works out,
without devices, what each stage reads and sends: the parameters and model
arguments it uses, the activations that arrive from the previous stage
(``inbound``) and those it passes on (``outbound``, including values it only
forwards to a later stage). A parameter's cast/reshape chain is re-run by every
stage that uses it, so no parameter-derived value ever travels as an activation.

Example:
    >>> layouts = variable_layouts(jaxpr, grid, storage, arg_layouts)   # doctest: +SKIP
    >>> flows = stage_flows(jaxpr, plan.stages, num_params, layouts, outs)  # doctest: +SKIP
    >>> [len(f.inbound) for f in flows]                              # doctest: +SKIP
    [0, 1]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp

from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.control_flow import layouts_of
from axonn_jax.partitioner.grid import Grid
from axonn_jax.partitioner.layout import Layout, use_layout
from axonn_jax.partitioner.stages import param_like_producers


def variable_layouts(jaxpr, grid: Grid, param_storage: Sequence[Layout],
                     arg_layouts: Sequence[Layout], *, scatter_batch: bool = True,
                     random_layouts=None) -> dict:  # fmt: skip
    """Layout of every variable of the inlined ``jaxpr`` (params first), by the rules alone."""
    ctx = R.Context(grid, scatter_batch=scatter_batch, random_layouts=random_layouts)
    return layouts_of(jaxpr, [use_layout(s) for s in param_storage] + list(arg_layouts), ctx)


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
    #: model state this stage updates: (variable, index of the variable leaf it replaces)
    updates: tuple = ()
    update_layouts: tuple[Layout, ...] = ()
    #: last stage: positions in the model's outputs of ``outbound`` (state updates excluded)
    output_positions: tuple[int, ...] = ()

    @property
    def diff_in(self) -> list[int]:
        """Positions of the floating (differentiable) inbound values."""
        return [i for i, v in enumerate(self.inbound) if is_float(v.aval)]

    @property
    def diff_out(self) -> list[int]:
        """Positions of the floating outbound values (their gradients flow back)."""
        return [i for i, v in enumerate(self.outbound) if not R.is_literal(v) and is_float(v.aval)]


def is_float(aval) -> bool:
    """True for floating (differentiable) abstract values."""
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def stage_flows(jaxpr, stages, num_params: int, layouts: dict, out_layouts,
                state_outputs: Sequence[tuple[int, int]] = ()) -> list[StageFlow]:  # fmt: skip
    """Split ``jaxpr`` (inlined, params first) into per-stage data flows.

    ``state_outputs`` are ``(output position, variable leaf)`` pairs of model
    state the call returns updated (BatchNorm statistics): each stays on the
    stage that computes it (``StageFlow.updates``) instead of travelling to the
    last stage; an update equal to its input changes nothing and is dropped.
    """
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
    state_at = dict(state_outputs)  # output position → variable leaf
    kept = [k for k in range(len(jaxpr.outvars)) if k not in state_at]
    final = [jaxpr.outvars[k] for k in kept if not R.is_literal(jaxpr.outvars[k])]
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
        updates = tuple((jaxpr.outvars[k], i) for k, i in state_at.items()
                        if not R.is_literal(jaxpr.outvars[k]) and stage_of.get(jaxpr.outvars[k]) == s)  # fmt: skip
        used = list(live_inputs(eqns)) + (final if s == last else []) + [v for v, _ in updates]
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
        outbound = tuple(needs[s + 1]) if s < last else tuple(jaxpr.outvars[k] for k in kept)
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
                else tuple(out_layouts[k] for k in kept),
                updates=updates,
                update_layouts=tuple(out_layouts[k] for k, i in state_at.items()
                                     if (jaxpr.outvars[k], i) in updates),  # fmt: skip
                output_positions=tuple(kept) if s == last else (),
            )
        )
    return flows

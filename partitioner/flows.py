"""Per-stage data flows of a pipelined model, and the layout of every value. Pure.

A pipeline stage is a contiguous range of the model's equations
(:class:`~axonn_jax.partitioner.stages.Stage`). :func:`stage_flows` works out,
without devices, what each stage reads and sends: the parameters and model
arguments it uses, the activations that arrive from the previous stage
(``inbound``) and those it passes on (``outbound``, including values it only
forwards to a later stage). A parameter's cast/reshape chain is re-run by every
stage that uses it, so no parameter-derived value ever travels as an activation.

A stage that reads a stacked parameter (a scan over layers cut between stages,
:mod:`~axonn_jax.partitioner.scan_cuts`) only through slices of its layer
dim is given just those rows (``StageFlow.param_rows``): its slices are rewritten
to index the rows it holds, so it gathers, reads and differentiates its own
layers, not the whole stack.

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
from axonn_jax.partitioner.stages import is_layer_range, param_like_producers


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
    #: (parameter index, first row, end row): parameters this stage reads only through slices
    #: of their leading (layer) dim; it is given rows ``first:end`` of them, not the whole
    param_rows: tuple[tuple[int, int, int], ...] = ()

    def rows_of(self, i: int) -> tuple[int, int] | None:
        """The rows of parameter ``i`` this stage is given, or ``None`` (the whole parameter)."""
        for j, first, end in self.param_rows:
            if j == i:
                return first, end
        return None

    def param_shape(self, i: int, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of parameter ``i`` (whole: ``shape``) as this stage is given it."""
        rows = self.rows_of(i)
        return tuple(shape) if rows is None else (rows[1] - rows[0], *shape[1:])

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
                state_outputs: Sequence[tuple[int, int]] = (),
                param_storage: Sequence[Layout] = ()) -> list[StageFlow]:  # fmt: skip
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
        read_whole = set(final if s == last else ()) | {v for v, _ in updates}
        stage_eqns, rows = (prelude + eqns, ()) if len(stages) == 1 or not param_storage else \
            _layer_rows(prelude + eqns, params, param_storage, read_whole)  # fmt: skip
        flows.append(
            StageFlow(
                index=s,
                eqns=tuple(stage_eqns),
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
                param_rows=rows,
            )
        )
    return flows


def _layer_rows(eqns: list, params: dict, storage: Sequence[Layout], read_whole: set) -> tuple[list, tuple]:
    """``eqns`` with the layer slices of the parameters they read only through such slices
    rewritten to index rows ``first:end`` of them, and those ``(parameter, first, end)``.

    A parameter qualifies when every equation of the stage reading it is a ``slice`` of its
    leading dim alone (:func:`~axonn_jax.partitioner.stages.is_layer_range`), that dim is not
    split over the grid, and the stage does not also return it (``read_whole``).
    """
    readers: dict = {}
    for e in eqns:
        for v in e.invars:
            if not R.is_literal(v) and v in params:
                readers.setdefault(v, []).append(e)
    first_row: dict = {}
    rows = []
    for v, found in readers.items():
        i = params[v]
        if v in read_whole or not storage[i] or storage[i][0] or \
                not all(is_layer_range(e) and e.invars[0] is v for e in found):
            continue
        first = min(e.params["start_indices"][0] for e in found)
        end = max(e.params["limit_indices"][0] for e in found)
        if (first, end) != (0, v.aval.shape[0]):
            first_row[v] = first
            rows.append((i, first, end))
    shifted = [_shifted(e, first_row[e.invars[0]]) if e.invars and not R.is_literal(e.invars[0])
               and e.invars[0] in first_row else e for e in eqns]  # fmt: skip
    return shifted, tuple(sorted(rows))


def _shifted(eqn, first: int):
    """A layer ``slice`` indexing rows counted from ``first``."""
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    return eqn.replace(params={**eqn.params, "start_indices": (start[0] - first, *start[1:]),
                               "limit_indices": (limit[0] - first, *limit[1:])})  # fmt: skip

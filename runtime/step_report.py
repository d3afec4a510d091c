"""Report what one training step of a partitioned model communicates, keeps and computes.

The step is traced, not modelled: ``jax.make_jaxpr`` of ``jax.vjp`` of
:meth:`Partitioned.apply` (the forward pass and the residuals it keeps) and of
its pullback (the backward pass), on an ``AbstractMesh`` (no devices, so a
1,024-device grid is reported on a laptop). The jaxprs hold the very
``shard_map`` bodies the executor runs and their transposes, so walking them
finds every collective the kernels emit — all-gathers of the depth (z) split,
partial-sum reductions, relayout gathers, the gradient reductions that come
from marking values varying — with local shapes. Collectives of the user's
loss (outside the model, inserted by the compiler for the batch split) are
not part of the report.

Example:
    >>> report = step_report(plan, program, (tokens,), {})   # doctest: +SKIP
    >>> print(report.communication)                          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import AbstractMesh

from axonn_jax.partitioner.flops import ComputeReport, Flops, count
from axonn_jax.partitioner.grid import STAGE_AXES, Grid
from axonn_jax.partitioner.jaxprs import open_jaxpr, subjaxprs
from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.program import Program
from axonn_jax.partitioner.report import CommReport, MemoryReport, Transfer
from axonn_jax.partitioner.trace import abstract_call, bound_axis_names, call_leaves, is_static
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.sharded import apply_program

#: jaxpr primitive → HLO collective kind
_KINDS = {
    "psum": "all-reduce",
    "psum_invariant": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "ppermute": "collective-permute",
}
#: communicating primitives the walker does not price (it refuses rather than undercount)
_UNPRICED = {"ragged_all_to_all", "psend", "precv", "pbroadcast", "all_gather_reduced",
             "unreduced_psum", "unreduced_reduce_scatter"}  # fmt: skip
#: asynchronous halves (``psum_start`` / ``psum_done`` ...) are refused too
_ASYNC = {f"{name}_{half}" for name in (*_KINDS, *_UNPRICED) for half in ("start", "done")}


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Communication and memory of one training step, per device."""

    plan: Plan
    communication: CommReport
    memory: MemoryReport
    compute: ComputeReport

    def __str__(self) -> str:
        return (f"{self.plan}\n{self.plan.table()}\n\n{self.memory}\n\n{self.communication}"
                f"\n\n{self.compute}")


def abstract_stage_mesh(grid: Grid) -> AbstractMesh:
    """The ``(data, z, y, x)`` stage mesh of ``grid`` without devices."""
    return AbstractMesh(tuple(grid.stage_shape.values()), STAGE_AXES)


def step_report(plan: Plan, program: Program, args: tuple, kwargs: dict, *,
                overlap: Overlap = Overlap(), optimizer_slots: int = 2) -> StepReport:  # fmt: skip
    """Trace one training step of a planned model (one mesh) on ``args``/``kwargs``.

    The forward pass is traced as ``jax.vjp`` of the model (its outputs plus
    the residuals autodiff keeps), the backward pass as the pullback on those
    residuals: together exactly ``jax.value_and_grad`` of ``pm.apply``.

    Args:
        plan: the :class:`Plan` of a model that runs on one mesh.
        program: its :class:`Program` for these inputs.
        args, kwargs: model inputs (arrays or ``ShapeDtypeStruct``).
        overlap: the communication overlap the executor sets up.
        optimizer_slots: fp32 optimizer values per parameter element (2 for Adam).
    """
    grid = plan.grid
    args, kwargs = abstract_call(args, kwargs)
    mesh = abstract_stage_mesh(grid)

    def apply(p, a, k):
        arrays, _ = call_leaves(a, k)
        outs = apply_program(program, mesh, jax.tree.leaves(p), arrays, overlap=overlap)
        return jax.tree.unflatten(program.out_tree, outs)

    params = abstract_params(plan)
    fwd, bwd, residuals = _trace_step(apply, params, args, kwargs)
    saved = saved_bytes(fwd.jaxpr, num_params=len(plan.params), num_residuals=residuals)
    memory = MemoryReport.from_plan(
        plan, optimizer_slots=optimizer_slots, activations=saved.activations,
        gathered_weights=saved.weights,
    )  # fmt: skip
    communication = step_collectives(fwd, bwd)
    compute = ComputeReport(count(fwd) + count(bwd), plain_flops(plan, program, args, kwargs), grid.size)
    return StepReport(plan, communication, memory, compute)


def abstract_params(plan: Plan):
    """The parameter tree of ``plan`` as ``ShapeDtypeStruct`` (global shapes)."""
    return jax.tree.unflatten(plan.param_tree, [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in plan.params])


def plain_flops(plan: Plan, program: Program, args: tuple, kwargs: dict) -> Flops:
    """FLOPs of the plain model's forward and backward on one device (the redundancy's 1.00).

    The model as traced, before inlining and pipeline cuts (a scan split
    between stages accumulates its stacked gradients differently): the same
    count on every grid.
    """
    model = program.traced.jaxpr

    def plain(p, a, k):  # the model's own program, on one device
        arrays, _ = call_leaves(a, k)
        outs = jax.core.eval_jaxpr(model.jaxpr, model.consts, *jax.tree.leaves(p), *arrays)
        return jax.tree.unflatten(program.out_tree, outs)

    with bound_axis_names(program.traced.axis_names):  # the model's own pmean('batch') etc.
        fwd, bwd, _ = _trace_step(plain, abstract_params(plan), *abstract_call(args, kwargs))
    return count(fwd) + count(bwd)


def step_collectives(fwd, bwd) -> CommReport:
    """Every collective of a traced forward and backward pass (phases marked)."""
    backward = [dataclasses.replace(t, phase="backward") for t in collect(bwd.jaxpr.eqns)]
    return CommReport(tuple(collect(fwd.jaxpr.eqns) + backward))


def _trace_step(apply: Callable, params, args, kwargs):
    """``(forward jaxpr, backward jaxpr, number of residuals)`` of ``apply(params, args, kwargs)``.

    The forward pass is ``jax.vjp`` of the model (outputs and the residuals
    autodiff keeps), the backward pass the pullback on those residuals.
    """
    pullback_tree = {}
    call_tree = jax.tree.structure((args, kwargs))
    leaves = jax.tree.leaves((args, kwargs))
    static = {i: x for i, x in enumerate(leaves) if is_static(x)}  # baked in, not traced

    def forward(p, dynamic):
        values = iter(dynamic)
        a, k = jax.tree.unflatten(call_tree, [static[i] if i in static else next(values)
                                              for i in range(len(leaves))])  # fmt: skip
        out, pullback = jax.vjp(lambda q: apply(q, a, k), p)
        residuals, pullback_tree["tree"] = jax.tree.flatten(pullback)
        return out, residuals

    fwd, (out_shapes, residual_shapes) = jax.make_jaxpr(forward, return_shape=True)(
        params, [x for i, x in enumerate(leaves) if i not in static]
    )
    cotangents = jax.tree.map(cotangent, out_shapes)
    bwd = jax.make_jaxpr(lambda r, ct: jax.tree.unflatten(pullback_tree["tree"], r)(ct))(
        residual_shapes, cotangents
    )
    return without_dead_residuals(fwd, bwd, len(residual_shapes))


def without_dead_residuals(fwd, bwd, residuals: int) -> tuple:
    """``(fwd, bwd, residuals)`` without what the compiled step would not run either: the
    residuals ``bwd`` never reads and the work (collectives included) that only they needed
    (a split max's psum-ed counts, when the max is under ``stop_gradient`` in a softmax)."""
    from jax._src.interpreters import partial_eval as pe

    bwd_jaxpr, used = pe.dce_jaxpr(bwd.jaxpr, [True] * len(bwd.jaxpr.outvars), instantiate=True)
    keep = list(used[:residuals])
    outputs = len(fwd.jaxpr.outvars) - residuals
    fwd_jaxpr, _ = pe.dce_jaxpr(fwd.jaxpr, [True] * outputs + keep, instantiate=True)
    return (jex_core.ClosedJaxpr(fwd_jaxpr, fwd.consts), jex_core.ClosedJaxpr(bwd_jaxpr, bwd.consts), sum(keep))


def collect(eqns, sizes: Mapping[str, int] | None = None, times: int = 1) -> list[Transfer]:
    """Every collective in ``eqns`` and their sub-jaxprs (phase: "forward").

    ``sizes`` are the mesh axis sizes of the enclosing ``shard_map``; a
    ``scan`` multiplies the counts of its body by its length, a ``while`` loop
    counts one trip (as the FLOP count does: the trip count is not known before
    it runs), a ``cond`` its most communicating branch (the FLOP count: its
    most expensive one).
    """
    found: list[Transfer] = []
    for eqn in eqns:
        name = eqn.primitive.name
        if name in _UNPRICED or name in _ASYNC:
            raise NotImplementedError(
                f"collective primitive '{name}' in the traced step is not priced by the "
                "report. Remedy: report without it, or extend runtime/step_report.py."
            )
        if name in _KINDS:
            found.extend(_transfers(eqn, sizes or {}, times))
            continue
        inner_sizes = dict(eqn.params["mesh"].shape) if name == "shard_map" else sizes
        if name == "scan":
            body = open_jaxpr(eqn.params["jaxpr"]).eqns
            found.extend(collect(body, inner_sizes, times * eqn.params["length"]))
            continue
        if name == "cond":
            found.extend(_one_branch(eqn, inner_sizes, times))
            continue
        for sub in subjaxprs(eqn):  # a while loop's trip count is unknown: one trip counted
            found.extend(collect(sub.eqns, inner_sizes, times))
    return found


@dataclasses.dataclass(frozen=True)
class Saved:
    """Per-device bytes kept from the forward pass for the backward pass."""

    activations: int  # values that depend on the model inputs
    weights: int  # values computed from parameters only (e.g. depth-gathered weight blocks)


#: primitives that only retype a value (no new buffer)
_CASTS = {"pvary", "pcast"}
_PARAMS, _DATA, _CONST = "params", "data", "const"


def saved_bytes(jaxpr, *, num_params: int, num_residuals: int) -> Saved:
    """Per-device bytes of the residuals a traced forward pass hands to the backward.

    ``jaxpr`` maps ``(params..., inputs...)`` to ``(outputs..., residuals...)``
    with the last ``num_residuals`` outputs the residuals. A residual that is
    an input, or an input merely retyped (``pvary``) inside the ``shard_map``,
    is the input's own buffer and costs nothing; the others are counted once,
    at their local size, as *weights* when computed from parameters only and
    as *activations* otherwise.
    """
    kind: dict = {v: (_PARAMS if i < num_params else _DATA) for i, v in enumerate(jaxpr.invars)}
    alias = set(jaxpr.invars)
    local: dict = {}  # outer var -> the body var that holds its local shard
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            body = open_jaxpr(eqn.params["jaxpr"])
            for outer, inner in zip(eqn.invars, body.invars):
                kind[inner] = _kind_of([outer], kind)
                if _is_var(outer) and outer in alias:
                    alias.add(inner)
            _flow(body.eqns, kind, alias)
            for outer, inner in zip(eqn.outvars, body.outvars):
                kind[outer] = _kind_of([inner], kind)
                local[outer] = inner
                if _is_var(inner) and inner in alias:
                    alias.add(outer)
        else:
            _flow([eqn], kind, alias)
    activations = weights = 0
    residuals = {v for v in jaxpr.outvars[len(jaxpr.outvars) - num_residuals :] if _is_var(v)}
    for var in residuals - alias:
        aval = local.get(var, var).aval
        size = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
        if kind.get(var) == _PARAMS:
            weights += size
        else:
            activations += size
    return Saved(activations, weights)


def _flow(eqns, kind: dict, alias: set) -> None:
    """Propagate what each value is computed from, and which values are retyped inputs."""
    for e in eqns:
        k = _kind_of(e.invars, kind)
        for v in e.outvars:
            kind[v] = k
        if e.primitive.name in _CASTS and _is_var(e.invars[0]) and e.invars[0] in alias:
            alias.update(e.outvars)


def _kind_of(vars_, kind: dict) -> str:
    found = {kind.get(v, _CONST) for v in vars_ if _is_var(v)}
    return _DATA if _DATA in found else (_PARAMS if _PARAMS in found else _CONST)


def cotangent(shape: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    dtype = shape.dtype if jnp.issubdtype(shape.dtype, jnp.inexact) else jax.dtypes.float0
    return jax.ShapeDtypeStruct(shape.shape, dtype)


def _transfers(eqn, sizes: Mapping[str, int], times: int) -> list[Transfer]:
    kind = _KINDS[eqn.primitive.name]
    if eqn.params.get("axis_index_groups") is not None:
        raise NotImplementedError(f"'{eqn.primitive.name}' with axis_index_groups is not priced")
    raw = eqn.params.get("axes", eqn.params.get("axis_name"))
    raw = raw if isinstance(raw, tuple) else (raw,)
    axes = tuple(a for a in STAGE_AXES if a in raw and sizes.get(a, 1) > 1)
    if not axes:
        return []  # over size-1 axes only: moves nothing
    group = math.prod(sizes[a] for a in axes)
    return [
        Transfer(kind, axes, group, str(np.dtype(o.aval.dtype)), tuple(i.aval.shape),
                 tuple(o.aval.shape), "forward", times)  # fmt: skip
        for i, o in zip(eqn.invars, eqn.outvars)
    ]


def _one_branch(eqn, sizes, times) -> list[Transfer]:
    """The collectives of the branch that sends the most (an upper bound on what runs)."""
    branches = [collect(open_jaxpr(b).eqns, sizes, times) for b in eqn.params["branches"]]
    return max(branches, key=lambda found: sum(t.wire_bytes for t in found))


def _is_var(v) -> bool:
    return not isinstance(v, jex_core.Literal)

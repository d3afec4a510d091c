"""Sharding rules, one per primitive. Pure: layouts in, decisions out.

A rule sees one jaxpr equation and the layouts of its operands (``None`` for
an operand that comes from a parameter whose layout is not decided yet) and
returns a :class:`Step`: the layout each operand must have (the executor
relayouts operands that differ: slicing a replicated dim is free, un-sharding
a dim is an all-gather), the layout of each output, the cross-device
reductions to apply to each output, and the equation's parameters rewritten
for local shapes.

The same rules drive the planner (which decides parameter layouts from the
targets it is asked for) and the executor (which runs them inside
``shard_map``), so the plan and the program cannot disagree.

Any primitive without a rule falls back to full replication of its operands:
always exact, possibly slow, and listed as a warning in the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from axonn_jax.partitioner.grid import BATCH_AXES, X, Y, Grid
from axonn_jax.partitioner.jaxprs import CONTROL_FLOW
from axonn_jax.partitioner.layout import (
    Layout,
    common_prefix,
    divides,
    factor,
    local_shape,
    merge,
    replicated,
    used_axes,
    without,
)


@dataclasses.dataclass
class Step:
    """What to do for one equation."""

    targets: list[Layout | None]  # per operand; None for literals
    outs: list[Layout]
    reduce: list[tuple[str, ...]]  # per output: mesh axes to psum over (empty: none)
    params: dict[str, Any]
    fallback: str = ""  # non-empty: why this equation was replicated
    layer: tuple[str, str] | None = None  # (in_axis, out_axis) for a matmul with a weight
    #: per output: the dim its reduction is scattered onto (reduce-scatter), or None (psum)
    scatter: list[int | None] | None = None
    #: non-empty: the runtime computes this equation with its local kernel of that name
    #: (``runtime/local_ops``) instead of binding the primitive on the local shards
    local: str = ""
    #: control flow: how each body runs (``partitioner.control_flow.LoopLayouts``)
    loop: Any = None


ELEMENTWISE = frozenset(
    """add sub mul div rem pow max min atan2 nextafter and or xor not neg sign floor ceil
    round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos atan sinh
    cosh asinh acosh atanh sqrt rsqrt cbrt abs integer_pow square erf erfc erf_inv lgamma
    digamma convert_element_type select_n clamp eq ne lt le gt ge copy copy_p
    reduce_precision real imag conj shift_left shift_right_logical shift_right_arithmetic
    population_count clz imag stop_gradient optimization_barrier""".split()
)
PASS_THROUGH = frozenset(["sharding_constraint", "mesh_cast", "pvary", "pcast", "name"])
#: calls the inliner keeps only when pointwise (partitioner.pointwise): elementwise as a whole
POINTWISE_CALLS = frozenset(["custom_jvp_call"])
#: ops whose output is a parameter's value in another shape (planning follows them)
LAYOUT_PRESERVING = frozenset(["convert_element_type", "copy", "copy_p", "reduce_precision",
                               "transpose", "broadcast_in_dim", "squeeze", "reshape",
                               "slice"])  # a slice's cut dims are whole; the others keep theirs
REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}
NEEDS_WHOLE_AXIS = {
    "argmax": "axes",
    "argmin": "axes",
    "reduce_prod": "axes",
    "reduce_and": "axes",
    "reduce_or": "axes",
    "reduce_xor": "axes",
    "cumsum": "axis",
    "cumprod": "axis",
    "cummax": "axis",
    "cummin": "axis",
    "cumlogsumexp": "axis",
    "sort": "dimension",
    "rev": "dimensions",
    "top_k": "axis",
}


class Context:
    """Grid and options the rules consult."""

    def __init__(self, grid: Grid, *, scatter_batch: bool = True,
                 random_layouts: Mapping[Any, Layout] | None = None,
                 stacked: Mapping[Any, frozenset] | None = None):  # fmt: skip
        self.grid = grid
        #: reduce-scatter layer outputs onto the batch dim (see _scatter_onto_batch)
        self.scatter_batch = scatter_batch
        #: the layout of each ``random_bits`` output (keyed by its jaxpr variable): that of
        #: the activation the bits mask, as the planner found it (propagation._Walk)
        self.random_layouts = dict(random_layouts or {})
        #: per ``dot_general`` output variable, its dims taken apart later (stacked k|v,
        #: fused qkv: partitioner.stacking); the planner splits another weight dim
        self.stacked = dict(stacked or {})

    def local(self, shape, layout: Layout) -> tuple[int, ...]:
        return local_shape(shape, layout, self.grid)


def shape_of(var) -> tuple[int, ...]:
    return tuple(getattr(var.aval, "shape", ()))


def is_literal(var) -> bool:
    return not hasattr(var, "count") and hasattr(var, "val")


def rule(eqn, layouts: list[Layout | None], ctx: Context) -> Step:
    """Dispatch to the rule of ``eqn.primitive`` (or the replicate fallback)."""
    name = eqn.primitive.name
    if name in ELEMENTWISE or name in PASS_THROUGH or name in POINTWISE_CALLS:
        return elementwise(eqn, layouts, ctx)
    handler = _RULES.get(name)
    if handler is not None:
        return handler(eqn, layouts, ctx)
    if name in CONTROL_FLOW:  # bodies walked with these rules (partitioner.control_flow)
        from axonn_jax.partitioner import control_flow

        return control_flow.rule(eqn, layouts, ctx)
    if name in REDUCTIONS:
        return reduction(eqn, layouts, ctx)
    if name in NEEDS_WHOLE_AXIS:
        return whole_axis(eqn, layouts, ctx, NEEDS_WHOLE_AXIS[name])
    return replicate(eqn, f"no sharding rule for primitive '{name}'")


def replicate(eqn, why: str) -> Step:
    """Fallback: every operand and output fully replicated. Always exact."""
    return Step(
        targets=[None if is_literal(v) else replicated(len(shape_of(v))) for v in eqn.invars],
        outs=[replicated(len(shape_of(v))) for v in eqn.outvars],
        reduce=[()] * len(eqn.outvars),
        params=dict(eqn.params),
        fallback=why,
    )


def _operands(eqn, layouts):
    """(index, layout) of non-literal operands with rank > 0."""
    return [
        (i, lay)
        for i, (v, lay) in enumerate(zip(eqn.invars, layouts))
        if not is_literal(v) and shape_of(v)
    ]


def elementwise(eqn, layouts, ctx) -> Step:
    """Operands share one layout; dims an operand broadcasts (size 1) stay unsharded."""
    out_shape = shape_of(eqn.outvars[0])
    out_ndim = len(out_shape)
    full = [
        _unbroadcast(lay, shape_of(eqn.invars[i]), out_shape)
        for i, lay in _operands(eqn, layouts)
        if lay is not None and len(lay) == out_ndim
    ]
    target = merge(full) if full else replicated(out_ndim)
    targets = []
    for v in eqn.invars:
        if is_literal(v):
            targets.append(None)
        elif len(shape_of(v)) == out_ndim:
            targets.append(_unbroadcast(target, shape_of(v), out_shape))
        else:  # scalar operand (e.g. the predicate or a bound of clamp)
            targets.append(replicated(len(shape_of(v))))
    return Step(targets, [target] * len(eqn.outvars), [()] * len(eqn.outvars), dict(eqn.params))


def _unbroadcast(layout: Layout, shape, out_shape) -> Layout:
    """``layout`` with the dims that ``shape`` broadcasts (1 → n) unsharded."""
    return tuple(() if s == 1 and o != 1 else a for a, s, o in zip(layout, shape, out_shape))


def broadcast_in_dim(eqn, layouts, ctx) -> Step:
    (operand,) = eqn.invars[:1]
    lay = layouts[0] if layouts[0] is not None else replicated(len(shape_of(operand)))
    out_shape = eqn.params["shape"]
    dims = eqn.params["broadcast_dimensions"]
    in_shape = shape_of(operand)
    out: list[tuple[str, ...]] = [()] * len(out_shape)
    for src, dst in enumerate(dims):
        if in_shape[src] == out_shape[dst]:
            out[dst] = lay[src]
    out_layout = tuple(out)
    params = dict(eqn.params, shape=ctx.local(out_shape, out_layout), sharding=None)
    targets = [lay] + [replicated(len(shape_of(v))) for v in eqn.invars[1:]]
    return Step(targets, [out_layout], [()], params)


def reshape_groups(in_shape, out_shape):
    """Pair up dims of equal product: [(in_dims, out_dims), ...], size-1 dims dropped."""
    ins = [i for i, s in enumerate(in_shape) if s != 1]
    outs = [o for o, s in enumerate(out_shape) if s != 1]
    groups, i, o = [], 0, 0
    while i < len(ins) or o < len(outs):
        gi, go = [ins[i]] if i < len(ins) else [], [outs[o]] if o < len(outs) else []
        pi = in_shape[gi[0]] if gi else 1
        po = out_shape[go[0]] if go else 1
        i, o = i + bool(gi), o + bool(go)
        while pi != po:
            if pi < po and i < len(ins):
                pi *= in_shape[ins[i]]
                gi.append(ins[i])
                i += 1
            elif po < pi and o < len(outs):
                po *= out_shape[outs[o]]
                go.append(outs[o])
                o += 1
            else:
                return None
        groups.append((gi, go))
    return groups


def reshape(eqn, layouts, ctx) -> Step:
    operand = eqn.invars[0]
    in_shape, out_shape = shape_of(operand), tuple(eqn.params["new_sizes"])
    lay = layouts[0] if layouts[0] is not None else replicated(len(in_shape))
    groups = reshape_groups(in_shape, out_shape)
    if eqn.params.get("dimensions") is not None or groups is None:
        return replicate(eqn, "reshape with a dimension permutation")
    target = list(lay)
    out: list[tuple[str, ...]] = [()] * len(out_shape)
    for gi, go in groups:
        if not gi or not go:
            continue
        major = lay[gi[0]]
        for d in gi[1:]:
            target[d] = ()  # only the major dim of a merged group can stay sharded
        if major and divides(out_shape[go[0]], major, ctx.grid):
            out[go[0]] = major
        else:
            target[gi[0]] = ()
    out_layout = tuple(out)
    params = dict(eqn.params, new_sizes=ctx.local(out_shape, out_layout), sharding=None)
    return Step([tuple(target)], [out_layout], [()], params)


def transpose(eqn, layouts, ctx) -> Step:
    lay = layouts[0] if layouts[0] is not None else replicated(len(shape_of(eqn.invars[0])))
    perm = eqn.params["permutation"]
    return Step([lay], [tuple(lay[p] for p in perm)], [()], dict(eqn.params))


def squeeze(eqn, layouts, ctx) -> Step:
    lay = layouts[0] if layouts[0] is not None else replicated(len(shape_of(eqn.invars[0])))
    dims = {d % len(lay) for d in eqn.params["dimensions"]}
    target = without(lay, dims)
    return Step([target], [tuple(a for d, a in enumerate(target) if d not in dims)], [()],
                dict(eqn.params))  # fmt: skip


def reduction(eqn, layouts, ctx) -> Step:
    lay = layouts[0] if layouts[0] is not None else replicated(len(shape_of(eqn.invars[0])))
    axes = set(eqn.params["axes"])
    kind = REDUCTIONS[eqn.primitive.name]
    reduced = tuple(a for d in sorted(axes) for a in lay[d])
    out = tuple(a for d, a in enumerate(lay) if d not in axes)
    if kind == "sum":
        return Step([lay], [out], [reduced], dict(eqn.params))
    if not any(ctx.grid.axis_size(a) > 1 for a in reduced):
        return whole_axis(eqn, layouts, ctx, "axes")
    # max/min over split dims (a softmax's max over vocabulary-split logits): the local
    # extremum combined over the dims' axes, with JAX's derivative (local kernel)
    return Step([lay], [out], [()], dict(eqn.params), local="split_extremum")


def whole_axis(eqn, layouts, ctx, key) -> Step:
    """Ops that need a whole dim locally (sort, cumsum, argmax, top_k, ...): un-shard it."""
    ndim = len(shape_of(eqn.invars[0]))
    value = eqn.params[key]
    return _whole_dims(eqn, layouts, {d % ndim for d in (value if isinstance(value, (tuple, list)) else (value,))})


def fft(eqn, layouts, ctx) -> Step:
    """An FFT over the last ``len(fft_lengths)`` dims (a Fourier layer's spectrum): those dims
    whole, the others (the batch's, the channels') keep their split."""
    ndim = len(shape_of(eqn.invars[0]))
    return _whole_dims(eqn, layouts, set(range(ndim - len(eqn.params["fft_lengths"]), ndim)))


def _whole_dims(eqn, layouts, dims: set) -> Step:
    """Operand 0 whole over ``dims``, other dims as laid out; outputs of its rank likewise
    (those of a lower rank drop ``dims``)."""
    operand = eqn.invars[0]
    ndim = len(shape_of(operand))
    lay = layouts[0] if layouts[0] is not None else replicated(ndim)
    target = without(lay, dims)
    outs = []
    for v in eqn.outvars:
        if len(shape_of(v)) == ndim:
            outs.append(target)
        else:
            outs.append(tuple(a for d, a in enumerate(target) if d not in dims))
    targets = [target] + [
        None if is_literal(v) else (target if len(shape_of(v)) == ndim else replicated(len(shape_of(v))))
        for v in eqn.invars[1:]
    ]  # fmt: skip
    return Step(targets, outs, [()] * len(outs), dict(eqn.params))


def concatenate(eqn, layouts, ctx) -> Step:
    dim = eqn.params["dimension"]
    full = [lay for _, lay in _operands(eqn, layouts) if lay is not None]
    target = without(merge(full), {dim}) if full else replicated(len(shape_of(eqn.outvars[0])))
    return Step([target] * len(eqn.invars), [target], [()], dict(eqn.params))


def slice_(eqn, layouts, ctx) -> Step:
    shape = shape_of(eqn.invars[0])
    lay = layouts[0] if layouts[0] is not None else replicated(len(shape))
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params.get("strides") or (1,) * len(shape)
    cut = {d for d in range(len(shape)) if (start[d], limit[d], strides[d]) != (0, shape[d], 1)}
    target = without(lay, cut)
    local = ctx.local(shape, target)
    params = dict(eqn.params, limit_indices=tuple(
        local[d] if d not in cut else limit[d] for d in range(len(shape))))  # fmt: skip
    return Step([target], [target], [()], params)


def pad(eqn, layouts, ctx) -> Step:
    shape = shape_of(eqn.invars[0])
    lay = layouts[0] if layouts[0] is not None else replicated(len(shape))
    padded = {d for d, cfg in enumerate(eqn.params["padding_config"]) if tuple(cfg) != (0, 0, 0)}
    target = without(lay, padded)
    return Step([target, ()], [target], [()], dict(eqn.params))


def dynamic_slice(eqn, layouts, ctx) -> Step:
    shape = shape_of(eqn.invars[0])
    lay = layouts[0] if layouts[0] is not None else replicated(len(shape))
    sizes = eqn.params["slice_sizes"]
    target = without(lay, {d for d in range(len(shape)) if sizes[d] != shape[d]})
    params = dict(eqn.params, slice_sizes=ctx.local(sizes, target))
    targets = [target] + [() for _ in eqn.invars[1:]]
    return Step(targets, [target], [()], params)


def dynamic_update_slice(eqn, layouts, ctx) -> Step:
    shape, update = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    known = [lay for lay in layouts[:2] if lay is not None]
    lay = merge(known) if known else replicated(len(shape))
    target = without(lay, {d for d in range(len(shape)) if update[d] != shape[d]})
    return Step([target, target] + [() for _ in eqn.invars[2:]], [target], [()], dict(eqn.params))


#: key-sized PRNG operations: run on every device (a key is a few words; exact by construction)
KEY_PRIMITIVES = frozenset(["random_seed", "random_wrap", "random_unwrap", "random_fold_in",
                            "random_split", "threefry2x32", "random_clone"])  # fmt: skip


def random_keys(eqn, layouts, ctx) -> Step:
    """PRNG key arithmetic: replicated, like a scalar (no fallback: nothing is repeated)."""
    return replicate(eqn, "")


def random_bits(eqn, layouts, ctx) -> Step:
    """Random bits: each device draws only its block, split like the activation they mask.

    The layout is the planner's (``ctx.random_layouts``: the activation the bits
    meet first, every split dim included); without one, dim 0 is split over the
    batch axes. With JAX's partitionable threefry a bit depends on the key and
    its global index only, so the runtime (:mod:`axonn_jax.runtime.random_bits`)
    draws exactly the plain model's bits for the local block.
    """
    shape = tuple(eqn.params["shape"])
    key_ndim = len(shape_of(eqn.invars[0]))
    out = [()] * (key_ndim + len(shape))
    if key_ndim == 0 and eqn.outvars[0] in ctx.random_layouts:
        out = list(ctx.random_layouts[eqn.outvars[0]])
    elif key_ndim == 0 and shape and divides(shape[0], BATCH_AXES, ctx.grid):
        out[0] = BATCH_AXES
    live = any(ctx.grid.axis_size(a) > 1 for a in used_axes(tuple(out)))
    return Step([replicated(key_ndim)], [tuple(out)], [()], dict(eqn.params),
                local="random_bits" if live else "")  # fmt: skip


#: collectives a model may call over its own axis names (partitioner.trace binds them),
#: and the parameter naming those axes
COLLECTIVE_AXES = {"psum": "axes", "pmax": "axes", "pmin": "axes", "ppermute": "axis_name",
                   "all_gather": "axis_name", "axis_index": "axis_name"}  # fmt: skip


def model_collective(eqn, layouts, ctx) -> Step:
    """A collective over the model's own axis names (``pmean(x, 'batch')``): the identity.

    The model is traced with those names bound with size 1 over the whole batch
    (:func:`~axonn_jax.partitioner.trace.bound_axis_names`), where a collective
    is the identity; the statistics it would combine across devices (a
    ``BatchNorm(axis_name='batch')`` mean) are global already, the reductions
    over a split batch being reduced over its axes. Local kernel
    ``"model_collective"``: never a reduction over the mesh.
    """
    targets = [None if is_literal(v) else (lay if lay is not None else replicated(len(shape_of(v))))
               for v, lay in zip(eqn.invars, layouts)]  # fmt: skip
    if eqn.primitive.name == "axis_index":
        outs = [()]
    elif eqn.primitive.name == "all_gather" and not eqn.params["tiled"]:
        dim = eqn.params["all_gather_dimension"]
        outs = [targets[0][:dim] + ((),) + targets[0][dim:]]
    else:
        outs = [t if t is not None else () for t in targets]
    return Step(targets, outs, [()] * len(outs), dict(eqn.params), local="model_collective")


#: collectives over a model's own axis names that have no rule (their axis parameter)
OTHER_COLLECTIVES = {"all_to_all": "axis_name", "reduce_scatter": "axis_name"}


def unsupported_collective(eqn, layouts, ctx) -> Step:
    """Refuse a collective over the model's own axis that has no one-device meaning here."""
    axes = eqn.params[OTHER_COLLECTIVES[eqn.primitive.name]]
    raise ValueError(
        f"the model calls {eqn.primitive.name} over its own axis {axes!r} (written for pmap or "
        f"shard_map); on {ctx.grid} only psum/pmean/pmax/pmin/ppermute/all_gather/axis_index over "
        "a model's own axes are planned (as on one device, over the whole batch). Remedy: write "
        "the model for one device (the partitioner splits the batch itself), or use those "
        "collectives."
    )


def bitcast_convert_type(eqn, layouts, ctx) -> Step:
    """Same-width bitcasts (random bits → floats) are elementwise; others change the rank."""
    if len(shape_of(eqn.invars[0])) == len(shape_of(eqn.outvars[0])):
        return elementwise(eqn, layouts, ctx)
    return replicate(eqn, "bitcast between types of different widths")


def iota(eqn, layouts, ctx) -> Step:
    return Step([], [replicated(len(shape_of(eqn.outvars[0])))], [()], dict(eqn.params))


def gather(eqn, layouts, ctx) -> Step:
    """Row lookups (embeddings): ``operand[indices]`` along leading collapsed dims.

    Vocabulary-parallel: a dim looked up one row at a time may stay split (an
    undecided table gets its rows over x); each device looks up the rows it
    holds, zeroes the others, and the partial results are summed over the rows'
    axes (local kernel ``"sharded_lookup"``). Other looked-up dims are un-split.
    The remaining operand dims keep their layout (an undecided table gets its
    first kept dim over y, the input axis of the next, normal, layer) and the
    batch dims follow the indices.
    """
    operand, indices = eqn.invars[:2]
    dn = eqn.params["dimension_numbers"]
    op_shape, idx_shape = shape_of(operand), shape_of(indices)
    out_ndim = len(shape_of(eqn.outvars[0]))
    if len(idx_shape) == 0:
        return replicate(eqn, "gather with scalar indices")
    looked_up = set(dn.collapsed_slice_dims) | set(dn.start_index_map)
    sizes = eqn.params["slice_sizes"]
    if any(sizes[d] not in (1, op_shape[d]) for d in looked_up):
        return replicate(eqn, "gather of partial windows")
    rows = {d for d in dn.start_index_map if d in dn.collapsed_slice_dims and sizes[d] == 1}
    batching = set(dn.operand_batching_dims)
    kept = [d for d in range(len(op_shape)) if d not in dn.collapsed_slice_dims and d not in batching]
    idx_lay = layouts[1] if layouts[1] is not None else replicated(len(idx_shape))
    idx_target = without(idx_lay, {len(idx_shape) - 1})
    if layouts[0] is None:
        op_lay = [()] * len(op_shape)
        for d in kept:
            if d not in looked_up and divides(op_shape[d], (Y,), ctx.grid):
                op_lay[d] = (Y,)
                break
        if len(rows) == 1 and X not in used_axes(idx_target):
            (row,) = rows
            if divides(op_shape[row], (X,), ctx.grid):
                op_lay[row] = (X,)
        op_target = tuple(op_lay)
    else:
        op_target = without(layouts[0], looked_up - rows)
    op_target, idx_target = _pair_batching_dims(op_target, idx_target, dn.operand_batching_dims,
                                                dn.start_indices_batching_dims)  # fmt: skip
    clash = used_axes(idx_target) & {a for d, axes in enumerate(op_target) if d not in batching
                                     for a in axes}  # fmt: skip
    if clash and layouts[0] is not None:
        # an activation looked up by batch-split indices (a graph's nodes[senders]): gather the
        # table's clashing axes, so each device looks up its own share of the indices
        op_target = tuple(axes if d in batching else tuple(a for a in axes if a not in clash)
                          for d, axes in enumerate(op_target))  # fmt: skip
    elif clash:
        idx_target = replicated(len(idx_shape))
        op_target = tuple(() if d in batching else axes for d, axes in enumerate(op_target))
    out: list[tuple[str, ...]] = [()] * out_ndim
    batch_out = [d for d in range(out_ndim) if d not in dn.offset_dims]
    for out_dim, idx_dim in zip(batch_out, range(len(idx_shape) - 1)):
        out[out_dim] = idx_target[idx_dim]
    for out_dim, op_dim in zip(dn.offset_dims, kept):
        out[out_dim] = op_target[op_dim]
    reduce = tuple(a for d in sorted(rows) for a in op_target[d])
    live = any(ctx.grid.axis_size(a) > 1 for a in reduce)
    local_sizes = ctx.local(sizes, op_target)
    params = dict(eqn.params, slice_sizes=tuple(1 if d in rows or d in batching else n
                                                for d, n in enumerate(local_sizes)))  # fmt: skip
    return Step([op_target, idx_target], [tuple(out)], [reduce], params,
                local="sharded_lookup" if live else "")  # fmt: skip


def _pair_batching_dims(op: Layout, idx: Layout, op_dims, idx_dims) -> tuple[Layout, Layout]:
    """Operand and index batching dims (``vmap``, ``take_along_axis``) split alike.

    Each pair takes the longer split when one extends the other (a batch
    reduce-scattered further over a tensor axis), else the indices', else the
    operand's: both sides then hold the same block of the batch and look up locally.
    """
    op, idx = list(op), list(idx)
    for o, i in zip(op_dims, idx_dims):
        longer, shorter = sorted([op[o], idx[i]], key=len, reverse=True)
        axes = longer if common_prefix(longer, shorter) == shorter else (idx[i] or op[o])
        if set(axes) & ({a for d, ax in enumerate(idx) if d != i for a in ax}
                        | {a for d, ax in enumerate(op) if d != o for a in ax}):  # fmt: skip
            axes = ()
        op[o] = idx[i] = axes
    return tuple(op), tuple(idx)


def scatter_add(eqn, layouts, ctx) -> Step:
    """``operand.at[indices].add(updates)`` and ``segment_sum``: each device adds its own updates.

    The updates' scatter dims keep the indices' (batch) split and their window
    dims keep their features' split, shared with the operand; the scattered
    operand dims are whole on each device, which adds its share of the updates
    into them (the operand itself on one device of the reduced axes only:
    local kernel ``"scatter_add_once"``). The partial sums are then reduce-
    scattered onto the first scattered dim (a graph's nodes or graphs come out
    split over the batch axes like its edges), or all-reduced when the axes do
    not divide it.
    """
    operand, indices, updates = eqn.invars[:3]
    dn = eqn.params["dimension_numbers"]
    found = _scatter_layouts(eqn, layouts, ctx)
    if isinstance(found, Step):
        return found
    op_target, idx_target, upd_target = found
    reduce = tuple(a for axes in idx_target for a in axes)
    live = tuple(a for a in reduce if ctx.grid.axis_size(a) > 1)
    out, onto = list(op_target), None
    row = summed_onto(eqn)
    if live and row is not None and divides(shape_of(operand)[row], reduce, ctx.grid):
        out[row], onto = reduce, row
    return Step([op_target, idx_target, upd_target] + [None] * (len(eqn.invars) - 3), [tuple(out)],
                [reduce], dict(eqn.params), scatter=[onto],
                local="scatter_add_once" if live else "")  # fmt: skip


def summed_onto(eqn) -> int | None:
    """The operand dim a scatter-add's partial sums are reduce-scattered onto where the
    reduced axes divide it (:func:`scatter_add`): its first scattered dim, a graph's nodes.
    None for other equations, and for a scatter-add without scattered dims."""
    if _RULES.get(eqn.primitive.name) is not scatter_add:
        return None
    dims = eqn.params["dimension_numbers"].scatter_dims_to_operand_dims
    return dims[0] if dims else None


def scatter(eqn, layouts, ctx) -> Step:
    """``operand.at[indices].set(updates)``: every device writes all the indices into its block.

    Writes do not add up, so the indices and the updates' scatter dims are
    whole (gathered); window dims keep their split, shared with the operand.
    """
    found = _scatter_layouts(eqn, layouts, ctx)
    if isinstance(found, Step):
        return found
    op_target, idx_target, upd_target = found
    if used_axes(idx_target):
        idx_target = replicated(len(idx_target))
        dn = eqn.params["dimension_numbers"]
        upd_target = tuple(axes if d in dn.update_window_dims else ()
                           for d, axes in enumerate(upd_target))  # fmt: skip
    return Step([op_target, idx_target, upd_target] + [None] * (len(eqn.invars) - 3), [op_target],
                [()], dict(eqn.params))  # fmt: skip


def _scatter_layouts(eqn, layouts, ctx):
    """``(operand, indices, updates)`` targets of a scatter, or the replicate Step."""
    operand, indices, updates = eqn.invars[:3]
    dn = eqn.params["dimension_numbers"]
    op_shape, idx_shape, upd_shape = shape_of(operand), shape_of(indices), shape_of(updates)
    if dn.operand_batching_dims or not idx_shape or len(eqn.outvars) != 1:
        return replicate(eqn, f"{eqn.primitive.name} with batching dims or scalar indices")
    idx = list(without(_known(layouts[1], idx_shape), {len(idx_shape) - 1}))
    upd = list(_known(layouts[2], upd_shape))
    op_known = _known(layouts[0], op_shape)
    scatter_dims = [d for d in range(len(upd_shape)) if d not in dn.update_window_dims]
    for u, i in zip(scatter_dims, range(len(idx_shape) - 1)):
        upd[u] = idx[i] = upd[u] or idx[i]
    scattered = set(dn.inserted_window_dims) | set(dn.scatter_dims_to_operand_dims)
    windows = [d for d in range(len(op_shape)) if d not in dn.inserted_window_dims]
    batch_axes = {a for axes in idx for a in axes}
    op: list[tuple[str, ...]] = [()] * len(op_shape)
    for u, o in zip(dn.update_window_dims, windows):
        axes = upd[u] or op_known[o]
        whole = o in scattered or upd_shape[u] != op_shape[o] or set(axes) & batch_axes
        op[o] = upd[u] = () if whole else axes
    return tuple(op), tuple(idx), tuple(upd)


def _known(layout, shape) -> Layout:
    return layout if layout is not None else replicated(len(shape))


def split(eqn, layouts, ctx) -> Step:
    """``jnp.split``: pieces along a split dim keep its split (head-parallel fused qkv).

    The split dim is gathered (as a whole-axis op would) and each device keeps
    its block of every piece (local kernel ``"split_pieces"``), so what follows
    a fused projection (attention heads) stays split. Pieces whose size the
    axes do not divide come out unsplit along that dim.
    """
    shape = shape_of(eqn.invars[0])
    lay = layouts[0] if layouts[0] is not None else replicated(len(shape))
    axis = eqn.params["axis"] % len(shape)
    target = without(lay, {axis})
    axes = lay[axis]
    keep = bool(axes) and all(divides(size, axes, ctx.grid) for size in eqn.params["sizes"])
    outs = [tuple(axes if keep and d == axis else a for d, a in enumerate(target))
            for _ in eqn.outvars]  # fmt: skip
    live = keep and any(ctx.grid.axis_size(a) > 1 for a in axes)
    return Step([target], outs, [()] * len(outs), dict(eqn.params),
                local="split_pieces" if live else "")  # fmt: skip


def stack(eqn, layouts, ctx) -> Step:
    """``jnp.stack``: operands share one layout; the new dim is unsplit."""
    axis = eqn.params["axis"]
    full = [lay for _, lay in _operands(eqn, layouts) if lay is not None]
    ndim = len(shape_of(eqn.invars[0]))
    target = merge(full) if full else replicated(ndim)
    targets = [None if is_literal(v) else target for v in eqn.invars]
    return Step(targets, [target[:axis] + ((),) + target[axis:]], [()], dict(eqn.params))


def tile(eqn, layouts, ctx) -> Step:
    """``jnp.tile``: dims repeated more than once are unsplit; the others keep their split."""
    shape = shape_of(eqn.invars[0])
    lay = layouts[0] if layouts[0] is not None else replicated(len(shape))
    reps = tuple(eqn.params["reps"])
    lead = len(reps) - len(shape)  # tile may add leading dims
    target = without(lay, {d for d in range(len(shape)) if reps[lead + d] != 1})
    return Step([target], [((),) * lead + target], [()], dict(eqn.params))


def dot_general(eqn, layouts, ctx) -> Step:
    """Matmuls: the 4D layer when one side is a weight, consistent sharding otherwise."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    lshape, rshape = shape_of(lhs), shape_of(rhs)
    llay, rlay = layouts
    layer = None
    if llay is None and rlay is None:
        llay, rlay = replicated(len(lshape)), replicated(len(rshape))
    elif llay is None or rlay is None:
        weight_is_rhs = rlay is None
        act_lay = llay if weight_is_rhs else rlay
        act_c, w_c = (lc, rc) if weight_is_rhs else (rc, lc)
        act_b, w_b = (lb, rb) if weight_is_rhs else (rb, lb)
        w_shape = rshape if weight_is_rhs else lshape
        act_shape = lshape if weight_is_rhs else rshape
        act_lay, w_lay, layer = _layer_layouts(
            act_lay, act_shape, act_c, act_b, w_shape, w_c, w_b, ctx,
            stacked=_stacked_weight_dims(eqn, weight_is_rhs, ctx),
        )
        llay, rlay = (act_lay, w_lay) if weight_is_rhs else (w_lay, act_lay)
    llay, rlay = _consistent(llay, rlay, lc, rc, lb, rb)
    reduce_axes = tuple(a for d in lc for a in llay[d])
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]
    out = [llay[d] for d in lb] + [llay[d] for d in lfree] + [rlay[d] for d in rfree]
    out_shape = shape_of(eqn.outvars[0])
    scatter = _scatter_onto_batch(out, out_shape, reduce_axes, ctx)
    return Step([llay, rlay], [tuple(out)], [reduce_axes], dict(eqn.params), layer=layer,
                scatter=[scatter])  # fmt: skip


def _stacked_weight_dims(eqn, weight_is_rhs: bool, ctx) -> frozenset:
    """The weight's free dims whose output dims are taken apart later (``ctx.stacked``)."""
    taken = ctx.stacked.get(eqn.outvars[0], frozenset())
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lfree = [d for d in range(len(shape_of(eqn.invars[0]))) if d not in lc and d not in lb]
    rfree = [d for d in range(len(shape_of(eqn.invars[1]))) if d not in rc and d not in rb]
    first, free = (len(lb) + len(lfree), rfree) if weight_is_rhs else (len(lb), lfree)
    return frozenset(d for i, d in enumerate(free) if first + i in taken)


def _output_features(free: list[int], shape, axis: str, stacked: frozenset, ctx) -> int:
    """The weight dim split over the layer's output axis: the first free dim the axis
    divides that is not a stack dim (k|v, fused qkv), else the first it divides."""
    for pool in ([d for d in free if d not in stacked], free):
        for d in pool:
            if divides(shape[d], (axis,), ctx.grid):
                return d
    return free[0]


def _scatter_onto_batch(out: list, out_shape, reduce_axes, ctx) -> int | None:
    """Reduce-scatter a matmul's partial sums onto its batch dim instead of all-reducing them.

    When an output dim is split over the batch axes (else: the leading dim, if
    unsplit) and the reduced axes divide it further, the partial sums are reduce-
    scattered onto it (it gains the reduced axes, minor). Same bytes as
    the all-reduce, and what follows up to the next layer — norms, residual
    adds, attention, activations — runs on a 1/(reduced axes) share of the
    batch instead of repeating over them; the next layer gathers them back
    (sequence parallelism, applied to the batch dim). Returns the scattered dim.
    """
    live = tuple(a for a in reduce_axes if ctx.grid.axis_size(a) > 1)
    if not ctx.scatter_batch or not live or not out or set(live) & used_axes(tuple(out)):
        return None
    # the batch dim: the one split over the batch axes (a weight on the left of an einsum puts
    # its own dims first), else an unsplit leading dim
    dim = next((d for d, axes in enumerate(out) if axes[:len(BATCH_AXES)] == BATCH_AXES), 0)
    if set(out[dim]) - set(BATCH_AXES):
        return None
    wider = tuple(a for a in BATCH_AXES if a in out[dim]) + live
    if not divides(out_shape[dim], wider, ctx.grid):
        return None
    out[dim] = wider
    return dim


def _layer_layouts(act, act_shape, act_c, act_b, w_shape, w_c, w_b, ctx, out_dim=None,
                   stacked: frozenset = frozenset()):  # fmt: skip
    """Choose normal/transposed from the activation's contracting layout (§1).

    ``out_dim``: the weight's output-feature dim (default: :func:`_output_features`,
    which passes over the ``stacked`` dims).
    """
    on_contract = [a for d in act_c for a in act[d] if a in (X, Y)]
    in_axis = on_contract[0] if on_contract else Y
    out_axis = X if in_axis == Y else Y
    # the output axis is the weight's: un-split it on the activation (a gather, e.g. of a
    # dim a grouped convolution split over both axes)
    act = [tuple(a for a in axes if a != out_axis) for axes in act]
    if in_axis not in on_contract and act_c:
        first = act_c[0]
        if divides(act_shape[first], act[first] + (in_axis,), ctx.grid):
            # input features that are whole (a concatenation): they take the input axis, back
            # from a batch dim reduce-scattered over it (the activation is gathered there)
            act = [axes[:len(BATCH_AXES)] + tuple(a for a in axes[len(BATCH_AXES):] if a != in_axis)
                   if axes[:len(BATCH_AXES)] == BATCH_AXES else axes for axes in act]  # fmt: skip
        if in_axis not in used_axes(tuple(act)) and divides(
            act_shape[first], act[first] + (in_axis,), ctx.grid
        ):
            act[first] = act[first] + (in_axis,)
    w: list[tuple[str, ...]] = [()] * len(w_shape)
    for a_dim, w_dim in zip(act_c, w_c):
        w[w_dim] = act[a_dim]
    for a_dim, w_dim in zip(act_b, w_b):
        w[w_dim] = act[a_dim]
    w_free = [d for d in range(len(w_shape)) if d not in w_c and d not in w_b]
    if out_dim is None and w_free:
        out_dim = _output_features(w_free, w_shape, out_axis, stacked, ctx)
    taken = used_axes(tuple(act))
    if out_dim is not None and out_axis not in taken and divides(w_shape[out_dim], (out_axis,), ctx.grid):
        w[out_dim] = (out_axis,)
        wider = (out_axis, in_axis)
        if in_axis not in taken and divides(w_shape[out_dim], wider, ctx.grid):
            # input features the input axis does not divide (3 colour channels, 1 audio
            # channel): the output features take both axes, the next layer gathers one
            w[out_dim] = wider
    return tuple(act), tuple(w), (in_axis, out_axis)


def _consistent(llay, rlay, lc, rc, lb, rb):
    """Make paired (contracting and batch) dims sharded alike; free dims disjoint."""
    llay, rlay = list(llay), list(rlay)
    for ld, rd in list(zip(lc, rc)) + list(zip(lb, rb)):
        if llay[ld] == rlay[rd]:
            continue
        if not rlay[rd] and not (set(llay[ld]) & used_axes(tuple(rlay))):
            rlay[rd] = llay[ld]
        elif not llay[ld] and not (set(rlay[rd]) & used_axes(tuple(llay))):
            llay[ld] = rlay[rd]
        elif common_prefix(llay[ld], rlay[rd]):  # e.g. (x, y) meets (x,): gather the minor axis
            llay[ld] = rlay[rd] = common_prefix(llay[ld], rlay[rd])
        else:
            rlay[rd] = llay[ld] if not (set(llay[ld]) & used_axes(tuple(rlay))) else ()
            if rlay[rd] != llay[ld]:
                llay[ld] = ()
    paired_l = set(lc) | set(lb)
    paired_r = set(rc) | set(rb)
    rfree_axes = {a for d, ax in enumerate(rlay) if d not in paired_r for a in ax}
    if 0 not in paired_l and llay and set(llay[0][:len(BATCH_AXES)]) <= set(BATCH_AXES):
        # a batch dim reduce-scattered over tensor axes (see _scatter_onto_batch) gives
        # them back to the weight: the activation is gathered, the weight stays split
        extra = llay[0][len(BATCH_AXES):]
        llay[0] = llay[0][:len(BATCH_AXES)] + tuple(a for a in extra if a not in rfree_axes)
    lfree_axes = {a for d, ax in enumerate(llay) if d not in paired_l for a in ax}
    for d, axes in enumerate(rlay):
        if d not in paired_r and set(axes) & lfree_axes:
            rlay[d] = ()
    return tuple(llay), tuple(rlay)


def conv(eqn, layouts, ctx) -> Step:
    """Convolutions as 4D layers: channels split like a matmul's features.

    The batch dim keeps its (data, z) split and spatial dims are whole. With
    one feature group, input channels contract (split over the layer's input
    axis, the partial sums reduced with a psum) and output channels are free
    (split over the output axis), exactly as :func:`dot_general` splits a
    weight; the normal/transposed alternation continues through the data flow.
    With several groups (depthwise, grouped), whole groups are split: input
    and output channels over the same axes, no reduction.
    """
    lhs, rhs = eqn.invars
    dn = eqn.params["dimension_numbers"]
    lshape, rshape = shape_of(lhs), shape_of(rhs)
    (lb, lf), lsp = dn.lhs_spec[:2], dn.lhs_spec[2:]
    (ro, ri), (ob, of) = dn.rhs_spec[:2], dn.out_spec[:2]
    groups = eqn.params["feature_group_count"]
    llay = layouts[0] if layouts[0] is not None else replicated(len(lshape))
    act = list(without(llay, set(lsp)))
    w: list[tuple[str, ...]] = [()] * len(rshape)
    layer, reduce = None, ()
    params = dict(eqn.params)
    if eqn.params["batch_group_count"] != 1:
        act = [act[d] if d == lb else () for d in range(len(act))]
    elif groups == 1:
        if layouts[1] is None:
            act_t, w_t, layer = _layer_layouts(tuple(act), lshape, [lf], [], rshape, [ri], [], ctx,
                                               out_dim=ro)  # fmt: skip
            act, w = list(act_t), list(w_t)
        else:
            w[ri] = act[lf]
            free = layouts[1][ro]
            if free and not set(free) & used_axes(tuple(act)) and divides(rshape[ro], free, ctx.grid):
                w[ro] = free
        reduce = act[lf]
    else:
        axes = act[lf]
        for extra in (Y, X):  # whole groups over every tensor axis that divides them
            if extra in act[lb][len(BATCH_AXES):]:  # taken back from a scattered batch
                act[lb] = tuple(a for a in act[lb] if a != extra)
            wider = axes + (extra,)
            if extra not in used_axes(tuple(act)) and divides(groups, wider, ctx.grid) \
                    and divides(rshape[ro], wider, ctx.grid):  # fmt: skip
                axes = wider
        if axes and divides(groups, axes, ctx.grid) and divides(rshape[ro], axes, ctx.grid):
            w[ro] = axes
            params["feature_group_count"] = groups // factor(axes, ctx.grid)
        else:
            axes = ()
        act[lf] = axes
    out = [()] * len(shape_of(eqn.outvars[0]))
    out[ob], out[of] = act[lb], w[ro]
    return Step([tuple(act), tuple(w)], [tuple(out)], [tuple(reduce)], params, layer=layer)


def reduce_window(eqn, layouts, ctx) -> Step:
    """Pooling: dims the window does not span (window 1, stride 1) keep their split."""
    ndim = len(shape_of(eqn.invars[0]))
    p = eqn.params
    windows, strides = p["window_dimensions"], p["window_strides"]
    padding = p.get("padding") or ((0, 0),) * ndim
    base = p.get("base_dilation") or (1,) * ndim
    win_dil = p.get("window_dilation") or (1,) * ndim
    spanned = {
        d for d in range(ndim)
        if (windows[d], strides[d], tuple(padding[d]), base[d], win_dil[d]) != (1, 1, (0, 0), 1, 1)
    }  # fmt: skip
    operands = [i for i, v in enumerate(eqn.invars) if len(shape_of(v)) == ndim]
    known = [layouts[i] for i in operands if layouts[i] is not None]
    target = without(merge(known), spanned) if known else replicated(ndim)
    targets = [
        None if is_literal(v) else (target if i in operands else replicated(len(shape_of(v))))
        for i, v in enumerate(eqn.invars)
    ]
    return Step(targets, [target] * len(eqn.outvars), [()] * len(eqn.outvars), dict(p))


_RULES = {
    "reduce_window_sum": reduce_window,
    "reduce_window_max": reduce_window,
    "reduce_window_min": reduce_window,
    "reduce_window": reduce_window,
    "broadcast_in_dim": broadcast_in_dim,
    "reshape": reshape,
    "transpose": transpose,
    "squeeze": squeeze,
    "concatenate": concatenate,
    "slice": slice_,
    "pad": pad,
    "dynamic_slice": dynamic_slice,
    "dynamic_update_slice": dynamic_update_slice,
    "iota": iota,
    "random_bits": random_bits,
    "bitcast_convert_type": bitcast_convert_type,
    **{name: random_keys for name in KEY_PRIMITIVES},
    "gather": gather,
    "scatter-add": scatter_add,
    "scatter-sub": scatter_add,  # linear alike: the operand once, minus every device's updates
    "scatter": scatter,
    **{name: model_collective for name in COLLECTIVE_AXES},
    **{name: unsupported_collective for name in OTHER_COLLECTIVES},
    "split": split,
    "stack": stack,
    "tile": tile,
    "dot_general": dot_general,
    "conv_general_dilated": conv,
    "fft": fft,
}

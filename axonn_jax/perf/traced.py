"""Build a :class:`~axonn_jax.perf.spec.ModelSpec` from any Flax model by planning it. Pure.

The model is traced on abstract inputs and planned for the one-device grid
(layouts keep their logical x/y marks even on size-1 axes, so normal and
transposed layers are known without devices), or for a given grid, whose
fallbacks then show (``grid=``; :class:`PerGridSpec` plans again only the
grids where the one-device plan does not hold). From the plan and the jaxpr:

* parameters: shape, the x/y axis of each dim where used, and whether they
  are depth (z) split: layer weights and embedding tables, as the planner does;
* matmuls: every ``dot_general`` with a parameter operand gives m, k, n
  (exact) and its axes (from the layer role; a parameter that is not a layer
  weight but meets an activation, e.g. a tied embedding used as the output
  head, contracts over the axis its layout carries);
* gather groups: the depth-split weights of the matmuls that read one input
  (q/k/v, gate/up), and by default of a repeated block's consecutive layers
  (``partitioner.blocks``), are gathered in one all-gather (``Param.fused``);
* matmuls between two activations (attention) count as FLOPs split over
  data·z·x;
* activations kept for backward: the activation operands of those matmuls,
  and each weight matmul's output, which the elementwise work after it reads
  (an activation's input, a pooling's: a convolution's output is all-reduced
  whole over its input-channel axis, a dense layer's reduce-scattered onto the
  batch over it, ``rows_axis``); a lower bound: other intermediates are not
  counted;
* blocks (for pipeline stages): the most repeated numbered path component
  (``block_3``, ``blocks/3``); boundary width: the floating elements per token
  alive between the first two of them (what a pipeline stage sends on), else the
  input per token of the first weight matmul (k for a dense layer, the input
  channels for a convolution).

* the default program's scattered batch (:class:`_ScatterFlow`): which
  matmul inputs come whole (no all-gather), the rows each parameter is
  applied on, and whole activations joining split ones (the scattered stream;
  T5's position bias meeting head-split scores: :class:`~axonn_jax.perf.spec.Join`). On a grid's
  own plan (``spec_from_model(grid=)``, :class:`PerGridSpec` where the
  partitioner falls back) the plan's layouts say it instead: a layer's input is
  gathered where its rule gathers it over the layer's output axis (rows an
  earlier layer scattered, or features an earlier layer of the same orientation
  split: HF Llama's and OPT's on x=8), and a parameter's rows are those its
  value's layout scatters over an axis larger than 1;

* norm statistics (:class:`_NormStatistics`): the reductions over a split dim
  (a transformer's y-split hidden dim), one all-reduce per norm; a weight norm's
  over a kernel's split dim has the same rows every microbatch (``fixed_rows``),
  and a whole parameter meeting features split over an axis has its gradient
  all-reduced there (``Param.grad_summed_over``: wav2vec2's ``weight_g``);
* fallback moves of the partitioner: a kernel stored split but read whole
  (``Param.read_whole``; a layer weight too, stored as another use wants it and read
  with k whole: a tied output head, ``MatMul.weight_gathered``), an activation gathered whole for a reshape or split
  (``Regather``), its gradient all-reduced where it meets a split value
  (:class:`_WholeUses`), unless that is a layer whose input gradient is all-
  reduced over the same axis anyway; a convolution's input relaid out too
  (rows scattered over the axis its rule splits the channels over).

Example:
    >>> import jax, jax.numpy as jnp                           # doctest: +SKIP
    >>> from axonn_jax.models import GPT, GPTConfig            # doctest: +SKIP
    >>> spec = spec_from_model(GPT(GPTConfig()), jax.ShapeDtypeStruct((8, 64), jnp.int32))  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import math

from axonn_jax.partitioner.grid import BATCH_AXES, X, Y, Z, Grid
from axonn_jax.partitioner.jaxprs import CONTROL_FLOW
from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.blocks import BUCKET_BLOCKS, NUMBERED, block_of, bucket_runs
from axonn_jax.partitioner.flows import variable_layouts
from axonn_jax.partitioner.layout import common_prefix, divides
from axonn_jax.partitioner.program import plan_traced
from axonn_jax.partitioner.roles import ParamRole
from axonn_jax.partitioner.flops import equation_flops
from axonn_jax.partitioner.stages import crossing_bytes, param_like_producers, param_origins
from axonn_jax.partitioner.trace import trace_model
from axonn_jax.perf.spec import (VALUE_SPLITS, Activation, BatchStatistics, Join, MatMul, ModelSpec, NormGroup,
                                 Param, PartialSums, Regather, Sliced)

def spec_from_model(model, *example_args, name: str | None = None, grid: Grid | None = None,
                    **example_kwargs) -> ModelSpec:  # fmt: skip
    """Trace and plan ``model`` on example inputs (arrays or ShapeDtypeStructs); no devices.

    ``grid``: plan for its x, y, z and data sizes, so the spec holds the partitioner's
    fallbacks on that grid (a dim it does not divide stays whole: Llama's 2 key/value
    heads on x=4 are gathered); by default the one-device grid, where every dim divides.
    For a search over many grids, :class:`PerGridSpec`.
    """
    traced = trace_model(model, *example_args, **example_kwargs)
    return _spec_of(traced, _tensor_grid(Grid() if grid is None else grid), name or type(model).__name__)[0]


class PerGridSpec:
    """A Flax model's spec for each grid: traced once, planned again only for the grids
    where the one-device plan does not hold.

    The one-device plan (:attr:`base`) holds on a grid that divides every value's split
    dims; elsewhere the partitioner falls back (a dim left whole, an axis moved to
    another dim) and the spec of that grid's plan is used, cached by x, y, z and data.
    :func:`~axonn_jax.search.search` takes it where it takes a spec.

    Example:
        >>> specs = PerGridSpec(model, x)                          # doctest: +SKIP
        >>> specs.for_grid(Grid(x=4, data=2)).regathers            # doctest: +SKIP
    """

    def __init__(self, model, *example_args, name: str | None = None, **example_kwargs):
        self._traced = trace_model(model, *example_args, **example_kwargs)
        self._name = name or type(model).__name__
        #: the one-device plan's relayouts: (axes dropped, axes gained) of each
        self._relayouts: set = set()
        self.base, layouts = _spec_of(self._traced, Grid(), self._name, self._relayouts)
        #: the split dims of every value of the one-device plan: (size, axes) pairs
        self._split_dims = {(size, axes) for var, lay in layouts.items()
                            for size, axes in zip(R.shape_of(var), lay) if axes}  # fmt: skip
        self._planned: dict[Grid, ModelSpec] = {}

    def for_grid(self, grid: Grid) -> ModelSpec:
        """The spec of ``grid``'s plan (:attr:`base` where the one-device plan holds, or where
        the batch or the blocks do not divide: its ``problems`` say so)."""
        if self.base.batch_and_stage_problems(grid) or self.holds(grid):
            return self.base
        key = _tensor_grid(grid)
        if key not in self._planned:
            self._planned[key] = _spec_of(self._traced, key, self._name)[0]
        return self._planned[key]

    def holds(self, grid: Grid) -> bool:
        """Whether the one-device plan is ``grid``'s: it divides every split dim and every
        parameter with its depth split, and no relayout of it is a gather on ``grid`` (the
        axes it moves a value onto are all 1 there, while one it moves it off is not: a
        ResNet's residual add of x-split and y-split channels on x grids)."""
        return (all(p.divides(grid) for p in self.base.params)
                and all(divides(size, axes, grid) for size, axes in self._split_dims)
                and not any(all(grid.axis_size(a) == 1 for a in gained)
                            and any(grid.axis_size(a) > 1 for a in dropped)
                            for dropped, gained in self._relayouts))  # fmt: skip


def _tensor_grid(grid: Grid) -> Grid:
    """The grid a spec is planned for: ``grid`` without its pipeline (a spec is of the
    whole model; stages are priced from it)."""
    return Grid(x=grid.x, y=grid.y, z=grid.z, data=grid.data)


def _spec_of(traced, grid: Grid, name: str, relayouts: set | None = None) -> tuple[ModelSpec, dict]:
    """The spec of ``traced`` planned for ``grid``, and the layout of every value
    (``relayouts``: collects those of the one-device plan, see :func:`_whole_gathers`)."""
    plan, program = plan_traced(traced, grid, name=name)
    jaxpr = program.jaxpr
    n_params = traced.num_params
    origin = param_origins(jaxpr, n_params)
    layouts = variable_layouts(jaxpr, plan.grid, program.param_storage, program.arg_layouts,
                               scatter_batch=program.scatter_batch)  # fmt: skip
    lookups, lookup_elements, fixed_lookup_elements = 0, 0.0, 0.0

    matmuls, saved, looked_up, weight_of, outputs = [], {}, set(), [], []
    read_whole, regathers, partial_sums = {}, [], []  # parameter index → axis; Regather; PartialSums
    read_whole_grad: set[int] = set()  # parameters gathered whole and sliced on another dim
    read_whole_rows: set[int] = set()  # parameters gathered whole to meet rows split over the axis
    summed_over: dict = collections.defaultdict(tuple)  # parameter index → Param.grad_summed_over
    norms = _NormStatistics(layouts, grid)
    ctx = R.Context(plan.grid, scatter_batch=program.scatter_batch)
    whole_uses = _WholeUses(layouts, origin)
    sliced_sums = _SlicedSums(layouts)
    attention_flops, attention_saved = 0.0, {}
    casts = param_like_producers(jaxpr, n_params)
    trained = _from_params(jaxpr, n_params)
    # on the one-device grid nothing is scattered onto the batch (every axis is 1), so a
    # layer's gathers are not in its plan: there the flow stands in for them
    planned_for_grid = grid != Grid()
    # the tensor axes of 1 (nothing to gather over them); None: on the one-device plan, unknown
    unit = frozenset(a for a in (X, Y) if grid.axis_size(a) == 1) if planned_for_grid else None
    flow = _ScatterFlow(jaxpr, origin, trained,
                        rows_of=(lambda v: _rows_axis(layouts.get(v, ()), unit)) if planned_for_grid else None,
                        sliced_over=(lambda whole, out: _sliced_axis(layouts.get(whole, ()), layouts.get(out, ()), unit))
                        if planned_for_grid else None,
                        features_of=lambda whole, out: _feature_axes(layouts.get(whole, ()), layouts.get(out, ()),
                                                                     unit or frozenset()))  # fmt: skip
    for eqn in jaxpr.eqns:
        name_ = eqn.primitive.name
        step = _rule_step(eqn, layouts, ctx) if name_ not in CONTROL_FLOW else None
        flow.follow(eqn)
        norms.follow(eqn)
        whole_uses.follow(eqn, step.targets if step else None)
        if all(var is None for var, _ in weight_of[-1:]) and not (eqn.outvars and eqn.outvars[0] in casts):
            weight_of += [(None, origin[v]) for v in eqn.invars if not R.is_literal(v) and v in origin]
        if name_ in R.ELEMENTWISE:
            for v, target in zip(eqn.invars, step.targets):
                if not R.is_literal(v) and v in origin and target is not None:
                    summed_over[origin[v]] += _feature_axes(target, layouts.get(eqn.outvars[0], ()),
                                                            unit or frozenset())  # fmt: skip
        if name_ == "gather" and eqn.invars[0] in origin:
            looked_up.add(origin[eqn.invars[0]])
            dn = eqn.params["dimension_numbers"]
            table = layouts[eqn.invars[0]]
            if any(X in table[d] for d in dn.start_index_map):  # vocabulary-parallel
                out = eqn.outvars[0]
                if any(set(axes) & set(BATCH_AXES) for axes in layouts.get(out, ())):
                    lookups += 1  # rows of the batch
                    lookup_elements += math.prod(out.aval.shape)
                else:  # indexed by position (a relative-position bias): the same for any batch
                    fixed_lookup_elements += math.prod(out.aval.shape)
        if name_ == "conv_general_dilated":  # its input relaid out as any operand (its kernel: below)
            for operand, *found in _whole_gathers(eqn, _input_only(step), layouts, trained, flow.axis, unit,
                                                  relayouts):  # fmt: skip
                whole_uses.gathered(eqn, operand, len(regathers), found[2])
                regathers.append(found)
        if name_ == "conv_general_dilated" and eqn.invars[1] in origin:
            kernel_use = step.targets[1]
            conv = _conv_matmul(eqn, layouts, grid, plan.params[origin[eqn.invars[1]]].path, kernel_use,
                                input_grad=eqn.invars[0] in trained)  # fmt: skip
            gathered = _kernel_read_whole(layouts[eqn.invars[1]], kernel_use, grid)
            if gathered:  # stored split, gathered to meet whole channels (or relaid out)
                read_whole[origin[eqn.invars[1]]] = gathered
                if any(gathered in axes for axes in kernel_use):  # and sliced on another dim
                    read_whole_grad.add(origin[eqn.invars[1]])
            whole_uses.layer(whole_input=True)  # its input gradient is all-reduced with it
            summed = [a for a in conv.in_axes if not any(a in axes for axes in layouts.get(eqn.outvars[0], ()))]
            for axis in summed:  # its output, all-reduced whole over the axis
                whole_uses.all_reduced(eqn.outvars[0], ("conv", len(matmuls), axis), axis)
            matmuls.append((None, conv))
            weight_of.append((eqn.invars[0], origin[eqn.invars[1]]))  # a layer of the gather groups
            saved.setdefault(eqn.invars[0], (math.prod(R.shape_of(eqn.invars[0])), conv.in_axis))
            outputs.append((math.prod(R.shape_of(eqn.outvars[0])), conv.out_axis, None))  # all-reduced whole
            continue
        if name_ not in ("dot_general", "conv_general_dilated") and name_ not in CONTROL_FLOW:
            sliced_sums.follow(eqn, step)
            for operand, *found in _whole_gathers(eqn, step, layouts, trained, flow.axis, unit, relayouts):
                whole_uses.gathered(eqn, operand, len(regathers), found[2])
                regathers.append(found)
            if name_ not in _PRICED_REDUCTIONS:
                partial_sums += _partial_sums(eqn, step, trained, flow.axis)
            elif name_ == "gather" and eqn.invars[0] not in origin:
                # rows of an activation looked up by indices every device holds (jnp.repeat of a
                # graph's globals onto its edges): each device's rows, summed over their axes
                for op, size, axes, _, grad, others, rows_axis in _partial_sums(eqn, step, trained, flow.axis):
                    if grad:
                        sliced_sums.summed(eqn.outvars[0], len(partial_sums), (*axes, rows_axis))
                    partial_sums.append((op, size, axes, 0, False, others, rows_axis))
        if name_ != "dot_general":
            continue
        lhs, rhs = eqn.invars
        sides = [origin.get(v) if not R.is_literal(v) else None for v in (lhs, rhs)]
        if sides[0] is None and sides[1] is None:
            attention_flops += equation_flops(eqn)
            for v in (lhs, rhs):
                attention_saved[v] = math.prod(R.shape_of(v))
            continue
        if sides[0] is not None and sides[1] is not None:
            continue  # a product of two parameters: no activation, no layer
        w_side = 0 if sides[0] is not None else 1
        p = sides[w_side]
        (lc, rc), _ = eqn.params["dimension_numbers"]
        w_var, act_var = (lhs, rhs) if w_side == 0 else (rhs, lhs)
        w_shape = R.shape_of(w_var)
        k = math.prod(w_shape[d] for d in (lc if w_side == 0 else rc))
        n = math.prod(w_shape) // max(k, 1)
        m = math.prod(R.shape_of(eqn.outvars[0])) // max(n, 1)
        w_lay, w_c = layouts[w_var], (lc if w_side == 0 else rc)
        in_axis = _tensor_axis(tuple(a for d in w_c for a in w_lay[d]), grid)
        out_axis = _tensor_axis(tuple(a for d in range(len(w_shape)) if d not in w_c for a in w_lay[d]), grid)
        path = plan.params[p].path
        weight_of.append((act_var, p))
        targets = step.targets  # where the partitioner's rule reads both
        whole = not (_gathered_over(layouts.get(act_var), targets[1 - w_side], out_axis) if planned_for_grid
                     else act_var in flow.axis)  # fmt: skip
        whole_uses.layer(whole)
        gathered_weight = _weight_gathered(w_lay, w_c, targets[w_side], in_axis)
        if gathered_weight:
            read_whole[p] = in_axis
            # on input rows an earlier layer scattered over the axis: the gradient is of those rows
            input_rows = _rows_axis(layouts.get(act_var, ()), unit) if planned_for_grid else flow.axis.get(act_var)
            if input_rows == in_axis:
                read_whole_rows.add(p)
        matmuls.append((act_var, MatMul(path, m, k, n, in_axis, out_axis, recomputed=_in_block(path),
                                        whole_inputs=int(whole), input_grad=act_var in trained,
                                        weight_gathered=gathered_weight)))  # fmt: skip
        flow.layer(eqn, in_axis)
        saved.setdefault(act_var, (math.prod(R.shape_of(act_var)), in_axis))
        outputs.append((math.prod(R.shape_of(eqn.outvars[0])), out_axis, in_axis))  # scattered over in_axis
    whole_uses.layer(whole_input=False)  # the last equation's pending meetings
    readers = collections.Counter(var for var, _ in matmuls if var is not None)
    matmuls = [mm if var is None else dataclasses.replace(mm, fused=readers[var]) for var, mm in matmuls]

    if not matmuls:
        raise ValueError(
            f"{name}: no matmul with a parameter was found, so there is "
            "nothing for the 4D grid to split. Remedy: plan a model with Dense/Embed layers."
        )
    tokens = max(mm.m for mm in matmuls)
    matmuls = [dataclasses.replace(mm, sliced_output=tuple(
        s for a in mm.in_axes for s in whole_uses.sliced_values(("conv", j, a), tokens)))
        for j, mm in enumerate(matmuls)]  # fmt: skip
    read = _read(jaxpr)
    params = [
        Param(p.path, p.shape, tuple(_tensor_split(d, grid) for d in p.use),
              depth=p.role in (ParamRole.NORMAL, ParamRole.TRANSPOSED) or i in looked_up or _stored_over_z(p),
              per_block=_in_block(p.path), scatter_axis=flow.params.get(i), read_whole=read_whole.get(i),
              read_whole_grad=i in read_whole_grad, read_whole_rows=i in read_whole_rows,
              trainable=p.trainable and jaxpr.invars[i] in read,
              grad_summed_over=tuple(dict.fromkeys(summed_over[i])))  # fmt: skip
        for i, p in enumerate(plan.params)
    ]
    params = _gathered_together(params, weight_of)
    entries = _block_entry_inputs(jaxpr, origin, plan.params)
    activations = [Activation("block input (a layer's input)", size / tokens, axis, kind="checkpoint")
                   if var in entries else Activation("matmul input", size / tokens, axis)
                   for var, (size, axis) in saved.items()]  # fmt: skip
    activations += [Activation("layer output", size / tokens, axis, rows_axis=rows)
                    for size, axis, rows in outputs]  # fmt: skip
    activations += [Activation("attention operand", size / tokens, X)
                    for size in attention_saved.values()]  # fmt: skip
    layers = _blocks(traced.param_paths)
    # the width of what crosses a block boundary: the floating elements alive between the first
    # two blocks, per token; without two blocks, the first layer's input per token (a
    # convolution's input channels, not its k = channels × window, which is never materialised)
    crossing = _boundary_elements(jaxpr, n_params, origin, plan.params)
    width = (crossing if crossing is not None else matmuls[0].input_per_row * matmuls[0].m) / tokens
    hidden = int(width) if width == int(width) else width
    if layers > len(entries):  # blocks entered otherwise (a norm first): their input besides
        activations.append(Activation("block input", hidden, Y, count=layers - len(entries), kind="checkpoint"))
    arg0 = traced.arg_avals[0].shape if traced.arg_avals else ()
    spec = ModelSpec(
        name=name,
        params=_merge_params(params),
        matmuls=_merge_matmuls(matmuls),
        activations=_merge_activations(activations),
        batch=arg0[0] if arg0 else 1,
        tokens=tokens,
        layers=layers,
        hidden=hidden,
        attention_flops=attention_flops,
        attention_axis=X,
        lookups=lookups,
        lookup_elements=lookup_elements,
        fixed_lookup_elements=fixed_lookup_elements,
        norms=norms.groups(flow.axis, tokens),
        batch_statistics=norms.batch_groups(trained),
        # (an axis the join slices its rows over gathers them whole first: it no longer splits them)
        joins=tuple(Join(f"join {i}", math.prod(R.shape_of(v)) / tokens, features, rows_axis=rows,
                         split_over=tuple(a for a in _feature_axes((), layouts.get(v, ()), frozenset())
                                          if a != rows and a not in features))
                    for i, (v, rows, features) in enumerate(flow.joins)),  # fmt: skip
        regathers=tuple(Regather(f"{op} input", size / tokens, axis, split_over=others, rows_axis=rows,
                                 grad=grad and (i in whole_uses.elements
                                                or i not in whole_uses.covered | whole_uses.shared),
                                 grad_per_token=whole_uses.elements.get(i, size) / tokens, whole_rows=whole,
                                 scattered_rows=of_rows)
                        for i, (op, size, axis, others, rows, grad, whole, of_rows)
                        in enumerate(regathers)),  # fmt: skip
        partial_sums=tuple(PartialSums(f"{op} output", size / tokens, axes, rows=rows, grad=grad, split_over=others,
                                       rows_axis=rows_axis,
                                       sliced=tuple((n / tokens, split) for n, split in sliced_sums.sliced[i]))
                           for i, (op, size, axes, rows, grad, others, rows_axis) in enumerate(partial_sums)),  # fmt: skip
        **_split_outputs(jaxpr, layouts, grid, tokens),
    )
    return spec, layouts


def _boundary_elements(jaxpr, n_params: int, origin: dict, params) -> float | None:
    """The floating elements alive between the first two blocks of the most repeated kind
    (what a pipeline stage sends on: the stream, and whatever else crosses; HF Whisper's
    stream, not its input frames), or ``None`` where there are not two such blocks or
    they interleave."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not R.is_literal(v) and v in origin and (block := block_of(params[origin[v]].path)):
                first.setdefault(block, k)
                last[block] = k
    kind = lambda block: NUMBERED.sub(r"\1", block)  # noqa: E731  "encoder/layers/3" -> "encoder/layers/"
    kinds = collections.Counter(map(kind, first))
    if not kinds:
        return None
    blocks = sorted((b for b in first if kind(b) == kinds.most_common(1)[0][0]), key=first.get)
    if len(blocks) < 2 or last[blocks[0]] >= first[blocks[1]]:
        return None
    alive = crossing_bytes(jaxpr, n_params, floating=True, elements=True)
    return float(alive[last[blocks[0]]:first[blocks[1]]].min())


def _block_entry_inputs(jaxpr, origin: dict, params) -> set:
    """The layer inputs that are a block's input: the activation read by a block's first
    parameter use where that use is a layer (a dense block, a convolution), so it is the
    block input kept under checkpointing, not an activation besides it."""
    began, entries = set(), set()
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not R.is_literal(v)]
        weights = [origin[v] for v in ins if v in origin]
        acts = [v for v in ins if v not in origin]
        layer = eqn.primitive.name in ("dot_general", "conv_general_dilated") and len(weights) == 1
        blocks = {block_of(params[p].path) for p in weights} - {None}
        if layer and len(acts) == 1 and blocks and not blocks & began:
            entries.add(acts[0])
        began |= blocks
    return entries


class _NormStatistics:
    """The normalisations over a split hidden dim: their statistics are all-reduced over it.

    A ``reduce_sum`` over a dim that a tensor axis splits is one statistic; the statistics
    of one value (through casts and squares: LayerNorm's mean and mean square, RMSNorm's
    mean square) are one norm, all-reduced in one call. A ``reduce_sum`` over dims the
    batch axes split is a statistic of a normalisation over the batch instead (BatchNorm:
    :meth:`batch_groups`), all-reduced over those axes. A norm whose rows the default
    program has not scattered onto the batch yet (block 0's first) sees whole rows. The
    axis is y in a transformer's stream, x in a ViT's (its patch convolution splits the
    output channels over x) and in BERT's masked-LM head. Norms inside control-flow
    bodies are not counted.
    """

    UNARY = frozenset(["integer_pow", "square", "abs", "convert_element_type", "copy"])

    def __init__(self, layouts, grid: Grid):
        self.layouts, self.grid = layouts, grid
        self.roots: dict = {}  # variable -> the value it is a cast or power of
        self.stats: dict = {}  # root -> statistics reduced from it
        self.axis: dict = {}  # root -> the axis its statistics are reduced over
        self.rows: dict = {}  # root -> its rows (the elements of one statistic)
        self.fixed: dict = {}  # root -> whether its rows are not the batch's (NormGroup.fixed_rows)
        #: root -> (the axes its batch statistics are reduced over, their elements, the
        #: tensor axes splitting them): a BatchNorm's
        self.batch_stats: dict = {}

    def follow(self, eqn) -> None:
        name, ins = eqn.primitive.name, eqn.invars
        if ins and not R.is_literal(ins[0]) and (name in self.UNARY or name == "mul" and ins[0] is ins[1]):
            self.roots[eqn.outvars[0]] = self.roots.get(ins[0], ins[0])
        elif name == "reduce_sum" and not R.is_literal(ins[0]) and ins[0] in self.layouts:
            reduced = tuple(a for d in eqn.params["axes"] for a in self.layouts[ins[0]][d])
            axis = _tensor_split(reduced, self.grid)
            if set(reduced) & set(BATCH_AXES):  # over the batch: BatchNorm's statistics
                root = self.roots.get(ins[0], ins[0])
                over = tuple(a for a in VALUE_SPLITS if a in reduced)
                split = tuple(a for axes in self.layouts.get(eqn.outvars[0], ()) for a in axes if a in (X, Y))
                self.batch_stats[root] = (over, math.prod(R.shape_of(eqn.outvars[0])), split)
                self.stats[root] = self.stats.get(root, 0) + 1
            elif axis:
                root = self.roots.get(ins[0], ins[0])
                self.stats[root] = self.stats.get(root, 0) + 1
                self.axis[root] = axis
                self.rows[root] = math.prod(R.shape_of(eqn.outvars[0]))
                # rows of no batch (a weight norm's, computed from a kernel): the same every microbatch
                self.fixed[root] = not any(a in BATCH_AXES for axes in self.layouts[ins[0]] for a in axes)

    def groups(self, scattered: dict, tokens: int) -> tuple[NormGroup, ...]:
        """The norms grouped by axis, statistics, the axis their rows are scattered over
        (``scattered``: :class:`_ScatterFlow`'s) and their rows per token."""
        counts = collections.Counter((self.axis[root], self.stats[root], scattered.get(root),
                                      *((1.0, self.rows[root]) if self.fixed[root] else (self.rows[root] / tokens, 0)))
                                     for root in self.stats if root not in self.batch_stats)  # fmt: skip
        return tuple(NormGroup(n, stats, axis, rows, rows_per_token=per_token, fixed_rows=fixed)
                     for (axis, stats, rows, per_token, fixed), n in counts.items())  # fmt: skip

    def batch_groups(self, trained: set) -> tuple[BatchStatistics, ...]:
        """The normalisations over the batch, grouped alike; ``trained``: the values with a
        gradient (a statistic of one has a backward all-reduce)."""
        counts = collections.Counter((*self.batch_stats[root], self.stats[root], root in trained)
                                     for root in self.batch_stats)  # fmt: skip
        return tuple(BatchStatistics(n, stats, elements, over, grad=grad, split_over=split)
                     for (over, elements, split, stats, grad), n in counts.items())  # fmt: skip


class _WholeUses:
    """Where each regathered value, still whole over its axis, is first sliced: read by an
    equation whose result is split over that axis.

    There the program slices the whole value to the device's part, so backward it
    all-reduces the gradient of what it sliced: the regathered value itself (a CNN's
    flattened features meeting the head's split kernel, the pieces of a split fused qkv
    product), or what was computed from it while whole (Llama's key/value heads repeated
    for the query heads on x=4). An equation that gathers its split operand to meet the
    whole one (a residual add after a relayout) slices nothing. Followed equation by
    equation like the other flows; ``elements[i]``: the elements sliced at regather ``i``'s
    meetings. A convolution's output, all-reduced whole over its input axes, is followed
    the same way (:meth:`all_reduced`, keyed ``("conv", matmul index, axis)``): a BatchNorm
    of channels split over that axis slices it, and the statistics it computed from it
    while whole (:meth:`sliced_values`: each value as the rule slices it, with the tensor
    axes still splitting it there).
    """

    def __init__(self, layouts, origin: dict):
        self.layouts = layouts
        self.origin = origin  # parameter variables
        self.whole: dict = collections.defaultdict(set)  # variable -> {(regather index, axis whole over)}
        self.elements: dict[int, float] = collections.defaultdict(float)
        #: regathers met by a layer splitting its output over their axis, whose input
        #: gradient all-reduce (priced with the layer) is the regather's gradient
        self.covered: set[int] = set()
        #: regathers whose whole values were sliced together with a later one's: that
        #: one all-reduce (priced with the later regather) is their gradient too
        self.shared: set[int] = set()
        #: per key, each value sliced: (elements, the tensor axes still splitting it, has rows)
        self.sliced: dict = collections.defaultdict(list)
        self.pending: list[tuple] = []  # (key, value, its layout there, axis): met by the current layer
        self.order: dict = {}  # regather index or convolution key -> when it was made whole

    def _made_whole(self, key, var, axis: str) -> None:
        self.order.setdefault(key, len(self.order))
        self.whole[var] = {(key, axis)}

    def layer(self, whole_input: bool) -> None:
        """The current equation is a layer; ``whole_input``: its input gradient is all-
        reduced over its output axis (``MatMul.whole_inputs``), which is then the gradient
        of the regathers met there; else theirs is priced with them."""
        for index, *sliced in self.pending:
            if whole_input:
                self.covered.add(index)
            else:
                self._slice(index, *sliced)
        self.pending = []

    def _slice(self, key, var, layout, axis: str) -> None:
        """``var``, whole over ``axis`` (from ``key``), sliced over it; ``layout``: where."""
        self.elements[key] += math.prod(R.shape_of(var))
        split = tuple(a for axes in layout for a in axes if a in (X, Y) and a != axis)
        rows = any(a in BATCH_AXES for axes in layout for a in axes)
        self.sliced[key].append((math.prod(R.shape_of(var)), split, rows))

    def sliced_values(self, key: tuple, tokens: int) -> tuple[Sliced, ...]:
        """The values of convolution ``key`` sliced where no layer's input-gradient all-reduce
        is their gradient, alike ones merged (per token of ``tokens`` where they have rows)."""
        if key not in self.elements or key in self.covered:
            return ()
        merged: collections.Counter = collections.Counter()
        for elements, split, rows in self.sliced[key]:
            merged[(split, rows)] += elements
        return tuple(Sliced(key[-1], n / tokens if rows else float(n), split, rows)
                     for (split, rows), n in merged.items())  # fmt: skip

    def gathered(self, eqn, operand, index: int, axis: str) -> None:
        """Regather ``index`` gathers ``eqn``'s ``operand`` whole over ``axis``."""
        if any(self._split(v, axis) for v in eqn.outvars):
            self._slice(index, operand, self.layouts.get(operand, ()), axis)  # sliced where gathered
        else:  # (an operand gathered over several axes: the last one's)
            for v in eqn.outvars:
                self._made_whole(index, v, axis)

    def all_reduced(self, var, key: tuple, axis: str) -> None:
        """``var`` (a convolution's output) was all-reduced whole over ``axis`` (also)."""
        self.order.setdefault(key, len(self.order))
        self.whole[var].add((key, axis))

    def follow(self, eqn, targets=None) -> None:
        """``eqn``, with the layouts its rule reads its operands in (``targets``; None: as they are)."""
        self.layer(whole_input=False)  # met by an equation that was no layer: sliced there
        for var in {v for v in eqn.invars if not R.is_literal(v) and v in self.whole}:
            sliced: dict[str, int] = {}  # axis -> the latest regather ``var`` was computed from
            for index, axis in self.whole[var]:  # every regather it was computed from, while whole
                if any(self._split(v, axis) for v in eqn.outvars):  # its result split: ``var`` sliced
                    sliced[axis] = max(index, sliced.get(axis, index), key=self.order.__getitem__)
                else:
                    for v in eqn.outvars:
                        self.whole[v].add((index, axis))
            # ``var`` is sliced once, its gradient all-reduced once: charged to one regather
            # (the stream whole from two residual adds is one value where it meets a split one)
            target = next(t for v, t in zip(eqn.invars, targets) if v is var) if targets else None
            layout = target if target is not None else self.layouts.get(var, ())
            for axis, index in sliced.items():
                self.shared |= {i for i, a in self.whole[var] if a == axis and i != index}
                if self._layer_output_axis(eqn, axis):
                    self.pending.append((index, var, layout, axis))  # :meth:`layer` decides
                else:
                    self._slice(index, var, layout, axis)

    def _layer_output_axis(self, eqn, axis: str) -> bool:
        """Whether ``eqn`` is a layer whose weight splits its output features over ``axis``
        (Llama's o_proj on x=8, reading the attention of heads gathered whole; a convolution
        after one of the other orientation)."""
        if axis not in (X, Y):
            return False
        if eqn.primitive.name == "conv_general_dilated":
            kernel = eqn.invars[1]
            out_dim = eqn.params["dimension_numbers"].rhs_spec[0]
            return kernel in self.origin and axis in self.layouts.get(kernel, ((),) * (out_dim + 1))[out_dim]
        if eqn.primitive.name != "dot_general":
            return False
        (lc, rc), _ = eqn.params["dimension_numbers"]
        for w, contracting in zip(eqn.invars, (lc, rc)):
            if not R.is_literal(w) and w in self.origin:
                lay = self.layouts.get(w, ())
                return any(axis in axes for d, axes in enumerate(lay) if d not in contracting)
        return False

    def _split(self, var, axis: str) -> bool:
        return not R.is_literal(var) and any(axis in axes for axes in self.layouts.get(var, ()))


class _SlicedSums:
    """Where each whole output of partial sums with a gradient (rows of an activation
    gathered by indices every device holds, all-reduced over the axes splitting them) is
    sliced again over those axes: read by an equation whose result they split (a graph's
    globals, repeated onto its edges, concatenated with the edges' rows). The program
    slices the whole value there, so backward it all-reduces the gradient of what it
    sliced over the same axes. Followed equation by equation through the others, like
    :class:`_WholeUses`; ``sliced[i]``: (elements, tensor axes still splitting them) of
    each value sliced from partial sums ``i``.
    """

    def __init__(self, layouts):
        self.layouts = layouts
        self.whole: dict = {}  # variable -> (partial sums index, the axes it is whole over)
        self.sliced: dict[int, list[tuple[int, tuple[str, ...]]]] = collections.defaultdict(list)

    def summed(self, var, index: int, axes: tuple) -> None:
        """``var`` is partial sums ``index``, all-reduced whole over ``axes`` (None: none)."""
        self.whole[var] = (index, tuple(a for a in axes if a))

    def follow(self, eqn, step: R.Step) -> None:
        """``eqn``, with the partitioner's rule ``step`` for it."""
        for operand, target in zip(eqn.invars, step.targets):
            if R.is_literal(operand) or operand not in self.whole:
                continue
            index, axes = self.whole[operand]
            if any(a in dim for v in eqn.outvars for dim in self.layouts.get(v, ()) for a in axes):
                layout = target if target is not None else self.layouts.get(operand, ())
                split = tuple(dict.fromkeys(a for dim in layout for a in dim if a in (X, Y) and a not in axes))
                self.sliced[index].append((math.prod(R.shape_of(operand)), split))
            else:
                self.whole.update((v, (index, axes)) for v in eqn.outvars)


class _ScatterFlow:
    """Which activations the default program holds reduce-scattered onto the batch.

    Followed equation by equation: a layer's output is scattered over its input
    axis (``rules._scatter_onto_batch``), and what is computed from it stays so
    until the next layer gathers it. Found on the way: the axis of the rows each
    parameter is applied on (its gradient is also reduced over it), and the
    joins of a whole activation with a scattered one (the residual stream meeting
    block 0's first output), whose backward all-reduces the whole one's gradient where it
    has one (``trained``: computed from a parameter; not a dropout's zeros, not the
    model's data added to the stream): over the axis its rows are sliced over, and over
    the tensor axes splitting the result's features but not its own (``features_of``:
    T5's position bias meeting the head-split scores). A whole value joined again (the
    bias every block of a stack adds) is sliced, and its gradient reduced, once.
    """

    def __init__(self, jaxpr, origin: dict, trained: set, features_of, rows_of=None, sliced_over=None):
        self.origin = origin
        self.trained = trained
        #: where the plan is a grid's: the tensor axis a value's rows are scattered over, read
        #: from its layout (the flow's own axis also marks a layer's output split over an
        #: axis of 1, and a join takes either side's)
        self.rows_of = rows_of
        #: there too: the tensor axis a join slices its whole operand over (its gradient's)
        self.sliced_over = sliced_over
        self.axis: dict = {}  # variable -> the tensor axis its batch is scattered over
        self.live = set(jaxpr.invars)  # computed from the inputs or parameters (not constants)
        self.params: dict[int, str] = {}
        #: the tensor axes splitting a join's result's features and not its whole operand
        self.features_of = features_of
        self.joined: set = set()  # whole operands met so far
        #: (whole operand, the axis its rows are sliced over, the axes its features are)
        self.joins: list[tuple] = []

    def follow(self, eqn) -> None:
        ins = [v for v in eqn.invars if not R.is_literal(v)]
        if any(v in self.live for v in ins):
            self.live.update(eqn.outvars)
        axis = next((self.axis[v] for v in ins if v in self.axis), None)
        if axis is None or eqn.primitive.name == "dot_general" and any(v in self.origin for v in ins):
            return
        self.axis.update((v, axis) for v in eqn.outvars)
        for v in ins:
            if v in self.origin:
                self.params.setdefault(self.origin[v], self.rows_of(eqn.outvars[0]) if self.rows_of else axis)
            elif v not in self.axis and v in self.live and R.shape_of(v) == R.shape_of(eqn.outvars[0]):
                out, first = eqn.outvars[0], v not in self.joined
                self.joined.add(v)
                if not first or v not in self.trained:
                    continue
                features = self.features_of(v, out)
                # the rows: over the axis the result's are scattered over (a stream join: the one
                # that splits the result and not the whole value, where the plan is a grid's)
                rows = (self.rows_of(out) if features else self.sliced_over(v, out)) if self.rows_of else axis
                self.joins.append((v, rows, features))

    def layer(self, eqn, in_axis: str | None) -> None:
        """A layer's output: scattered over its input axis."""
        if in_axis:
            self.axis[eqn.outvars[0]] = in_axis


def _split_outputs(jaxpr, layouts, grid: Grid, tokens: int) -> dict:
    """``split_outputs`` (per token, as a fraction where an output has fewer elements than
    the activations have rows: a classifier's logits) and ``output_axis`` of the model's
    outputs whose features a tensor axis splits (the first such output's axis)."""
    split = [(v, axis) for v in jaxpr.outvars if not R.is_literal(v)
             for axis in [_tensor_axis(tuple(a for axes in layouts[v][1:] for a in axes), grid)] if axis]  # fmt: skip
    return {"split_outputs": sum(math.prod(R.shape_of(v)) / tokens for v, _ in split),
            "output_axis": split[0][1] if split else X}


def _read(jaxpr) -> set:
    """The variables some equation of ``jaxpr`` reads, or that it returns."""
    return {v for eqn in jaxpr.eqns for v in eqn.invars if not R.is_literal(v)} | set(jaxpr.outvars)


def _from_params(jaxpr, n_params: int) -> set:
    """The variables computed from some parameter: only their gradients are computed."""
    out = set(jaxpr.invars[:n_params])
    for eqn in jaxpr.eqns:
        if any(not R.is_literal(v) and v in out for v in eqn.invars):
            out.update(eqn.outvars)
    return out


def _conv_matmul(eqn, layouts, grid: Grid, path: str, kernel_use, input_grad: bool = True) -> MatMul:
    """A convolution with a parameter kernel as the matmul it computes (implicit GEMM).

    m output positions (batch × spatial), k = input channels per group × kernel
    window, n output channels: ``2·m·k·n`` are its FLOPs. Its input is read
    whole (``input_width``: input elements per output position) and its partial
    sums are all-reduced over the input-channel axis (``rules.conv``: a
    convolution's output is not reduce-scattered onto the batch). That axis is
    the one splitting the input's channels: ``rules.conv`` makes the kernel's
    input channels follow the activation's (``w[ri] = act[lf]``), so a
    convolution of whole channels (the model's images) contracts them whole,
    with nothing to reduce, even where the kernel is stored split. Its output
    channels are split as the kernel is used (``kernel_use``, the rule's target):
    whole where the stored axis already splits the input channels.
    """
    lhs, rhs = eqn.invars
    dn = eqn.params["dimension_numbers"]
    out_ch_dim = dn.rhs_spec[0]
    kernel, out = R.shape_of(rhs), R.shape_of(eqn.outvars[0])
    n = kernel[out_ch_dim]
    k = math.prod(kernel) // n
    m = math.prod(out) // n
    in_axis = _tensor_axis(layouts[lhs][dn.lhs_spec[1]], grid)
    also = next((a for a in layouts[lhs][dn.lhs_spec[1]] if a in (X, Y) and a != in_axis), None)
    used = kernel_use if kernel_use is not None else layouts[rhs]
    return MatMul(path, m, k, n, in_axis, _tensor_axis(used[out_ch_dim], grid), in_also=also,
                  recomputed=_in_block(path), whole_inputs=1, scatters=False,
                  input_width=math.prod(R.shape_of(lhs)) / m, input_grad=input_grad)  # fmt: skip


def _input_only(step: R.Step) -> R.Step:
    """A convolution's rule ``step`` with its input's target alone: the gathers of its input
    (rows scattered over the axis the rule splits the channels over: wav2vec2's positional
    convolution gathers the stream's rows over y and slices its channels there) are
    regathers; its kernel's are :func:`_kernel_read_whole`'s."""
    return dataclasses.replace(step, targets=[step.targets[0]] + [None] * (len(step.targets) - 1))


def _kernel_read_whole(stored, used, grid: Grid) -> str | None:
    """The tensor axis a convolution kernel stored as ``stored`` is all-gathered over to be
    used as ``used`` (the rule's target): one that splits a dim where it is stored and not
    where it is used. Its input channels meeting whole images (a ViT's patch convolution),
    or its output channels split over the axis that splits the input channels where the
    convolution reads them (a ResNet block after one of the same orientation: it is
    gathered, and sliced over that axis on the other dim)."""
    if used is None:
        return None
    dropped = tuple(a for have, keep in zip(stored, used) for a in have if a not in keep)
    return _tensor_axis(dropped, grid)


#: reductions priced elsewhere: norm statistics (``_NormStatistics``), vocabulary-parallel
#: lookups (a gather of an activation's rows is priced as partial sums, all-reduced)
_PRICED_REDUCTIONS = frozenset(["reduce_sum", "gather"])


def _weight_gathered(stored, contracted, target, in_axis: str | None) -> bool:
    """Whether the partitioner's rule for a layer reads its weight (stored as ``stored``,
    contracted over dims ``contracted``; ``target``: the rule's layout for it) with k whole:
    it drops ``in_axis``, which the weight's storage splits k over, from the weight's
    contracted dims (so the runtime all-gathers the weight over it).

    A weight whose storage is another use's (a tied embedding table, stored with its
    hidden dim split over y for the lookup, read transposed as the output head) can meet
    an input whose features are split over the other axis (BERT's MLM decoder after its
    transform, a layer of y in, x out): ``rules._consistent`` cannot split k alike on both
    sides (x already splits the weight's vocabulary dim) and leaves k whole, gathering the
    weight over y and the input's features over x. Its products are whole: nothing is
    reduced in the forward. Where the input's rows are split over ``in_axis`` (the
    transform reduce-scattered them), each device's gradient of the gathered weight is of
    its rows and the gather's transpose reduce-scatters it
    (``runtime.executor._partial_gathers``; ``Param.read_whole_rows``).
    """
    return _drops(stored, target, in_axis, contracted)


def _partial_sums(eqn, step: R.Step, trained: set, scattered: dict) -> list[tuple]:
    """(op, elements, axes, rows, has a gradient, other tensor axes, rows axis) for each output
    the rule sums over mesh axes (a scatter-add): a :class:`PartialSums`. ``rows``: the length
    of the dim the sums are reduce-scattered onto where the axes divide it
    (``rules.scatter_add``: the first scattered dim, a graph's nodes), 0 for none; rows
    axis: the axis the default program scatters its inputs' rows over (``scattered``:
    :class:`_ScatterFlow`'s), summed over too."""
    out = []
    for k, (var, axes) in enumerate(zip(eqn.outvars, step.reduce)):
        if not axes:
            continue
        onto = step.scatter[k] if step.scatter else None
        if onto is None:  # the one-device grid's axes are not live: where the rule scatters on others
            onto = R.summed_onto(eqn)
        split = tuple(sorted({a for d, dim_axes in enumerate(step.outs[k]) if d != onto
                              for a in dim_axes if a in (X, Y)}))  # fmt: skip
        rows = 0 if onto is None else R.shape_of(var)[onto]
        rows_axis = next((scattered[v] for v in eqn.invars if not R.is_literal(v) and v in scattered), None)
        out.append((eqn.primitive.name, math.prod(R.shape_of(var)), tuple(a for a in axes if a != rows_axis), rows,
                    var in trained, tuple(a for a in split if a != rows_axis), rows_axis))  # fmt: skip
    return out


def _whole_gathers(eqn, step: R.Step, layouts, trained: set, scattered: dict,
                   unit: frozenset | None = None, relayouts: set | None = None) -> list[tuple]:  # fmt: skip
    """(operand, op, elements, axis, other tensor axes, rows axis, has a gradient, batch axes
    gathered so far, a gather of scattered rows) for each axis ``eqn`` gathers an operand
    over: those of its layout that the partitioner's rule (``step``) drops from its target.

    A reshape keeps only the major dim of a group of merged dims split, and that one
    only where the grid divides the major dim it becomes: a split minor dim (a CNN's
    y-split channels, flattened before its head) is gathered whole first, and so is a
    split dim taken apart into fewer pieces than its axis (Llama's 2 key/value heads
    on x=4). A split along a split dim (a fused qkv product: HF GPT-2's ``c_attn``)
    gathers that dim and keeps each device's block of every piece. A lookup by index
    into rows the batch axes split (a graph's nodes, for its edges) gathers them over
    the batch axes, after the rows the default program scattered onto the batch over a
    tensor axis (``scattered``: :class:`_ScatterFlow`'s). Several axes are gathered one
    after the other. The other tensor axes still split the gathered value, and so does
    the axis its rows are reduce-scattered over. An operand relaid out onto other axes
    is priced as the runtime moves it (``runtime.executor.relayout``: each dim's axes
    past what it shares with the target gathered, then sliced; ``unit``: the tensor axes
    of 1 on a grid's plan, nothing to move). On the one-device plan (``unit`` None),
    where which axes are live is the grid's, a relayout is not priced (``relayouts``
    collects its (dropped, gained) axes: on a grid where the gained ones are 1 it is a
    gather, priced on that grid's own plan); nor is a reshape that permutes dims
    (replicated).
    """
    if eqn.primitive.name == "reshape" and step.fallback:  # a permutation: replicated
        return []
    out = []
    for operand, target in zip(eqn.invars, step.targets):
        if R.is_literal(operand) or operand not in layouts or target is None:
            continue
        lay = tuple(tuple(a for a in axes if a not in (unit or ())) for axes in layouts[operand])
        target = tuple(tuple(a for a in axes if a not in (unit or ())) for axes in target)
        if unit is None and any(set(kept) - set(axes) for axes, kept in zip(lay, target)):
            if relayouts is not None:  # which axes are live is the grid's: PerGridSpec.holds asks
                relayouts.add((frozenset(a for axes in lay for a in axes) - frozenset(a for t in target for a in t),
                               frozenset(a for t in target for a in t) - frozenset(a for axes in lay for a in axes)))
            continue  # relaid out on the one-device plan
        # as runtime.executor.relayout moves it: each dim's axes past what it shares with
        # the target's are gathered, then the target's are sliced off
        dropped = _dropped(lay, target)
        gathered = [a for a in VALUE_SPLITS if a in dropped]
        rows = scattered.get(operand)  # priced by grid (``rows_axis``), also where a grid's plan marks it
        split = {a for axes in lay for a in axes if a in (X, Y)} - {rows}
        if rows and (rows in gathered or set(gathered) & set(BATCH_AXES)):  # whole rows: first the scattered
            gathered = [a for a in gathered if a != rows]
            out.append((operand, eqn.primitive.name, math.prod(R.shape_of(operand)), rows,
                        tuple(sorted(split)), None, operand in trained, (), True))  # fmt: skip
            rows = None
        for i, axis in enumerate(gathered):  # one after the other: each sees the earlier ones whole
            others = tuple(sorted(split - set(gathered[: i + 1])))
            whole_rows = tuple(a for a in gathered[: i + 1] if a in BATCH_AXES)
            out.append((operand, eqn.primitive.name, math.prod(R.shape_of(operand)), axis, others,
                        rows, operand in trained, whole_rows, False))  # fmt: skip
    return out


def _rule_step(eqn, layouts, ctx: R.Context) -> R.Step:
    """The partitioner's rule for ``eqn`` on the plan's ``layouts`` of its operands."""
    return R.rule(eqn, [None if R.is_literal(v) else layouts.get(v) for v in eqn.invars], ctx)


def _gathered_over(layout, target, axis: str | None) -> bool:
    """Whether the partitioner's rule for a layer gathers its input (laid out as ``layout``;
    ``target``: the rule's layout for it) over ``axis`` (the layer's output axis): rows an
    earlier layer reduce-scattered over it, or features an earlier layer split over it (a
    layer after one of the same orientation). Then the input gradient is reduce-scattered
    back; else it is all-reduced.
    """
    return _drops(layout, target, axis)


def _drops(layout, target, axis: str | None, dims=None) -> bool:
    """Whether ``target`` (a rule's layout for an operand laid out as ``layout``; ``None``:
    as it is) drops ``axis`` from one of ``dims`` (every dim by default)."""
    return axis is not None and layout is not None and target is not None and axis in _dropped(layout, target, dims)


def _dropped(layout, target, dims=None) -> set[str]:
    """The axes ``target`` drops from ``layout``'s ``dims`` (every dim by default), as
    ``runtime.executor.relayout`` moves a value: each dim's axes past what it shares with
    the target's are gathered.

    >>> sorted(_dropped((("data", "y"), ("x",)), (("data",), ())))
    ['x', 'y']
    """
    dims = range(len(layout)) if dims is None else dims
    return {a for d in dims for a in layout[d][len(common_prefix(layout[d], target[d])):]}


def _rows_axis(layout, unit: frozenset) -> str | None:
    """The tensor axis (larger than 1: not in ``unit``) splitting a value's batch dims: the
    rows the default program reduce-scattered onto the batch.

    >>> _rows_axis((("data", "z", "x"), (), ("y",)), frozenset({"y"})), _rows_axis((("data", "z"), (), ("x",)), frozenset())
    ('x', None)
    """
    return next((a for axes in layout if set(axes) & set(BATCH_AXES) for a in axes
                 if a in (X, Y) and a not in unit), None)  # fmt: skip


def _sliced_axis(whole, out, unit: frozenset) -> str | None:
    """The tensor axis (larger than 1) splitting ``out``'s layout and not ``whole``'s: the
    one a join slices its whole operand over.

    >>> _sliced_axis(((), ()), (("x",), ()), frozenset()), _sliced_axis(((), ("y",)), ((), ("y",)), frozenset())
    ('x', None)
    """
    mine = {a for axes in whole for a in axes}
    return next((a for axes in out for a in axes if a in (X, Y) and a not in unit and a not in mine), None)


def _feature_axes(whole, out, unit: frozenset) -> tuple[str, ...]:
    """The tensor axes (larger than 1) splitting ``out``'s feature dims (those no batch axis
    splits) and no dim of ``whole``: the ones a join slices its whole operand's features over.

    >>> _feature_axes((("data",), (), ()), (("data",), ("x",), ()), frozenset()), _feature_axes((), ((), ("y",)), frozenset({"y"}))
    (('x',), ())
    """
    mine = {a for axes in whole for a in axes}
    return tuple(dict.fromkeys(a for axes in out if not set(axes) & set(BATCH_AXES) for a in axes
                               if a in (X, Y) and a not in unit and a not in mine))  # fmt: skip


def _tensor_axis(axes: tuple[str, ...], grid: Grid) -> str | None:
    """The tensor axis of a dim split over ``axes``: of a dim split over both x and y (a
    fallback: the partitioner moves an axis that does not divide one dim onto another),
    the one larger than 1 on ``grid``, else the first."""
    tensor = [a for a in axes if a in (X, Y)]
    return next((a for a in tensor if grid.axis_size(a) > 1), tensor[0] if tensor else None)


def _tensor_split(axes: tuple[str, ...], grid: Grid) -> str | tuple[str, ...] | None:
    """The tensor axes a dim split over ``axes`` is split among on ``grid``: of a dim split
    over both x and y, both where both are larger than 1 (the partitioner's fallback, a ViT's
    patch-convolution channels over x·y: each device holds a 1/(x·y) slice, its norms'
    statistics are all-reduced over x·y), else :func:`_tensor_axis`'s one."""
    live = tuple(a for a in axes if a in (X, Y) and grid.axis_size(a) > 1)
    return live if len(live) > 1 else _tensor_axis(axes, grid)


def _stored_over_z(p) -> bool:
    """Whether the plan stores parameter ``p`` (a ``ParamPlan``) split over z: on a grid's own
    plan with z > 1, also a weight the partitioner depth-splits for what is computed from it
    alone (wav2vec2's weight-normed positional kernel: ``weight_v``, ``weight_g``)."""
    return any(Z in axes for axes in p.storage)


def _in_block(path: str) -> bool:
    return any(NUMBERED.match(part) for part in path.split("/"))


def _blocks(paths) -> int:
    """How many times the most repeated numbered path component repeats."""
    seen: dict[tuple, set] = collections.defaultdict(set)
    for path in paths:
        parts = path.split("/")
        for depth, part in enumerate(parts):
            match = NUMBERED.match(part)
            if match:
                seen[(tuple(parts[:depth]), match.group(1))].add(int(match.group(2)))
                break
    return max((len(v) for v in seen.values()), default=1)


def _merge_params(params) -> tuple[Param, ...]:
    """Parameters alike but for their names, one entry each (``count``)."""
    groups: dict[Param, list[Param]] = collections.defaultdict(list)
    for p in params:
        groups[dataclasses.replace(p, name="", count=1)].append(p)
    return tuple(dataclasses.replace(ps[0], name=ps[0].name + (f" (+{len(ps) - 1} alike)" if len(ps) > 1 else ""),
                                     count=len(ps))
                 for ps in groups.values())  # fmt: skip


def _gathered_together(params: list[Param], weight_of: list[tuple]) -> list[Param]:
    """``params`` with ``fused``: the depth-split weights of one gather group share one
    gather (``weight_of``: (input variable, parameter index) per matmul, in program order).

    A group is a layer (the matmuls reading one input: q/k/v) and the layers after it
    whose first weight lies in the same block (``partitioner.blocks``), as
    ``runtime.executor.gather_points`` groups them by default; parameters read before
    the first matmul (input variable None: an embedding table) join the first group.
    """
    group_of, members, blocks = {}, [set()], [None]
    layer_var, block, layers = None, None, 0
    for var, p in weight_of:
        if var is not None and var is not layer_var:  # a new layer: a new group unless it continues the block
            start = block_of(params[p].name)
            if layers and (start is None or start != block):
                members.append(set())
                blocks.append(None)
            layer_var, block, layers = var, start, layers + 1
            blocks[-1] = start
        if params[p].depth:
            members[-1].add(p)
        group_of.setdefault(p, len(members) - 1)
    # the groups of a bucket of blocks share their weight-gradient reduce-scatter
    bucketed = {g for run in bucket_runs(blocks, BUCKET_BLOCKS) if len(run) > 1 for g in run}
    return [dataclasses.replace(q, fused=len(members[group_of[i]]), bucket=BUCKET_BLOCKS
                                if group_of[i] in bucketed else 1) if i in group_of and q.depth
            else dataclasses.replace(q, fused=1) for i, q in enumerate(params)]  # fmt: skip


def _merge_matmuls(matmuls) -> tuple[MatMul, ...]:
    groups: dict[tuple, list[MatMul]] = collections.defaultdict(list)
    for m in matmuls:
        groups[(m.m, m.k, m.n, m.in_axis, m.out_axis, m.recomputed, m.fused, m.scatters,
                m.input_width, m.input_grad, m.sliced_output, m.in_also, m.weight_gathered)].append(m)
    return tuple(
        MatMul(ms[0].name + (f" (+{len(ms) - 1} alike)" if len(ms) > 1 else ""),
               ms[0].m, ms[0].k, ms[0].n, ms[0].in_axis, ms[0].out_axis, count=len(ms),
               recomputed=ms[0].recomputed, fused=ms[0].fused, scatters=ms[0].scatters,
               input_width=ms[0].input_width, input_grad=ms[0].input_grad,
               whole_inputs=sum(m.whole_inputs for m in ms), sliced_output=ms[0].sliced_output,
               in_also=ms[0].in_also, weight_gathered=ms[0].weight_gathered)  # fmt: skip
        for ms in groups.values()
    )


def _merge_activations(activations) -> tuple[Activation, ...]:
    counts: collections.Counter = collections.Counter()
    first: dict[tuple, Activation] = {}
    for a in activations:
        key = (a.name, a.per_token, a.axis, a.kind, a.rows_axis)
        counts[key] += a.count
        first.setdefault(key, a)
    return tuple(dataclasses.replace(first[key], count=n) for key, n in counts.items())

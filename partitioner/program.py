"""The hand-off from the partitioner to the runtime: a :class:`Program`. Pure.

:func:`plan_model` is the one function that turns (model, grid, example
inputs, options) into the user-facing :class:`~axonn_jax.partitioner.plan.Plan`
and the runtime's :class:`Program`; :func:`program_for` builds the Program of
the same model for other input shapes, planned around the plan's parameter
layouts (a new batch never moves a parameter). Neither touches a device, so a
1,024-GPU model is planned on a laptop with ``import axonn_jax.partitioner`` alone.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> from axonn_jax.partitioner import Grid, plan_model
    >>> x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    >>> plan, program = plan_model(nn.Dense(32), Grid(x=2, y=2), x)
    >>> [p.role.value for p in plan.params], len(program.stage_flows)
    (['follows activation', 'normal'], 1)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from axonn_jax.partitioner.balance import StageCosts
from axonn_jax.partitioner.flows import StageFlow, stage_flows, variable_layouts
from axonn_jax.partitioner.grid import Grid
from axonn_jax.partitioner.layout import Layout, output_layout
from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.propagation import PlannedLayouts, batch_problems, plan_layouts
from axonn_jax.partitioner.provenance import user_frame
from axonn_jax.partitioner.rules import Context
from axonn_jax.partitioner.scan_cuts import cut_stages, with_cuts
from axonn_jax.partitioner.stages import plan_stages
from axonn_jax.partitioner.trace import TracedModel, abstract, call_leaves, inline_calls, retrace, trace_model


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How to plan (the options of :func:`axonn_jax.partition` that shape the layout).

    ``stage_costs``: the rates pipeline stages are priced with when cut
    automatically (:class:`~axonn_jax.partitioner.balance.StageCosts`; a
    machine profile's ``stage_costs(grid)``).
    """

    strict: bool = False
    rules: Mapping[str, Sequence] = dataclasses.field(default_factory=dict)
    replicate: tuple[str, ...] = ()
    stages: tuple[str, ...] | None = None
    scatter_batch: bool = True
    stage_costs: StageCosts = StageCosts()

    def layout_options(self) -> dict[str, Any]:
        return dict(strict=self.strict, rules=dict(self.rules), replicate=tuple(self.replicate),
                    scatter_batch=self.scatter_batch)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Program:
    """What the runtime runs for one input signature: the inlined jaxpr and its layouts.

    ``jaxpr`` takes the parameter leaves first, then the call's array leaves.
    ``output_layouts`` are where outputs are returned (batch split kept,
    everything else gathered); ``stage_flows`` has one entry per pipeline stage
    (one for ``pipeline=1``).
    """

    traced: TracedModel
    grid: Grid
    jaxpr: Any  # jax.extend.core.Jaxpr, nested calls inlined
    consts: tuple
    param_storage: tuple[Layout, ...]
    arg_layouts: tuple[Layout, ...]
    output_layouts: tuple[Layout, ...]
    stage_flows: tuple[StageFlow, ...]
    scatter_batch: bool = True  # the rules' option (rules.Context): the executor uses the same
    #: random_bits output variable -> its layout (rules.Context): the executor uses the same
    random_layouts: Mapping = dataclasses.field(default_factory=dict)

    def rules_context(self) -> Context:
        """The :class:`~axonn_jax.partitioner.rules.Context` this program was planned with."""
        return Context(self.grid, scatter_batch=self.scatter_batch, random_layouts=self.random_layouts)

    @property
    def num_params(self) -> int:
        return self.traced.num_params

    @property
    def out_tree(self):
        return self.traced.out_tree

    @property
    def signature(self) -> tuple:
        """Hashable input signature: array shapes/dtypes, call structure, static values."""
        return signature_of(self.traced.arg_avals, self.traced.arg_tree, self.traced.static_args)


def signature_of(avals, tree, static) -> tuple:
    return (tuple((tuple(a.shape), str(a.dtype)) for a in avals), tree, tuple(static))


def call_signature(args, kwargs) -> tuple:
    """The :attr:`Program.signature` a call with ``args``/``kwargs`` would have."""
    leaves, static = call_leaves(args, kwargs)
    return signature_of([abstract(a) for a in leaves], jax.tree.structure((args, kwargs)), static)


def plan_model(model, grid: Grid, *example_args, options: PlanOptions = PlanOptions(),
               init_inputs: Sequence | None = None, **example_kwargs) -> tuple[Plan, Program]:  # fmt: skip
    """Trace ``model`` on example inputs (arrays or ShapeDtypeStructs) and plan it for ``grid``
    (``init_inputs``: see :func:`~axonn_jax.partitioner.trace.trace_model`)."""
    if not isinstance(grid, Grid):
        raise TypeError(f"grid must be an axonn_jax.Grid, got {type(grid).__name__}")
    traced = trace_model(model, *example_args, init_inputs=init_inputs, **example_kwargs)
    return plan_traced(traced, grid, options=options, name=type(model).__name__)


def plan_traced(traced: TracedModel, grid: Grid, *, options: PlanOptions = PlanOptions(),
                name: str = "the model") -> tuple[Plan, Program]:  # fmt: skip
    """:func:`plan_model` of a model already traced (one trace, planned for many grids)."""
    closed = inline_calls(traced.jaxpr)
    layouts = plan_layouts(traced, grid, jaxpr=closed, **options.layout_options())
    jaxpr, split, cuts = cut_stages(traced, closed.jaxpr, grid.stages, boundaries=options.stages,
                                    costs=options.stage_costs, devices=grid.stage_size,
                                    where=f"{name} on {grid}")  # fmt: skip
    plan = Plan.build(traced, grid, layouts, split, cuts)
    return plan, _program(traced, with_cuts(closed, cuts), grid, plan, layouts)


def program_for(model, plan: Plan, args: tuple, kwargs: dict, *, example: TracedModel | None = None,
                options: PlanOptions = PlanOptions()) -> Program:  # fmt: skip
    """The :class:`Program` of ``model`` called on other inputs, laid out as ``plan``.

    ``example``: the model as traced for ``plan`` (``partition()``'s); the call is then
    traced from it (:func:`~axonn_jax.partitioner.trace.retrace`: the variables and the
    nnx graph of then), else from ``model`` as it is now. A batch data·z does not divide
    is replicated with a warning, as ``partition()`` does (``ValueError`` when
    ``options.strict``); ``ValueError`` too when these shapes would give the parameters
    another shape than the plan's. The parameters keep the plan's layouts (they are
    sharded so, and their optimizer state): the call's values are planned around them
    (``plan_layouts(fixed=...)``), where planned afresh at these shapes the normal/
    transposed alternation could fall the other way (an activation split over the batch
    at one batch size and not at another decides a parameter's layout differently).
    """
    if example is None:
        traced = trace_model(model, *args, **kwargs)
    else:
        try:
            traced = retrace(example, args, kwargs)
        except Exception:
            _explain_by_param_shapes(model, plan, args, kwargs)
            raise
    grid = plan.grid
    _check_param_shapes(traced, plan)
    closed = inline_calls(traced.jaxpr)
    # the parameters keep the plan's layouts (they are sharded so already); the call's values are
    # planned around them, and the runtime relayouts where a rule wants another (strict: raises)
    layouts = plan_layouts(traced, grid, jaxpr=closed, **options.layout_options(),
                           fixed={p.path: p.storage for p in plan.params})  # fmt: skip
    problems = batch_problems([a.shape for j, a in enumerate(traced.arg_avals) if j not in traced.rng_args], grid)
    if problems:  # as partition() does: replicated, with a warning (a batch-1 generation step)
        more = f"; {len(problems) - 1} more inputs alike" if len(problems) > 1 else ""
        warnings.warn(f"{problems[0]} (grid {grid}{more})", stacklevel=user_frame()[1])
    closed = with_cuts(closed, plan.scan_cuts)
    if len(plan.stages) > 1 and len(closed.jaxpr.eqns) != plan.stages[-1].stop:
        dtypes = ""
        if example is not None and [a.shape for a in example.arg_avals] == [a.shape for a in traced.arg_avals]:
            dtypes = (f" (the example's: {_described(example.arg_avals)}; a dtype other than the example's "
                      "also changes the operations: cast the inputs to the example's dtypes)")  # fmt: skip
        raise ValueError(
            f"inputs {_described(traced.arg_avals)}{dtypes} make the model run other "
            f"operations ({len(closed.jaxpr.eqns)} where the example call given to partition() ran "
            f"{plan.stages[-1].stop}: other shapes, e.g. a slice of position embeddings for a shorter "
            "sequence, or another mode, e.g. train=False), so the "
            f"{len(plan.stages)} pipeline stages cut for the example do not fit them. Remedy: call "
            "with inputs of the example's shapes and dtypes (pad to its length), or partition with "
            "example inputs of these; for another mode, a pm of its own whose stages are cut where "
            "these are: axonn_jax.partition(model, grid, *inputs, train=False, "
            "stages=pm.plan.stage_cuts)."
        )
    return _program(traced, closed, grid, plan, layouts)


def _described(avals) -> str:
    """``[int32(16, 16), bool(16,)]``: each input's dtype and shape."""
    return "[" + ", ".join(f"{a.dtype}{tuple(a.shape)}" for a in avals) + "]"


def _explain_by_param_shapes(model, plan: Plan, args: tuple, kwargs: dict) -> None:
    """Where a call fails to trace with the plan's variables because its inputs would make
    parameters of other shapes (a feature dim other than the example's), say so, naming
    the first such parameter (:func:`_check_param_shapes`); else return (the caller raises
    the tracing error)."""
    try:
        fresh = trace_model(model, *args, **kwargs)
    except Exception:  # noqa: BLE001 - the model's own error on these inputs: the caller's stands
        return
    _check_param_shapes(fresh, plan)


def _check_param_shapes(traced: TracedModel, plan: Plan) -> None:
    """Refuse inputs that would make the model's parameters another shape than the plan's
    (a feature dim other than the example's), naming the first such parameter."""
    for path, aval, p in zip(traced.param_paths, traced.param_avals, plan.params):
        if tuple(aval.shape) != tuple(p.shape):
            raise ValueError(
                f"inputs of shapes {[tuple(a.shape) for a in traced.arg_avals]} make parameter {path!r} "
                f"of shape {tuple(aval.shape)}, but it was planned (and initialised) as {tuple(p.shape)} "
                f"from the example inputs given to partition() (grid {plan.grid}). A call may change the "
                "batch, and dims no parameter depends on, not a parameter's shape. Remedy: call with the "
                "example's feature dims, or partition (and initialise) with example inputs of these shapes."
            )


def composite_program(traced: TracedModel, plan: Plan, *, options: PlanOptions = PlanOptions(),
                      model: Program | None = None) -> Program:  # fmt: skip
    """The :class:`Program` of a function of the model's variables (``traced`` by
    :func:`~axonn_jax.partitioner.trace.trace_composite`: a loss of the model's outputs),
    planned with the same rules and laid out as ``plan``.

    The parameters keep the plan's layouts (as in :func:`program_for`). On a
    pipeline plan the function's equations after the model's join the last
    stage; ``model`` (the model's Program for the same call) is then required.
    Raises ``ValueError`` when the function does not begin with the model's
    equations (the caller then runs the model's own Program).
    """
    grid = plan.grid
    closed = inline_calls(traced.jaxpr)
    layouts = plan_layouts(traced, grid, jaxpr=closed, **options.layout_options(),
                           fixed={p.path: p.storage for p in plan.params})  # fmt: skip
    closed = with_cuts(closed, plan.scan_cuts)
    stages = loss_on_last_stage(plan.stages, closed.jaxpr, model) if len(plan.stages) > 1 else None
    return _program(traced, closed, grid, plan, layouts, stages=stages)


def loss_on_last_stage(stages: tuple, jaxpr, model: Program | None) -> tuple:
    """``stages`` (the model's) with the equations ``jaxpr`` adds after the model's on the last one.

    Raises ``ValueError`` unless ``jaxpr`` begins with ``model``'s equations (same primitives).
    """
    if model is None:
        raise ValueError("a pipeline plan needs the model's Program to place the loss on its last stage")
    n = len(model.jaxpr.eqns)
    ours = [e.primitive for e in jaxpr.eqns[:n]]
    if stages[-1].stop != n or ours != [e.primitive for e in model.jaxpr.eqns]:
        raise ValueError("traced with the loss, the model's equations differ from those its stages were cut from")
    return (*stages[:-1], dataclasses.replace(stages[-1], stop=len(jaxpr.eqns)))


def _program(traced: TracedModel, closed, grid: Grid, plan: Plan, layouts: PlannedLayouts, *,
             stages: tuple | None = None) -> Program:  # fmt: skip
    storage = tuple(p.storage for p in plan.params)
    targets = [output_layout(lay) for lay in layouts.outs]
    for out, var in traced.state_outputs:  # updated state returns in its variable's layout
        targets[out] = storage[var]
    targets = tuple(targets)
    per_variable = variable_layouts(closed.jaxpr, grid, storage, layouts.args,
                                    scatter_batch=layouts.scatter_batch,
                                    random_layouts=layouts.random_layouts)  # fmt: skip
    stages = stages or plan.stages or plan_stages(traced, closed.jaxpr, 1).stages
    flows = stage_flows(closed.jaxpr, stages, traced.num_params, per_variable, targets,
                        traced.state_outputs, param_storage=storage)  # fmt: skip
    return Program(traced, grid, closed.jaxpr, tuple(closed.consts), storage, layouts.args,
                   targets, tuple(flows), layouts.scatter_batch, layouts.random_layouts)  # fmt: skip

"""``axonn_jax.partition(model, grid)``: the user-facing entry point.

Example (a user-written jitted train step)::

    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, y=2, z=2), tokens)
    params = pm.init(jax.random.key(0))
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(pm.apply(p, tokens), tokens))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.grid import BATCH_AXES, Grid
from axonn_jax.partitioner.layout import Layout, replicated, to_spec
from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.planner import batch_problems, plan_layouts
from axonn_jax.partitioner.stages import plan_stages
from axonn_jax.partitioner.trace import TracedModel, inline_calls, trace_model
from axonn_jax.runtime.executor import Executor, live


def partition(
    model,
    grid: Grid,
    *example_args,
    strict: bool = False,
    rules: Mapping[str, Sequence] | None = None,
    replicate: Sequence[str] = (),
    stages: Sequence[str] | None = None,
    **example_kwargs,
) -> Partitioned:
    """Plan ``model`` for ``grid`` from example inputs (arrays or ShapeDtypeStructs).

    Pure: tracing and planning use abstract shapes only; no device is touched
    until :meth:`Partitioned.init`, :meth:`~Partitioned.shard` or
    :meth:`~Partitioned.apply`.

    Args:
        model: a ``flax.linen.Module`` or ``flax.nnx.Module``, unmodified.
        grid: the :class:`Grid`.
        strict: raise ``ValueError`` for anything that cannot be partitioned
            instead of replicating it (with a warning in ``plan.warnings``).
        rules: ``{path regex: layout}`` forcing the use layout of parameters,
            e.g. ``{"head/kernel": ("y", None)}``.
        replicate: path regexes of parameters to keep replicated.
        stages: with ``grid.pipeline > 1``, explicit stage boundaries: one
            parameter-path regex per stage after the first (e.g. ``["block_6"]``);
            by default stages are balanced by dynamic programming.
    """
    if not isinstance(grid, Grid):
        raise TypeError(f"grid must be an axonn_jax.Grid, got {type(grid).__name__}")
    traced = trace_model(model, *example_args, **example_kwargs)
    options = dict(strict=strict, rules=dict(rules or {}), replicate=tuple(replicate))
    return Partitioned(model, traced, grid, options, stages=stages)


class Partitioned:
    """A model planned for a grid: sharded init, placement, and execution."""

    def __init__(self, model, traced: TracedModel, grid: Grid, options: dict, *, stages=None):
        self.model, self.grid, self._options = model, grid, options
        self._traced = traced
        self._programs: dict = {}
        jaxpr = inline_calls(traced.jaxpr)
        layouts = plan_layouts(traced, grid, jaxpr=jaxpr, **options)
        cut = plan_stages(traced, jaxpr.jaxpr, grid.pipeline, boundaries=stages)
        self.plan: Plan = Plan.build(traced, grid, layouts, cut)
        self._programs[self._signature(traced.arg_avals)] = (traced, jaxpr, layouts)
        self._mesh = None

    # --- devices ----------------------------------------------------------
    @property
    def mesh(self):
        """The stage mesh ``(data, z, y, x)`` (built on first use)."""
        if self._mesh is None:
            if self.grid.pipeline != 1:
                raise NotImplementedError(
                    f"{self.grid} has pipeline={self.grid.pipeline}: the plan holds its "
                    "stages (pm.plan.stages), but executing pipelines is not implemented "
                    "yet; pm.apply runs grids with pipeline=1."
                )
            self._mesh = self.grid.stage_meshes()[0]
        return self._mesh

    @property
    def param_shardings(self):
        """NamedSharding pytree matching the params pytree."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.plan.param_specs)

    # --- parameters -------------------------------------------------------
    def init(self, key: jax.Array, *args, **kwargs):
        """Initialise parameters directly in their sharded layout.

        The model's init runs under ``jax.jit`` with the plan's output
        shardings, so no device ever holds the full model. (nnx modules carry
        their values already: those are placed with :meth:`shard`.)
        """
        del args, kwargs  # shapes come from the example inputs given to partition()
        if self._traced.kind == "nnx":
            return self.shard(self._traced.init(key))
        return jax.jit(self._traced.init, out_shardings=self.param_shardings)(key)

    def shard(self, full_params):
        """Place a full params pytree (e.g. pretrained weights) into the layout."""
        self.check_params(full_params)
        leaves = jax.tree.leaves(full_params)
        placed = [
            _place(np.asarray(leaf), NamedSharding(self.mesh, p.spec))
            for leaf, p in zip(leaves, self.plan.params)
        ]
        return jax.tree.unflatten(self.plan.param_tree, placed)

    def gather(self, params):
        """Full parameters back as host NumPy arrays (on every process)."""
        self.check_params(params)
        full = NamedSharding(self.mesh, P())
        gathered = jax.jit(lambda p: p, out_shardings=jax.tree.map(lambda _: full, params))(params)
        return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), gathered)

    def check_params(self, params) -> None:
        """Raise ``ValueError`` naming the first leaf that does not match the plan."""
        leaves_with_path, tree = jax.tree_util.tree_flatten_with_path(params)
        if tree != self.plan.param_tree:
            expected = {p.path for p in self.plan.params}
            from axonn_jax.partitioner.trace import path_string

            got = {path_string(k) for k, _ in leaves_with_path}
            raise ValueError(
                "params pytree does not match the plan: missing "
                f"{sorted(expected - got) or 'none'}, unexpected {sorted(got - expected) or 'none'}. "
                "Remedy: pass the pytree returned by pm.init / pm.shard (or model.init(...)['params'])."
            )
        for (_, leaf), p in zip(leaves_with_path, self.plan.params):
            shape, dtype = tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", np.float32))
            if shape != p.shape:
                raise ValueError(
                    f"parameter '{p.path}' has shape {shape}, the plan expects {p.shape} "
                    f"(grid {self.grid}). Remedy: re-partition for this model size."
                )
            if dtype != np.dtype(p.dtype):
                raise ValueError(
                    f"parameter '{p.path}' has dtype {dtype}, the plan expects {p.dtype}. "
                    "Remedy: cast the params (e.g. jax.tree.map(lambda x: x.astype(...))) or "
                    "re-partition with parameters of that dtype."
                )

    # --- execution --------------------------------------------------------
    def apply(self, params, *args, **kwargs):
        """Run the model: same result as ``model.apply({'params': params}, ...)``.

        A pure function of JAX arrays: put it inside your own ``jax.jit`` and
        ``jax.grad``; gradients come back in the parameter layout. Outputs keep
        their batch dim split over (data, z); other dims are gathered.
        """
        arg_leaves = jax.tree.leaves((args, kwargs))
        traced, jaxpr, layouts = self._program(args, kwargs)
        param_leaves = jax.tree.leaves(params)
        if len(param_leaves) != len(self.plan.params):
            self.check_params(params)
        out_targets = [_output_layout(lay) for lay in layouts.outs]
        executor = Executor(
            jaxpr.jaxpr,
            jaxpr.consts,
            self.grid,
            param_storage=[p.storage for p in self.plan.params],
            arg_layouts=layouts.args,
            out_layouts=out_targets,
        )
        manual = frozenset(a for a in self.mesh.axis_names if self.grid.axis_size(a) > 1)
        if not manual:  # one device: nothing to communicate, no shard_map needed
            outs = executor(list(param_leaves), list(arg_leaves))
            return jax.tree.unflatten(traced.out_tree, outs)

        def spec(layout):  # size-1 axes are logical only; shard_map is manual over the rest
            return to_spec(live(layout, self.grid))

        body = jax.shard_map(
            lambda ps, xs: executor(ps, xs),
            mesh=self.mesh,
            in_specs=([spec(p.storage) for p in self.plan.params], [spec(a) for a in layouts.args]),
            out_specs=[spec(o) for o in out_targets],
            axis_names=manual,
        )
        outs = body(list(param_leaves), list(arg_leaves))
        return jax.tree.unflatten(traced.out_tree, outs)

    __call__ = apply

    def _program(self, args, kwargs):
        avals = tuple(
            jax.ShapeDtypeStruct(np.shape(a), a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype)
            for a in jax.tree.leaves((args, kwargs))
        )
        key = self._signature(avals)
        if key not in self._programs:
            traced = trace_model(self.model, *args, **kwargs)
            problems = batch_problems([a.shape for a in traced.arg_avals], self.grid)
            if problems:
                raise ValueError(f"{problems[0]} (grid {self.grid})")
            jaxpr = inline_calls(traced.jaxpr)
            layouts = plan_layouts(traced, self.grid, jaxpr=jaxpr, **self._options)
            if layouts.storage != {p.path: p.storage for p in self.plan.params}:
                raise ValueError(
                    f"inputs of shapes {[a.shape for a in avals]} give a different parameter "
                    "layout than the example inputs given to partition(). Remedy: partition "
                    "with example inputs of these shapes."
                )
            self._programs[key] = (traced, jaxpr, layouts)
        return self._programs[key]

    @staticmethod
    def _signature(avals) -> tuple:
        return tuple((tuple(a.shape), str(a.dtype)) for a in avals)


def _output_layout(layout: Layout) -> Layout:
    """Outputs keep a (data, z) batch split on dim 0; everything else is gathered."""
    if layout and layout[0] == BATCH_AXES:
        return (BATCH_AXES,) + replicated(len(layout) - 1)
    return replicated(len(layout))


def _place(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

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

import copy
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.grid import BATCH_AXES, Grid
from axonn_jax.partitioner.layout import Layout, replicated, to_spec
from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.planner import batch_problems, plan_layouts
from axonn_jax.partitioner.stages import plan_stages
from axonn_jax.partitioner.trace import TracedModel, call_leaves, inline_calls, trace_model
from axonn_jax.runtime.executor import Executor, live
from axonn_jax.runtime.mesh import local_stages
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.step_report import StepReport, step_report


def partition(
    model,
    grid: Grid,
    *example_args,
    strict: bool = False,
    rules: Mapping[str, Sequence] | None = None,
    replicate: Sequence[str] = (),
    stages: Sequence[str] | None = None,
    overlap: Overlap | str = Overlap(),
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
        overlap: which communication overlaps to set up (OAG, ORS, OAR; all on
            by default): an :class:`~axonn_jax.runtime.overlap.Overlap` or a
            string such as ``"none"`` or ``"oag,ors"``. Values are identical
            under every setting; only the collectives' scheduling windows differ.
    """
    if not isinstance(grid, Grid):
        raise TypeError(f"grid must be an axonn_jax.Grid, got {type(grid).__name__}")
    traced = trace_model(model, *example_args, **example_kwargs)
    options = dict(strict=strict, rules=dict(rules or {}), replicate=tuple(replicate))
    if isinstance(overlap, str):
        overlap = Overlap.parse(overlap)
    return Partitioned(model, traced, grid, options, stages=stages, overlap=overlap)


class Partitioned:
    """A model planned for a grid: sharded init, placement, and execution."""

    def __init__(self, model, traced: TracedModel, grid: Grid, options: dict, *, stages=None,
                 overlap: Overlap = Overlap()):  # fmt: skip
        self.model, self.grid, self._options = model, grid, options
        self.overlap = overlap
        self._traced = traced
        self._programs: dict = {}
        jaxpr = inline_calls(traced.jaxpr)
        layouts = plan_layouts(traced, grid, jaxpr=jaxpr, **options)
        cut = plan_stages(traced, jaxpr.jaxpr, grid.pipeline, boundaries=stages)
        self.plan: Plan = Plan.build(traced, grid, layouts, cut)
        self._programs[self._signature(traced.arg_avals) + (traced.arg_tree, traced.static_args)] = (
            traced, jaxpr, layouts)
        self._mesh = None
        self._stage_meshes = None
        self._stage_layout = None
        self._transport = None
        self._stage_programs: dict = {}  # (loss_fn, remat, input signature) → stage programs
        self._reports: dict = {}

    # --- devices ----------------------------------------------------------
    @property
    def mesh(self):
        """The stage mesh ``(data, z, y, x)`` of a grid without pipeline (built on first use)."""
        if self._mesh is None:
            if self.grid.pipeline != 1:
                raise ValueError(
                    f"{self.grid} has pipeline={self.grid.pipeline}: each stage has its own "
                    "mesh (pm.stage_meshes) and the model runs through pm.value_and_grad / "
                    "pm.train_step; pm.mesh and pm.apply need pipeline=1."
                )
            self._mesh = self.stage_meshes[0]
        return self._mesh

    @property
    def stage_meshes(self) -> list:
        """One mesh ``(data, z, y, x)`` per pipeline stage, stage 0 first."""
        if self._stage_meshes is None:
            from axonn_jax.consistency import check_consistent

            check_consistent(self)  # all ranks: same grid, model, inputs (before any collective)
            self._stage_meshes = self.grid.stage_meshes()
        return self._stage_meshes

    @property
    def local_stages(self) -> list[int]:
        """The pipeline stages with devices on this process."""
        return local_stages(self.stage_meshes)

    @property
    def multiprocess(self) -> bool:
        """True when the stages of this grid span more than one process."""
        return len({d.process_index for m in self.stage_meshes for d in m.devices.flat}) > 1

    @property
    def stage_layout(self):
        """Which stages use each parameter and its home stage on this process."""
        if self._stage_layout is None:
            from axonn_jax.pipeline import StageLayout

            users = [[st.index for st in self.plan.stages if p.path in st.params]
                     for p in self.plan.params]  # fmt: skip
            self._stage_layout = StageLayout.from_users(users, self.local_stages)
        return self._stage_layout

    @property
    def transport(self):
        """How stages exchange messages (in-process copies, or MPI between processes)."""
        if self._transport is None:
            from axonn_jax.runtime.transport import InProcessTransport, MpiTransport

            self._transport = (
                MpiTransport(self.stage_meshes) if self.multiprocess else InProcessTransport()
            )
        return self._transport

    @property
    def param_shardings(self):
        """NamedSharding pytree matching the params pytree.

        With ``pipeline > 1`` each leaf is on the mesh of its home stage on this
        process, and leaves of other processes' stages are ``None``.
        """
        if self.grid.pipeline == 1:
            return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.plan.param_specs)
        home = self.stage_layout.home
        leaves = [None if home[i] is None else NamedSharding(self.stage_meshes[home[i]], p.spec)
                  for i, p in enumerate(self.plan.params)]  # fmt: skip
        return jax.tree.unflatten(self.plan.param_tree, leaves)

    def _param_leaves(self, params) -> list:
        """Leaves of a params pytree (``None`` kept for leaves of other processes)."""
        leaves, tree = jax.tree.flatten(params, is_leaf=lambda x: x is None)
        if tree != self.plan.param_tree or len(leaves) != len(self.plan.params):
            self.check_params(params)
        home = self.stage_layout.home if self.grid.pipeline > 1 else [0] * len(leaves)
        if any(leaf is None and h is not None for leaf, h in zip(leaves, home)):
            self.check_params(params)
        return leaves

    # --- parameters -------------------------------------------------------
    def init(self, key: jax.Array, *args, **kwargs):
        """Initialise parameters directly in their sharded layout.

        The model's init runs under ``jax.jit`` with the plan's output
        shardings, so no device ever holds the full model (with a pipeline,
        one program per stage on this process, each keeping only its leaves).
        nnx modules carry their values already: those are placed with :meth:`shard`.
        """
        del args, kwargs  # shapes come from the example inputs given to partition()
        if self._traced.kind == "nnx":
            return self.shard(self._traced.init(key))
        shardings = jax.tree.leaves(self.param_shardings, is_leaf=lambda x: x is None)
        if self.grid.pipeline == 1:
            return jax.jit(self._traced.init, out_shardings=self.param_shardings)(key)
        leaves: list = [None] * len(shardings)
        for stage in sorted({h for h in self.stage_layout.home if h is not None}):
            mine = [i for i, h in enumerate(self.stage_layout.home) if h == stage]

            def init_stage(k, mine=mine):
                full = jax.tree.leaves(self._traced.init(k))
                return [full[i] for i in mine]

            values = jax.jit(init_stage, out_shardings=[shardings[i] for i in mine])(key)
            for i, v in zip(mine, values):
                leaves[i] = v
        return jax.tree.unflatten(self.plan.param_tree, leaves)

    def shard(self, full_params):
        """Place a full params pytree (e.g. pretrained weights) into the layout."""
        self.check_params(full_params)
        leaves = jax.tree.leaves(full_params)
        shardings = jax.tree.leaves(self.param_shardings, is_leaf=lambda x: x is None)
        placed = [None if sh is None else _place(np.asarray(leaf), sh)
                  for leaf, sh in zip(leaves, shardings)]  # fmt: skip
        return jax.tree.unflatten(self.plan.param_tree, placed)

    def gather(self, params):
        """Full parameters back as host NumPy arrays, on every process.

        With a pipeline over several processes, each leaf is gathered on the
        processes of its stage and then sent to the others (MPI).
        """
        leaves = self._param_leaves(params)
        self.check_params(params, dtypes=False)
        out: list = [None] * len(leaves)
        groups: dict = {}
        for i, leaf in enumerate(leaves):
            if leaf is not None:
                groups.setdefault(leaf.sharding.mesh, []).append(i)
        for mesh, idx in groups.items():
            full = NamedSharding(mesh, P())
            gathered = jax.jit(lambda p: p, out_shardings=[full] * len(idx))([leaves[i] for i in idx])
            for i, a in zip(idx, gathered):
                out[i] = np.asarray(a.addressable_data(0))
        if self.grid.pipeline > 1 and self.multiprocess:  # the same decision on every rank
            comm = self.transport.comm
            for part in comm.allgather([(i, a) for i, a in enumerate(out) if a is not None]):
                for i, a in part:
                    out[i] = a if out[i] is None else out[i]
        return jax.tree.unflatten(self.plan.param_tree, out)

    def check_params(self, params, *, dtypes: bool = True) -> None:
        """Raise ``ValueError`` naming the first leaf that does not match the plan.

        ``dtypes=False`` accepts floating leaves of another precision (the
        half-precision device parameters of ``train_step(precision=...)``).
        """
        from axonn_jax.partitioner.trace import path_string

        leaves_with_path, tree = jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: x is None
        )
        if tree != self.plan.param_tree:
            expected = {p.path for p in self.plan.params}
            got = {path_string(k) for k, _ in leaves_with_path}
            raise ValueError(
                "params pytree does not match the plan: missing "
                f"{sorted(expected - got) or 'none'}, unexpected {sorted(got - expected) or 'none'}. "
                "Remedy: pass the pytree returned by pm.init / pm.shard (or model.init(...)['params'])."
            )
        for (_, leaf), p in zip(leaves_with_path, self.plan.params):
            if leaf is None:
                if self.grid.pipeline == 1 or self.stage_layout.home[self.plan.params.index(p)] is not None:
                    raise ValueError(
                        f"parameter '{p.path}' is None but this process runs a stage that uses "
                        f"it (grid {self.grid}). Remedy: pass the pytree from pm.init / pm.shard."
                    )
                continue
            shape, dtype = tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", np.float32))
            if shape != p.shape:
                raise ValueError(
                    f"parameter '{p.path}' has shape {shape}, the plan expects {p.shape} "
                    f"(grid {self.grid}). Remedy: re-partition for this model size."
                )
            planned = np.dtype(p.dtype)
            both_float = jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(planned, jnp.floating)
            if dtype != planned and (dtypes or not both_float):
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
        arg_leaves, _ = call_leaves(args, kwargs)
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
            overlap=self.overlap,
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

    # --- training ---------------------------------------------------------
    def value_and_grad(
        self,
        loss_fn: Callable,
        *,
        inputs: Callable | None = None,
        microbatches: int = 1,
        schedule: str = "message",
        limit: int | None = None,
        timeout: float = 60.0,
        remat: str | Callable | None = None,
        delay: Callable | None = None,
    ) -> Callable:
        """``(params, batch) → (loss, grads)`` of ``loss_fn(model outputs, batch)``.

        ``inputs(batch)`` gives the model's positional arguments (default: the
        batch itself, or its items if it is a tuple). With ``pipeline = 1`` the
        result is a plain jittable function (microbatches accumulate gradients
        in one program). With ``pipeline > 1`` it runs the stages through the
        dispatch queue: ``schedule`` is "message" (AxoNN's message-driven
        queue; stage 0 keeps at most ``limit`` microbatches in flight, default
        the number of stages), "1f1b" or "gpipe"; the loss is returned on
        every process and the gradients of this process's parameters (others
        ``None``). ``remat`` wraps each stage's forward (e.g. ``jax.checkpoint``);
        ``remat`` may also name a policy of :mod:`axonn_jax.remat` ("none",
        "full", "save_dots", "offload"); ``timeout`` bounds the wait for a peer stage; ``delay(stage, kind, mb)``
        emulates slow tasks (tests, benchmarks).

        Example:
            >>> step = pm.value_and_grad(lambda logits, t: next_token_loss(logits, t))  # doctest: +SKIP
            >>> loss, grads = step(params, tokens)                                      # doctest: +SKIP
        """
        from axonn_jax.pipeline import (PipelinedValueAndGrad, PipelineOptions, default_inputs,
                                        microbatched_value_and_grad, resolve_remat)  # fmt: skip

        remat = resolve_remat(remat)

        if self.grid.pipeline == 1:
            return microbatched_value_and_grad(self, loss_fn, inputs or default_inputs,
                                               microbatches, remat)  # fmt: skip
        options = PipelineOptions(microbatches, schedule, limit, timeout, remat, delay)
        return PipelinedValueAndGrad(self, loss_fn, inputs=inputs, options=options)

    def train_step(self, loss_fn: Callable, optimizer, *, precision: str = "fp32",
                   offload: bool = False, update_on: str = "host",
                   bucket_bytes: int = 64 * 2**20, **options):  # fmt: skip
        """A complete step ``(params, opt_state, batch) → (params, opt_state, loss)``.

        ``optimizer`` is any optax ``GradientTransformation``; ``step.init(params)``
        returns ``(device params, opt_state)``. ``precision`` ("fp32", "bf16",
        "fp16" with dynamic loss scaling) sets the device dtype of parameters and
        gradients (fp32 master weights); ``offload=True`` keeps master weights and
        optimizer state in host memory (``update_on`` "host", or "device" streamed
        in ``bucket_bytes`` buckets). Other options are those of :meth:`value_and_grad`.

        Example:
            >>> step = pm.train_step(loss_fn, optax.adamw(1e-3), precision="bf16")  # doctest: +SKIP
            >>> params, opt_state = step.init(params)                              # doctest: +SKIP
            >>> params, opt_state, loss = step(params, opt_state, tokens)          # doctest: +SKIP
        """
        from axonn_jax.training import TrainStep

        return TrainStep(self, loss_fn, optimizer, precision=precision, offload=offload,
                         update_on=update_on, bucket_bytes=bucket_bytes, **options)  # fmt: skip

    # --- reports ----------------------------------------------------------
    def report(self, *args, optimizer_slots: int = 2, **kwargs) -> StepReport:
        """Communication and memory of one training step, per device (traced, cached).

        Traces ``jax.value_and_grad`` of ``pm.apply`` on an abstract mesh (no
        devices) and lists every collective of the model's forward and
        backward by kind and mesh axes, plus parameter, gradient, optimizer
        (``optimizer_slots`` fp32 per parameter, 2 for Adam) and saved-for-
        backward bytes. No arguments: the example inputs given to
        ``partition()``. See docs/plan_reports.md.

        Example::

            print(pm.report())                 # plan table, memory, collectives
            pm.report().communication.wire_bytes
        """
        avals = tuple(
            (tuple(np.shape(a)), str(getattr(a, "dtype", np.asarray(a).dtype)))
            for a in jax.tree.leaves((args, kwargs))
        )
        key = (avals, jax.tree.structure((args, kwargs)), optimizer_slots)
        if key not in self._reports:
            self._reports[key] = step_report(self, *args, optimizer_slots=optimizer_slots, **kwargs)
        return self._reports[key]

    def _with_mesh(self, mesh) -> Partitioned:
        """A shallow copy that runs on ``mesh`` (an ``AbstractMesh`` traces without devices)."""
        twin = copy.copy(self)
        twin._mesh = mesh
        return twin

    def _program(self, args, kwargs):
        leaves, static = call_leaves(args, kwargs)
        avals = tuple(
            jax.ShapeDtypeStruct(np.shape(a), a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype)
            for a in leaves
        )
        key = self._signature(avals) + (jax.tree.structure((args, kwargs)), static)
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

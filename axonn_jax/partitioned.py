"""``axonn_jax.partition(model, grid)``: the user-facing entry point.

Example (a user-written jitted train step)::

    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, y=2, z=2), tokens)
    params = pm.init(jax.random.key(0))
    opt = optax.adamw(1e-3)
    opt_state = pm.init_optimizer(opt, params)     # laid out as the step returns it: compiles once

    @jax.jit
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(pm.apply(p, tokens), tokens))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import jax

from axonn_jax.partitioner.balance import StageCosts
from axonn_jax.partitioner.grid import Grid
from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.program import PlanOptions, Program, plan_model
from axonn_jax.runtime import launch
from axonn_jax.runtime.engine import Engine, build_engine
from axonn_jax.runtime.model_call import warn_unseen_intermediates, wrap_params
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.placement import ParamHomes
from axonn_jax.runtime.stage_report import PipelineReport
from axonn_jax.runtime.step_report import StepReport

if TYPE_CHECKING:
    from axonn_jax.perf.machines import Machine


def partition(
    model,
    grid: Grid,
    *example_args,
    strict: bool = False,
    rules: Mapping[str, Sequence] | None = None,
    replicate: Sequence[str] = (),
    stages: Sequence[str] | None = None,
    machine: str | Machine | StageCosts | None = None,
    overlap: Overlap | str = Overlap(),
    scatter_batch: bool = True,
    init_inputs: Sequence | None = None,
    **example_kwargs,
) -> Partitioned:
    """Plan ``model`` for ``grid`` from example inputs (arrays or ShapeDtypeStructs).

    Pure: tracing and planning use abstract shapes only; no device is touched
    until :meth:`Partitioned.init`, :meth:`~Partitioned.shard` or
    :meth:`~Partitioned.apply`. Under ``mpiexec`` it first joins the job's
    processes (:func:`axonn_jax.init`).

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
            by default the cuts minimise the slowest stage (compute plus
            boundary transfers, docs/pipeline.md).
        machine: the machine profile automatic stage cuts are priced with: a
            built-in name (``"perlmutter"``, ``"frontier"``, ``"h100-node"``),
            a profile JSON from ``axonn-jax profile``, an
            ``axonn_jax.perf.Machine``, or the planner's ``StageCosts``
            themselves; default: the ``h100-node`` rates.
        overlap: which communication overlaps to set up (OAG, ORS, OAR; all on
            by default): an :class:`~axonn_jax.runtime.overlap.Overlap` or a
            string such as ``"none"`` or ``"oag,ors"``. Values are identical
            under every setting; only the collectives' scheduling windows differ.
        scatter_batch: reduce-scatter each layer's partial sums onto the batch
            dim (what follows runs on a share of the batch; the next layer
            gathers it back) instead of all-reducing them; the same bytes,
            no repeated work between layers (docs/partitioning.md). False keeps
            the all-reduce form (``axonn_jax.perf`` prices either, by this option).
        init_inputs: a linen model's variables are those ``model.init`` makes of
            these positional inputs, not of the example's: Flax's ``decode=True``
            cache, initialised on the maximum length and called one token at a
            time: ``partition(model, grid, token, mutable=["cache"],
            init_inputs=(jnp.zeros((batch, max_len), jnp.int32),))``.
    """
    if launch.mpi_world_size() > 1:  # join the job (and choose its collectives) before tracing
        launch.init(grid=grid)  # can start JAX's backends
    options = PlanOptions(strict=strict, rules=dict(rules or {}), replicate=tuple(replicate),
                          stages=None if stages is None else tuple(stages),
                          scatter_batch=scatter_batch)  # fmt: skip
    if machine is not None:
        options = dataclasses.replace(options, stage_costs=_stage_costs(machine, grid))
    plan, program = plan_model(model, grid, *example_args, options=options, init_inputs=init_inputs,
                               **example_kwargs)  # fmt: skip
    if isinstance(overlap, str):
        overlap = Overlap.parse(overlap)
    return Partitioned(model, plan, program, options, overlap=overlap)


def _stage_costs(machine, grid: Grid) -> StageCosts:
    """The planner's stage rates from a profile name or path, a ``Machine``, or ``StageCosts``."""
    if isinstance(machine, StageCosts):
        return machine
    from axonn_jax.perf.machines import get

    return (get(machine) if isinstance(machine, str) else machine).stage_costs(grid.stage_size)


class Partitioned:
    """A model planned for a grid: sharded init, placement, and execution.

    The face over the partitioner's :class:`Plan` / :class:`Program` and the
    runtime's :class:`~axonn_jax.runtime.engine.Engine` (chosen here, once:
    one mesh, or pipeline stages; it places the plan at the first device use).
    """

    def __init__(self, model, plan: Plan, program: Program, options: PlanOptions, *,
                 overlap: Overlap = Overlap()):  # fmt: skip
        self.model, self.plan, self.grid = model, plan, plan.grid
        self.options, self.overlap = options, overlap
        self.program: Program = program  # for the example inputs given to partition()
        #: how the model runs (:class:`~axonn_jax.runtime.engine.SingleMesh` or ``Pipelined``)
        self.engine: Engine = build_engine(model, plan, program, options, overlap=overlap)

    # --- programs ---------------------------------------------------------
    def program_for(self, args: tuple, kwargs: dict) -> Program:
        """The :class:`Program` for a call with these inputs (traced once per signature)."""
        return self.engine.program_for(args, kwargs)

    def fingerprint(self) -> dict:
        """What every rank of a job must agree on (see :mod:`axonn_jax.runtime.consistency`)."""
        return self.engine.fingerprint()

    # --- devices ----------------------------------------------------------
    @property
    def mesh(self):
        """The stage mesh ``(data, z, y, x)`` of a grid without pipeline (built on first use)."""
        return self.engine.mesh

    @property
    def stage_meshes(self) -> list:
        """One mesh ``(data, z, y, x)`` per pipeline stage, stage 0 first."""
        return self.engine.placed.meshes

    @property
    def local_stages(self) -> list[int]:
        """The pipeline stages with devices on this process."""
        return self.engine.placed.local

    @property
    def multiprocess(self) -> bool:
        """True when the stages of this grid span more than one process."""
        return self.engine.placed.multiprocess

    @property
    def param_homes(self) -> ParamHomes:
        """Which stages use each parameter and its home stage on this process."""
        return self.engine.placed.homes

    @property
    def transport(self):
        """How stages exchange messages (in-process copies, or MPI between processes)."""
        return self.engine.placed.transport

    @property
    def param_shardings(self):
        """NamedSharding pytree matching the params pytree.

        With ``pipeline > 1`` each leaf is on the mesh of its home stage on this
        process, and leaves of other processes' stages are ``None``.
        """
        return self.engine.placed.param_shardings

    @property
    def param_structs(self):
        """``jax.ShapeDtypeStruct`` pytree of the params: shape, dtype and sharding.

        The checkpoint restore target that checks sizes and dtypes, not only the
        layout (``None`` for other processes' leaves, as in :attr:`param_shardings`)::

            r = ckpt.restore(params=pm.param_structs, optimizer=optimizer)

        For half-precision device parameters, set the dtype:
        ``jax.tree.map(lambda s: s.update(dtype=jnp.bfloat16), pm.param_structs)``.
        """
        shardings = jax.tree.leaves(self.param_shardings, is_leaf=lambda x: x is None)
        leaves = [None if s is None else jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s)
                  for p, s in zip(self.plan.params, shardings)]  # fmt: skip
        return jax.tree.unflatten(self.plan.param_tree, leaves)

    # --- parameters -------------------------------------------------------
    def init(self, key: jax.Array, *args, **kwargs):
        """Initialise parameters directly in their sharded layout.

        The model's init runs under ``jax.jit`` with the plan's output
        shardings, so no device ever holds the full model (with a pipeline,
        one program per stage on this process, each keeping only its leaves).
        nnx modules carry their values already: those are placed with :meth:`shard`.
        """
        del args, kwargs  # shapes come from the example inputs given to partition()
        return self.engine.init(key)

    def shard(self, full_params):
        """Place a full params pytree (e.g. pretrained weights) into the layout.

        Accepts the params tree or the linen variables dict ``{'params': ...}``
        (returned in the same form).
        """
        tree, wrapped = self.engine.plan_tree(full_params)
        return wrap_params(self.engine.placed.shard(tree), wrapped)

    def gather(self, params, opt_state=None):
        """Full parameters back as host NumPy arrays, on every process.

        With a pipeline over several processes, each leaf is gathered on the
        processes of its stage and then sent to the others. Accepts (and
        returns) the params tree or the linen variables dict.

        Given the ``opt_state`` of :meth:`train_step` (``step.init`` / ``step(...)``),
        it returns the float32 master weights kept there instead of the device
        parameters (``precision="bf16"``/``"fp16"``, ``offload=True``; with a
        pipeline, every stage's, whichever process holds it). Any other
        optimizer state (:meth:`init_optimizer`) holds no masters: the
        parameters are returned.

        Example:
            >>> full = pm.gather(params, opt_state)   # fp32 masters of a bf16 step  # doctest: +SKIP
        """
        tree, wrapped = self.engine.plan_tree(params)
        return wrap_params(self.engine.gather(tree, opt_state), wrapped)

    def init_optimizer(self, optimizer, params):
        """``optimizer.init(params)`` laid out as a jitted step returns it, so the step compiles once.

        Parameter-like leaves (Adam moments) take their parameter's layout and
        everything else (step counters) is replicated on :attr:`mesh`. A plain
        ``optimizer.init(params)`` leaves the counters on one device; after the
        first step they live on the mesh, and the step compiles a second time.
        With a pipeline, ``pm.train_step(...).init(params)`` places the state per stage.
        """
        _, wrapped = self.engine.plan_tree(params)
        return self.engine.init_optimizer(optimizer, params, wrap=lambda tree: wrap_params(tree, wrapped))

    def check_params(self, params, *, dtypes: bool = True) -> None:
        """Raise ``ValueError`` naming the first leaf that does not match the plan.

        ``dtypes=False`` accepts floating leaves of another precision (the
        half-precision device parameters of ``train_step(precision=...)``).
        """
        self.engine.placed.check_params(params, dtypes=dtypes)

    # --- execution --------------------------------------------------------
    def apply(self, params, *args, **kwargs):
        """Run the model: same result as ``model.apply({'params': params}, ...)``.

        A pure function of JAX arrays: put it inside your own ``jax.jit`` and
        ``jax.grad``; gradients come back in the parameter layout. Outputs keep
        their batch dim split over (data, z); other dims are gathered.
        ``params`` may be the linen variables dict. As with linen,
        ``rngs={'dropout': key}`` feeds the model's RNG streams (the bits equal
        the plain model's on every grid) and ``mutable=['batch_stats']``
        returns ``(outputs, updates)``; an nnx model with state (BatchStat, RNG
        counters) always returns ``(outputs, {'state': new_state})``.

        Example:
            >>> out, updates = pm.apply(variables, x, rngs={"dropout": key},  # doctest: +SKIP
            ...                         mutable=["batch_stats"])
        """
        return self.engine.apply(params, args, kwargs)

    __call__ = apply

    def forward(self, params, *args, microbatches: int = 1, timeout: float = 60.0, **kwargs):
        """The model's outputs on every grid; with a pipeline, a forward-only pass of the stages.

        With ``pipeline > 1`` the stages run through the dispatch queue (forward
        tasks only, no residuals kept), the batch split into ``microbatches``
        along dim 0 so that stages overlap, and the outputs come back on every
        process as host NumPy arrays. It is eager: call it outside ``jax.jit``
        (to train, use :meth:`value_and_grad` / :meth:`train_step`). Without a
        pipeline it is :meth:`apply`.

        Example:
            >>> logits = pm.forward(params, tokens, microbatches=4)  # doctest: +SKIP
        """
        return self.engine.forward(params, args, kwargs, microbatches=microbatches, timeout=timeout)

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
        asynchronous: bool = True,
        has_aux: bool = False,
    ) -> Callable:
        """``(params, batch) → (loss, grads)`` of ``loss_fn(model outputs, batch)``.

        ``inputs(batch)`` gives the model's inputs: a tuple of positional
        arguments or a dict of keyword arguments (``inputs=lambda b:
        {"inputs": b["x"]}`` for ``def __call__(self, *, inputs)``). Default:
        the batch itself, or its items if it is a tuple; for a dict batch, its
        entries named like the array keywords given to ``partition()``
        (``partition(model, grid, inputs=x)`` then ``step(params, {"inputs": x,
        "targets": y})``). ``loss_fn`` gets the batch as given; microbatches
        split every batch leaf along dim 0. With ``pipeline = 1`` the
        result is a plain jittable function (microbatches accumulate gradients
        in one program). With ``pipeline > 1`` it runs the stages through the
        dispatch queue: ``schedule`` is "message" (AxoNN's message-driven
        queue; stage ``s`` keeps at most ``limit - s`` microbatches in flight,
        default the number of stages + 1), "1f1b", "gpipe", or a zero-bubble
        schedule, which splits each stage's backward into B (input gradients) and W
        (weight gradients) and runs W where a rank would idle: "zb" (message-driven,
        at most ``pipeline`` deferred W's per stage), "zb-h1" (static) or, on a grid with
        ``placement="v"``, "zb-v" (static ZB-V, one order per rank); the loss is returned on
        every process and the gradients of this process's parameters (others
        ``None``). ``remat`` wraps each stage's forward (e.g. ``jax.checkpoint``);
        ``remat`` may also name a policy of :mod:`axonn_jax.runtime.remat` ("none",
        "full", "save_dots", "offload"); ``timeout`` bounds the wait for a peer stage; ``delay(stage, kind, mb)``
        emulates slow tasks (tests, benchmarks). Stage programs are launched
        asynchronously, so the stages of one process compute at the same time;
        ``asynchronous=False`` runs one task at a time (a baseline, or to debug).

        ``has_aux=True``: as ``jax.value_and_grad``'s, ``loss_fn`` returns ``(loss, aux)``,
        ``aux`` any pytree of arrays (metrics), and the step returns ``((loss, aux),
        grads)``. With microbatches, every aux leaf is averaged over them as the loss is
        (so return per-batch statistics such as means, in floating point); with a
        pipeline, it is computed on the last stage and returned, as host arrays, on every
        process, like the loss.

        Example:
            >>> step = pm.value_and_grad(lambda logits, t: next_token_loss(logits, t))  # doctest: +SKIP
            >>> loss, grads = step(params, tokens)                                      # doctest: +SKIP
            >>> step = pm.value_and_grad(lambda logits, t: (next_token_loss(logits, t),  # doctest: +SKIP
            ...                                             {"acc": accuracy(logits, t)}), has_aux=True)
            >>> (loss, metrics), grads = step(params, tokens)                           # doctest: +SKIP
        """
        warn_unseen_intermediates(self.program.traced)
        return self.engine.value_and_grad(loss_fn, inputs=inputs, microbatches=microbatches,
                                          schedule=schedule, limit=limit, timeout=timeout, remat=remat,
                                          delay=delay, asynchronous=asynchronous, has_aux=has_aux)  # fmt: skip

    def train_step(self, loss_fn: Callable, optimizer, *, precision: str = "fp32",
                   offload: bool = False, update_on: str = "host",
                   bucket_bytes: int = 64 * 2**20, prefetch: bool = False, **options):  # fmt: skip
        """A complete step ``(params, opt_state, batch) → (params, opt_state, loss)``
        (``(loss, aux)`` in place of ``loss`` with ``has_aux=True``, see :meth:`value_and_grad`).

        ``optimizer`` is any optax ``GradientTransformation``; ``step.init(params)``
        returns ``(device params, opt_state)``. ``precision`` ("fp32", "bf16",
        "fp16" with dynamic loss scaling) sets the device dtype of parameters and
        gradients (fp32 master weights); ``offload=True`` keeps master weights and
        optimizer state in host memory (``update_on`` "host", or "device" streamed
        in ``bucket_bytes`` buckets, one on the device at a time, two with
        ``prefetch``). Other options are those of :meth:`value_and_grad`.

        Example:
            >>> step = pm.train_step(loss_fn, optax.adamw(1e-3), precision="bf16")  # doctest: +SKIP
            >>> params, opt_state = step.init(params)                              # doctest: +SKIP
            >>> params, opt_state, loss = step(params, opt_state, tokens)          # doctest: +SKIP
        """
        warn_unseen_intermediates(self.program.traced)
        return self.engine.train_step(loss_fn, optimizer, precision=precision, offload=offload,
                                      update_on=update_on, bucket_bytes=bucket_bytes, prefetch=prefetch,
                                      **options)  # fmt: skip

    # --- reports ----------------------------------------------------------
    def report(self, *args, optimizer_slots: int = 2, loss_fn: Callable | None = None, batch=None,
               **kwargs) -> StepReport | PipelineReport:  # fmt: skip
        """Communication and memory of one training step, per device (traced, cached).

        Traces ``jax.value_and_grad`` of ``pm.apply`` on an abstract mesh (no
        devices) and lists every collective of the model's forward and
        backward by kind and mesh axes, plus parameter, gradient, optimizer
        (``optimizer_slots`` fp32 per parameter, 2 for Adam) and saved-for-
        backward bytes. No arguments: the example inputs given to
        ``partition()``. See docs/plan_reports.md.

        On a pipeline grid it is a :class:`~axonn_jax.runtime.stage_report.PipelineReport`:
        each stage's step traced on its own (``.stages``: collectives,
        memory, FLOPs per device, the bytes sent to the neighbouring stages)
        and ``.compute`` summed over the stages (the same redundancy as
        without pipeline).

        ``loss_fn`` (with one call's ``batch``, as ``value_and_grad`` gets
        them): the step with the loss planned with the model, its reductions
        over the split logits and its FLOPs included (``ValueError`` when that
        loss cannot be planned: the step then runs it after the gathered outputs).

        Example::

            print(pm.report())                 # plan table, memory, collectives
            pm.report().communication.wire_bytes
            pm.report(tokens, loss_fn=lambda logits, t: next_token_loss(logits, t), batch=tokens)
        """
        return self.engine.report(args, kwargs, optimizer_slots=optimizer_slots, loss_fn=loss_fn, batch=batch)


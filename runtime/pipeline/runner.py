"""Pipelined training steps: ``pm.value_and_grad(loss_fn)`` when ``grid.pipeline > 1``.

Each process runs the stages it owns (one per process under ``mpiexec``, or
``virtual`` of them with virtual stages; all of them in a single process) through the dispatch queue
(:mod:`axonn_jax.runtime.pipeline.dispatch`); activations and gradients move through
a transport (in-process device copies, or MPI between processes).

Parameters of a pipelined model form the model's usual pytree in which every
leaf lives on the mesh of the first stage (on this process) that uses it, and
leaves used by no stage of this process are ``None``. A parameter used by
several stages (tied embeddings) is copied to each of them and its gradient is
the sum of theirs, on every process that holds it.

Example (``mpiexec -n 2 python train.py``)::

    pm = axonn_jax.partition(model, axonn_jax.Grid(pipeline=2), tokens)
    params = pm.init(jax.random.key(0))        # this rank's stage only
    step = pm.value_and_grad(loss_fn, microbatches=4)
    loss, grads = step(params, tokens)         # grads: this rank's stage
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from axonn_jax.partitioner.program import Program
from axonn_jax.partitioner.trace import call_leaves
from axonn_jax.runtime.executor import Executor
from axonn_jax.runtime.model_call import ModelCall, mean_updates
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.pipeline import timeline
from axonn_jax.runtime.pipeline.dispatch import DispatchQueue
from axonn_jax.runtime.pipeline.tasks import TrainingRun
from axonn_jax.runtime.pipeline.schedules import check_schedule
from axonn_jax.runtime.pipeline.stage_program import StageProgram
from axonn_jax.runtime.pipeline.state_updates import deliver_updates
from axonn_jax.runtime.placement import PlacedModel
from axonn_jax.runtime.sharded import batch_sharding, place

#: ``programs(args, kwargs)`` → the Program of the model called on those inputs
ProgramSource = Callable[[tuple, dict], Program]


def default_inputs(batch) -> tuple:
    """The model's positional arguments from a batch: the batch itself, or its items."""
    if isinstance(batch, Mapping):
        raise TypeError(
            f"the batch is a dict (keys {sorted(batch)}), so which entries the model takes "
            "cannot be guessed. Remedy: pass inputs=, e.g. pm.value_and_grad(loss_fn, "
            "inputs=lambda batch: (batch['input_ids'],)) (the same for pm.train_step)."
        )
    return tuple(batch) if isinstance(batch, tuple) else (batch,)


def check_microbatches(microbatches) -> int:
    """``microbatches`` as a positive int, or ``ValueError`` naming what was given."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, (int, np.integer)) \
            or microbatches < 1:  # fmt: skip
        raise ValueError(
            f"microbatches must be a positive integer, got {microbatches!r}. Remedy: "
            "microbatches=1 (no splitting) or the number of slices of the batch, e.g. 4."
        )
    return int(microbatches)


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How a pipelined step runs (see :meth:`axonn_jax.Partitioned.value_and_grad`)."""

    microbatches: int = 1
    schedule: str = "message"
    limit: int | None = None
    timeout: float = 60.0
    remat: Callable | None = None
    delay: Callable | None = None
    asynchronous: bool = True  # launch stage programs without waiting (False: one at a time)

    def __post_init__(self) -> None:
        check_schedule(self.schedule)
        check_microbatches(self.microbatches)
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 microbatch in flight, got {self.limit}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")


class PipelinedValueAndGrad:
    """``(params, batch) → (loss, grads)`` for a model placed on pipeline stages.

    The loss is the mean of the microbatch losses (equal to the full-batch loss
    for losses that average over examples) and is returned on every process;
    ``grads`` holds this process's leaves (``None`` elsewhere).

    Args:
        placed: the model on this process's stage meshes.
        programs: the :class:`Program` of the model for given call inputs.
        loss_fn: ``loss_fn(model outputs, batch) → scalar``, on the last stage.
        inputs: ``inputs(batch)`` → the model's positional arguments.
    """

    def __init__(self, placed: PlacedModel, programs: ProgramSource, loss_fn: Callable, *,
                 inputs: Callable | None, options: PipelineOptions,
                 overlap: Overlap = Overlap(), call: ModelCall | None = None):  # fmt: skip
        self.call = call or ModelCall({}, stateful=False, mutable=())
        self.call.check_microbatches(options.microbatches)
        self.placed, self.programs, self.loss_fn = placed, programs, loss_fn
        self.inputs = inputs or default_inputs
        self.options, self.overlap = options, overlap
        self.last_result: TrainingRun | None = None

    # --- program set-up (once per input shapes) ------------------------------
    def _setup(self, args, kwargs) -> tuple[Program, list[StageProgram]]:
        program = self.programs(args, kwargs)
        # shared by every step object with the same inputs, loss, remat and overlap: compiled once
        cache = self.placed.stage_programs
        key = (program.signature, self.loss_fn, self.options.remat, self.overlap)
        if key not in cache:
            executor = Executor(program, overlap=self.overlap)
            meshes = self.placed.meshes
            last = len(program.stage_flows) - 1
            call, loss_fn = self.call, self.loss_fn

            def model_loss(result, batch):  # (outputs, updates) of a model with state → outputs
                return loss_fn(call.outputs(result)[0], batch)

            stages = [
                StageProgram(f, executor, meshes[f.index], last=f.index == last,
                             out_tree=program.out_tree, loss_fn=model_loss,
                             remat=self.options.remat, trainable=program.traced.trainable)  # fmt: skip
                for f in program.stage_flows
            ]
            cache[key] = (program, stages)
        return cache[key]

    # --- one step ---------------------------------------------------------------
    def __call__(self, params, batch, rngs=None) -> tuple[Any, Any]:
        placed, opts = self.placed, self.options
        plan, grid = placed.plan, placed.grid
        m = opts.microbatches
        batch_leaves, batch_tree = jax.tree.flatten(batch)
        size = _check_batch(batch_leaves, m, grid)
        mb_size = size // m

        def microbatch(mb):
            leaves = [leaf[mb * mb_size : (mb + 1) * mb_size] for leaf in batch_leaves]
            return jax.tree.unflatten(batch_tree, leaves)

        def call_kwargs(mb):  # RNG keys: one stream per microbatch, the same on every stage
            return self.call.kwargs(rngs, mb, m)

        example = self.inputs(microbatch(0))
        _, programs = self._setup(example, call_kwargs(0))
        local = placed.homes.local
        leaves = placed.param_leaves(params)
        stage_params = {
            s: [_on(_planned(leaves[i], plan.params[i]), programs[s].param_sharding(i))
                for i in programs[s].flow.params]
            for s in local
        }
        args_cache: dict = {}

        def stage_args(s, mb):
            if (s, mb) not in args_cache:
                arg_leaves, _ = call_leaves(self.inputs(microbatch(mb)), call_kwargs(mb))
                prog = programs[s]
                args_cache[(s, mb)] = [
                    place(arg_leaves[j], prog.sharding(prog.executor.arg_layouts[j]))
                    for j in prog.flow.args
                ]
            return args_cache.pop((s, mb))

        last_mesh = programs[-1].mesh

        def loss_batch(mb):
            return jax.tree.map(
                lambda x: place(x, batch_sharding(last_mesh, grid, np.shape(x))), microbatch(mb)
            )

        if not all(programs[s].compiled for s in local):
            self._compile(programs, stage_params, stage_args, loss_batch)
        queue = DispatchQueue(programs, local, placed.transport, schedule=opts.schedule,
                              limit=opts.limit, timeout=opts.timeout, delay=opts.delay,
                              asynchronous=opts.asynchronous)  # fmt: skip
        result = queue.run_training(stage_params, stage_args, loss_batch, m)
        self.last_result = result
        grads, updated = self._combine(result, programs, leaves, m)
        loss = self._loss(result)
        grads = jax.tree.unflatten(plan.param_tree, grads)
        if not self.call.stateful:
            return loss, grads
        new_state = [u if u is not None else x for u, x in zip(updated, leaves)]
        _, state = self.call.split(jax.tree.unflatten(plan.param_tree, new_state))
        return (loss, state), self.call.split(grads)[0]

    def _compile(self, programs, stage_params, stage_args, loss_batch) -> None:
        """Compile every local stage, then wait for all processes to have done so."""
        last = len(programs) - 1
        for s in self.placed.homes.local:
            programs[s].compile(stage_params[s], stage_args(s, 0), loss_batch(0) if s == last else None)
        self.placed.host.barrier()  # a peer still compiling must not look like a dead peer

    def trace(self, json_path=None, png_path=None, title: str = "pipeline timeline"):
        """The last step's tasks of every rank (on rank 0; ``None`` elsewhere).

        Writes a Chrome/Perfetto trace JSON and a PNG timeline when paths are given.
        """
        if self.last_result is None:
            raise RuntimeError("no step has run yet: call the step first, then trace()")
        rows = timeline.gather(self.last_result, self.placed.host)
        if rows is not None:
            if json_path is not None:
                timeline.write_chrome_trace(json_path, rows)
            if png_path is not None:  # virtual stages: one row per pipeline rank (its devices)
                grid = self.placed.grid
                timeline.plot_timeline(png_path, rows, title,
                                       grid.pipeline if grid.virtual > 1 else None)  # fmt: skip
        return rows

    def _combine(self, result: TrainingRun, programs, leaves, m: int) -> tuple[list, list]:
        """Per-leaf gradient on its home mesh (the sum over local stages, divided by m), and
        the state updates (mean over microbatches; ``None`` where a leaf was not updated)."""
        homes = self.placed.homes
        grads: list = [None] * len(leaves)
        summed_updates = {}
        for s, stage_grads in result.grads.items():
            prog = programs[s]
            trained = [prog.flow.params[k] for k in prog.trained]
            for i, g in zip(trained, stage_grads):
                g = _on(g, leaves[i].sharding)
                grads[i] = g if grads[i] is None else grads[i] + g
            summed_updates[s] = result.updates[s]
        updated = deliver_updates(self.placed, programs, summed_updates, leaves, m)
        for i in range(len(leaves)):
            if homes.is_local(i) and grads[i] is None:  # used by no stage, or model state
                grads[i] = jax.numpy.zeros_like(leaves[i])
        grads = _divided(grads, m)
        shared = self.placed.host.sum_shared(grads, homes.users, homes.home, homes.shared(), self.placed.meshes)
        return shared, updated

    def _loss(self, result: TrainingRun):
        """Mean microbatch loss, computed on the last stage and sent to every process."""
        local = float(np.mean([float(x) for x in result.losses])) if result.losses else 0.0
        last_owner = min(d.process_index for d in self.placed.meshes[-1].devices.flat)
        return np.float32(self.placed.host.broadcast(local, root=last_owner))


def _check_batch(leaves, microbatches: int, grid) -> int:
    """The batch size, after checking it splits into ``microbatches`` × data × z."""
    if not leaves:
        raise ValueError("the batch is empty: pass the model inputs (and targets) as arrays")
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            f"every batch leaf needs the same leading batch dimension; got sizes {sorted(sizes)}"
        )
    size = sizes.pop()
    need = microbatches * grid.data * grid.z
    if microbatches < 1 or size % need:
        raise ValueError(
            f"batch size {size} is not divisible by microbatches × data × z = {microbatches} × "
            f"{grid.data} × {grid.z} = {need} (grid {grid}). Remedy: use a batch size that is a "
            "multiple of it, or fewer microbatches."
        )
    return size


def _planned(x: jax.Array, param) -> jax.Array:
    """A (possibly half-precision) parameter in the dtype the stage programs were built for."""
    return x if x.dtype == np.dtype(param.dtype) else x.astype(param.dtype)


def _on(x: jax.Array, sharding) -> jax.Array:
    """``x`` laid out as ``sharding``: moved only when the layout differs (specs that differ in
    size-1 axes only are the same layout; re-placing every leaf each step cost ~10 ms)."""
    if x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return jax.device_put(x, sharding)


def _divided(grads: list, m: int) -> list:
    """``g / m`` for every gradient (``None`` stays), one compiled call per device group
    instead of one eager division per leaf (a step's fixed cost)."""
    groups: dict = {}
    for i, g in enumerate(grads):
        if g is not None:
            groups.setdefault(tuple(d.id for d in g.sharding.device_set), []).append(i)
    out = list(grads)
    for indices in groups.values():
        for i, g in zip(indices, _divide([grads[i] for i in indices], m)):
            out[i] = g
    return out


@jax.jit
def _divide(grads: list, m):
    return [g / m for g in grads]  # m traced, as the eager division's scalar was: same bits


def microbatched_value_and_grad(apply: Callable, grid, loss_fn: Callable, inputs: Callable,
                                microbatches: int, remat: Callable | None = None,
                                call: ModelCall | None = None) -> Callable:  # fmt: skip
    """Without a pipeline: a jittable ``(variables, batch, rngs=None) → (loss, grads)``.

    ``apply(variables, *args, **kwargs)`` runs the model. Microbatches run one
    after another in the same program and their gradients are averaged (the
    loss is the mean of the microbatch losses). A model with state returns
    ``((loss, updates), grads)``, ``grads`` for ``variables['params']`` only
    (see :mod:`axonn_jax.runtime.model_call`).
    """
    call = call or ModelCall({}, stateful=False, mutable=())
    microbatches = check_microbatches(microbatches)
    call.check_microbatches(microbatches)

    def loss_of(params, state, batch, rngs, mb):
        result = apply(call.merge(params, state), *inputs(batch), **call.kwargs(rngs, mb, microbatches))
        outputs, updates = call.outputs(result)
        return loss_fn(outputs, batch), updates

    grad_fn = jax.value_and_grad(remat(loss_of) if remat else loss_of, has_aux=True)

    def value_and_grad(variables, batch, rngs=None):
        params, state = call.split(variables)
        leaves, tree = jax.tree.flatten(batch)
        size = _check_batch(leaves, microbatches, grid) // microbatches if microbatches > 1 else 0
        losses, updates, total = [], [], None
        for mb in range(microbatches):
            part = batch if microbatches == 1 else \
                jax.tree.unflatten(tree, [x[mb * size : (mb + 1) * size] for x in leaves])  # fmt: skip
            (loss, new_state), grads = grad_fn(params, state, part, rngs, mb)
            losses.append(loss)
            updates.append(new_state)
            total = grads if total is None else jax.tree.map(jax.numpy.add, total, grads)
        loss = losses[0] if microbatches == 1 else sum(losses[1:], losses[0]) / microbatches
        grads = total if microbatches == 1 else jax.tree.map(lambda g: g / microbatches, total)
        if not call.stateful:
            return loss, grads
        return (loss, mean_updates(updates)), grads

    return value_and_grad

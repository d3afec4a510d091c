"""Pipelined training steps: ``(params, batch) → (loss, grads)`` through the dispatch queue.

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
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner.program import call_signature
from axonn_jax.runtime.collectives import broadcast_or_raise
from axonn_jax.runtime.loss_program import BATCH_KEYWORD, ScalarLoss, mean_aux, not_planned_note, scaled_loss
from axonn_jax.runtime.microbatches import batch_slices, check_microbatches
from axonn_jax.runtime.model_call import ModelCall, unwrap_params, wrap_params
from axonn_jax.runtime.pipeline import timeline
from axonn_jax.runtime.agreement import agree_on_call, call_description
from axonn_jax.runtime.pipeline.dispatch import DispatchQueue
from axonn_jax.runtime.pipeline.layer_rows import owned_rows, whole_gradient
from axonn_jax.runtime.pipeline.schedules import check_schedule, splits_weights
from axonn_jax.runtime.pipeline.setup import StagePrograms, compile_stages, stage_inputs
from axonn_jax.runtime.pipeline.stage_program import StageProgram
from axonn_jax.runtime.pipeline.state_updates import deliver_updates
from axonn_jax.runtime.pipeline.tasks import TrainingRun
from axonn_jax.runtime.placement import PlacedModel
from axonn_jax.runtime.sharded import batch_sharding, place


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
    """``(params, batch, rngs=None) → (loss, grads)`` for a model placed on pipeline stages.

    The loss is the mean of the microbatch losses (equal to the full-batch loss
    for losses that average over examples) and is returned on every process;
    ``grads`` holds this process's leaves (``None`` elsewhere). A model with
    state returns ``((loss, new state), grads)``. ``loss_scale`` (an fp16
    step's dynamic scale) multiplies every microbatch's loss before its
    backward: loss and gradients come back scaled, and a new scale compiles
    nothing (it is one more input of the last stage, beside the batch).

    Args:
        stages: the model's stage programs (the engine's cache).
        placed: the model on this process's stage meshes.
        call: how the model is called (flags, RNG streams, state).
        loss_fn: ``loss_fn(model outputs, batch) → (loss, aux)``, on the last stage (a
            :class:`~axonn_jax.runtime.loss_program.ScalarLoss`: with ``has_aux`` the step's
            loss is ``(loss, aux)``, the aux averaged over microbatches).
        inputs: ``inputs(batch)`` → the model's inputs: a tuple (positional) or a dict (keywords).
    """

    def __init__(self, stages: StagePrograms, placed: PlacedModel, call: ModelCall, loss_fn: ScalarLoss, *,
                 inputs: Callable, options: PipelineOptions):  # fmt: skip
        call.check_microbatches(options.microbatches)
        self.stages, self.placed, self.call, self.loss_fn = stages, placed, call, loss_fn
        self._scaled = scaled_loss(loss_fn)  # (outputs, (batch, scale)) → loss · scale
        self.inputs, self.options = inputs, options
        self.last_result: TrainingRun | None = None
        #: input signature → why the loss of that call runs after the model's gathered outputs
        self.loss_notes: dict = {}
        self._used: dict = {}  # model call signature → the stage programs its last step ran

    def stage_programs(self, args: tuple, kwargs: dict | None = None, *, scaled: bool = False) -> list[StageProgram]:
        """Every stage's program for one microbatch's model inputs (built and cached on first use;
        ``scaled``: the loss multiplied by a loss scale that comes with the batch)."""
        kwargs = kwargs or {}
        used = self._used.get((call_signature(args, kwargs), scaled))  # the last step's, planned or not
        if used is not None:
            return used
        _, programs = self.stages.training(args, kwargs, self._loss_fn(scaled), remat=self.options.remat,
                                           call=self.call)  # fmt: skip
        return programs

    def _loss_fn(self, scaled: bool) -> Callable:
        return self._scaled if scaled else self.loss_fn

    # --- one step ---------------------------------------------------------------
    def __call__(self, params, batch, rngs=None, *, loss_scale=None) -> tuple[Any, Any]:
        placed, m, opts = self.placed, self.options.microbatches, self.options
        self._agree(batch, rngs, loss_scale)
        params, wrapped = unwrap_params(params, placed.plan.param_tree)  # linen's {'params': tree}
        microbatch = loss_microbatch = batch_slices(batch, m, placed.grid)
        if loss_scale is not None:  # the loss's batch: (microbatch, scale); the scale replicated
            scale = place(loss_scale, NamedSharding(placed.meshes[-1], P()))
            loss_microbatch = _with_scale(microbatch, scale)

        def model_call(mb):  # RNG keys: one stream per microbatch, the same on every stage
            return self.call.of_inputs(self.inputs(microbatch(mb)), rngs, mb, m)

        programs, call, planned = self._stages(model_call, loss_microbatch, scaled=loss_scale is not None)
        leaves, inputs, error = stage_inputs(programs, placed, lambda: placed.param_leaves(params), call)
        last_mesh, last = programs[-1].mesh, len(programs) - 1

        def loss_batch(mb):  # planned: the batch is an argument of the last stage's program
            return None if planned else jax.tree.map(
                lambda x: place(x, batch_sharding(last_mesh, placed.grid, np.shape(x))), loss_microbatch(mb))

        split = splits_weights(opts.schedule)
        compile_stages(programs, placed, lambda st: st.split_compiled if split else st.compiled,
                       lambda s: programs[s].compile(inputs.params[s], inputs.args(s, 0),
                                                     loss_batch(0) if s == last else None, split=split),
                       error)  # fmt: skip
        queue = DispatchQueue(programs, placed.homes.local, placed.transport, schedule=opts.schedule,
                              limit=opts.limit, timeout=opts.timeout, delay=opts.delay,
                              asynchronous=opts.asynchronous)  # fmt: skip
        result = queue.run_training(inputs.params, inputs.args, loss_batch, m)
        self.last_result = result
        grads, updated = self._combine(result, programs, leaves, m)
        loss = self._loss(result)
        grads = jax.tree.unflatten(placed.plan.param_tree, grads)
        if not self.call.stateful:
            return loss, wrap_params(grads, wrapped)
        new_state = [u if u is not None else x for u, x in zip(updated, leaves)]
        _, state = self.call.split(jax.tree.unflatten(placed.plan.param_tree, new_state))
        return (loss, state), self.call.split(grads)[0]

    def _agree(self, batch, rngs, loss_scale) -> None:
        """Every process makes this step with the same batch shapes (and, with
        ``AXONN_JAX_CHECK_BATCH=1``, values), or all raise within the timeout
        (:mod:`~axonn_jax.runtime.agreement`): before anything compiles or runs."""
        described = call_description(dict(batch=batch, rngs=rngs), microbatches=self.options.microbatches,
                                     loss_scale=None if loss_scale is None else np.shape(loss_scale))  # fmt: skip
        agree_on_call(self.placed.host, "train step", described, self.options.timeout)

    def _stages(self, model_call: Callable, microbatch: Callable, *,
                scaled: bool) -> tuple[list[StageProgram], Callable, bool]:  # fmt: skip
        """Every stage's program, each microbatch's call, and whether the loss is planned with the
        last stage (``microbatch(mb)``, the batch the loss reads, then one more keyword of the
        call); a loss that cannot be planned runs after the model's outputs, with a note in
        :attr:`loss_notes`."""

        def planned_call(mb):
            args, kwargs = model_call(mb)
            return args, {**kwargs, BATCH_KEYWORD: microbatch(mb)}

        first = model_call(0)  # one microbatch's call: its signature and shapes build the programs
        first_planned = (first[0], {**first[1], BATCH_KEYWORD: microbatch(0)})
        key = (call_signature(*first), scaled)
        try:
            _, programs = self.stages.planned_training(*first_planned, self._loss_fn(scaled),
                                                       remat=self.options.remat, call=self.call)  # fmt: skip
            self._used[key] = programs
            return programs, planned_call, True
        except Exception as err:  # noqa: BLE001 - any failure keeps the exact old path
            self.loss_notes[call_signature(*first_planned)] = not_planned_note(err)
            self._used.pop(key, None)
            return self.stage_programs(*first, scaled=scaled), model_call, False

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
                                       grid.placements if grid.virtual > 1 else None)  # fmt: skip
        return rows

    def _combine(self, result: TrainingRun, programs, leaves, m: int) -> tuple[list, list]:
        """Per-leaf gradient on its home mesh (the sum over local stages, divided by m), and
        the state updates (mean over microbatches; ``None`` where a leaf was not updated)."""
        placed, homes = self.placed, self.placed.homes
        grads: list = [None] * len(leaves)
        for s, stage_grads in result.grads.items():
            prog = programs[s]
            for i, g in zip([prog.flow.params[k] for k in prog.trained], stage_grads):
                g = whole_gradient(place(g, leaves[i].sharding), prog.flow.rows_of(i), leaves[i])
                grads[i] = g if grads[i] is None else grads[i] + g
        updated = deliver_updates(placed, programs, result.updates, leaves, m)
        for i in range(len(leaves)):
            if homes.is_local(i) and grads[i] is None:  # used by no stage, or model state
                grads[i] = jax.numpy.zeros_like(leaves[i])
        grads = _divided(grads, m)
        rows = owned_rows([p.flow for p in programs], homes.users, homes.shared())
        return placed.host.sum_shared(grads, homes.users, homes.home, homes.shared(), placed.meshes, rows), updated

    def _loss(self, result: TrainingRun):
        """The loss as the step returns it: the mean microbatch loss (with ``has_aux``, and
        their mean aux, as host arrays), computed on the last stage and sent to every process."""

        def local():  # a refused aux raises on every process, not only here
            loss = float(np.mean([float(value) for value, _ in result.losses]))
            return loss, jax.tree.map(np.asarray, mean_aux([aux for _, aux in result.losses]))

        last_owner = min(d.process_index for d in self.placed.meshes[-1].devices.flat)
        loss, aux = broadcast_or_raise(self.placed.host, local, last_owner, "the loss's aux")
        return self.loss_fn.value(np.float32(loss), aux)


def _with_scale(microbatch: Callable, scale) -> Callable:
    """``mb → (microbatch(mb), scale)``: the batch a scaled loss reads (:func:`scaled_loss`)."""
    return lambda mb: (microbatch(mb), scale)


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

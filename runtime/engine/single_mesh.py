"""The engine of a grid without pipeline: the whole model as one shard_mapped program on one mesh."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner.trace import call_leaves
from axonn_jax.runtime.agreement import agree_on_call, call_description
from axonn_jax.runtime.engine.base import Engine, is_traced
from axonn_jax.runtime.master_optimizer import check_optimizer, optimizer_state_shardings
from axonn_jax.runtime.microbatches import batch_slices, check_microbatches
from axonn_jax.runtime.loss_program import ScalarLoss, mean_aux, scaled
from axonn_jax.runtime.model_call import ModelCall, mean_updates
from axonn_jax.runtime.precision import as_planned
from axonn_jax.runtime.sharded import onto_mesh, place, program_function
from axonn_jax.runtime.step_report import StepReport, step_report
from axonn_jax.runtime.train_step import SingleMeshStep


class SingleMesh(Engine):
    """One shard_mapped program per input signature over the grid's one mesh.

    :meth:`apply` is a pure function of JAX arrays (usable inside ``jax.jit``
    and ``jax.grad``); :meth:`value_and_grad` is jittable and accumulates
    microbatches in one program; a train step is one jitted program.
    """

    step_type = SingleMeshStep

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._functions: dict = {}  # program signature → jitted program function

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.placed.meshes[0]

    # --- execution ------------------------------------------------------------
    def apply(self, params, args, kwargs, *, timeout: float = 60.0):
        params, _ = self.plan_tree(params)
        if self.placed.multiprocess and not is_traced((params, args, kwargs)):  # eager: agree first
            agree_on_call(self.placed.host, "pm.apply", call_description(dict(args=args, kwargs=kwargs)), timeout)
        arg_leaves = onto_mesh(call_leaves(args, kwargs)[0], self.mesh, self.grid)  # a batch put elsewhere
        program = self.program_for(args, kwargs)
        self.placed.check_params(params, dtypes=False)  # names, shapes, dtypes: a wrong tree never runs
        params = jax.tree.map(place, params, self.placed.param_shardings)  # another grid's layout
        params = as_planned(params, self.plan)  # a bf16 step's params: cast to the dtypes planned
        if program.signature not in self._functions:  # one jitted function per input signature
            self._functions[program.signature] = program_function(program, self.mesh, overlap=self.overlap)
        try:
            outs = self._functions[program.signature](list(jax.tree.leaves(params)), list(arg_leaves))
        except TypeError as err:
            if "forward-mode autodiff" not in str(err):
                raise
            raise TypeError(
                f"forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) through pm.apply on "
                f"grid {self.grid}: its split matmuls define their reverse-mode derivative only "
                "(jax.custom_vjp: the gradient reductions they schedule). Remedy: reverse mode "
                "(jax.grad, jax.vjp, jax.jacrev; a Hessian as jax.jacrev(jax.jacrev(f))), or a grid "
                "with x = y = z = 1 (data parallel), where no matmul is split.") from err  # fmt: skip
        return jax.tree.unflatten(program.out_tree, outs)

    def forward(self, params, args, kwargs, *, microbatches=1, timeout=60.0):
        del microbatches  # one program: nothing to overlap
        return self.apply(params, args, kwargs, timeout=timeout)

    def _value_and_grad(self, loss_fn, inputs, microbatches, remat, pipeline):
        del pipeline  # no dispatch queue
        from axonn_jax.runtime.planned_loss import PlannedLoss

        planned = PlannedLoss(self, loss_fn)  # the loss planned with the model (or, failing that, after it)
        step = microbatched_value_and_grad(self.apply, self.grid, loss_fn, inputs, microbatches, remat,
                                           self.call, model_loss=planned, mesh=self.mesh)  # fmt: skip
        step.loss_notes = planned.notes
        return step

    def _build_report(self, program, args, kwargs, *, optimizer_slots) -> StepReport:
        return step_report(self.plan, program, args, kwargs, overlap=self.overlap, optimizer_slots=optimizer_slots)

    # --- optimizer state ------------------------------------------------------
    def init_optimizer(self, optimizer, params, *, wrap=lambda tree: tree):
        check_optimizer(optimizer)
        param_shardings = wrap(self.placed.param_shardings)
        if self.call.stateful:  # the optimizer sees params only, never the BatchNorm statistics
            params, param_shardings = self.trainable(params), self.call.split(self.placed.param_shardings)[0]
        shardings = optimizer_state_shardings(optimizer, params, param_shardings, NamedSharding(self.mesh, P()))
        return jax.jit(optimizer.init, out_shardings=shardings)(params)

    def pack_states(self, states):
        return states[0]  # the one mesh: a state, not a dict of them

    def unpack_states(self, packed):
        from axonn_jax.runtime.master_optimizer import MasterState

        return {0: packed} if isinstance(packed, MasterState) else None


def microbatched_value_and_grad(apply: Callable, grid, loss_fn: ScalarLoss, inputs: Callable,
                                microbatches: int, remat: Callable | None = None,
                                call: ModelCall | None = None,
                                model_loss: Callable | None = None, mesh=None) -> Callable:  # fmt: skip
    """A jittable ``(variables, batch, rngs=None) → (loss, grads)`` on one mesh.

    ``apply(variables, args, kwargs)`` runs the model. Microbatches run one
    after another in the same program and their gradients are averaged (the
    loss is the mean of the microbatch losses). With ``loss_fn.has_aux`` the
    loss is ``(loss, aux)``, the aux averaged over microbatches like the loss
    (:func:`~axonn_jax.runtime.loss_program.mean_aux`). A model with state returns
    ``((loss, updates), grads)``, ``grads`` for ``variables['params']`` only
    (see :mod:`axonn_jax.runtime.model_call`). ``model_loss(variables, args,
    kwargs, batch, loss_scale=None) → ((loss, aux), updates)``, when given, computes the
    loss of one model call itself (:class:`~axonn_jax.runtime.planned_loss.PlannedLoss`).
    ``loss_scale`` (an fp16 step's dynamic scale, an array) multiplies the loss
    that is differentiated (and returned); an input, so a new scale compiles nothing.
    ``mesh``: batch arrays the caller put on other devices are moved onto it
    (:func:`~axonn_jax.runtime.sharded.onto_mesh`).
    """
    call = call or ModelCall({}, stateful=False, mutable=())
    microbatches = check_microbatches(microbatches)
    call.check_microbatches(microbatches)

    def loss_of(params, state, batch, rngs, mb, loss_scale):
        args, kwargs = call.of_inputs(inputs(batch), rngs, mb, microbatches)
        if model_loss is not None:
            (loss, aux), updates = model_loss(call.merge(params, state), args, kwargs, batch, loss_scale=loss_scale)
            return loss, (aux, updates)
        outputs, updates = call.outputs(apply(call.merge(params, state), args, kwargs))
        loss, aux = loss_fn(outputs, batch)
        return scaled(loss, loss_scale), (aux, updates)

    grad_fn = jax.value_and_grad(remat(loss_of) if remat else loss_of, has_aux=True)

    def value_and_grad(variables, batch, rngs=None, *, loss_scale=None):
        params, state = call.split(variables)
        if mesh is not None:  # a batch put elsewhere: the loss reads it beside the outputs
            batch = onto_mesh(batch, mesh, grid)
        part = (lambda mb: batch) if microbatches == 1 else batch_slices(batch, microbatches, grid)
        losses, auxes, updates, total = [], [], [], None
        for mb in range(microbatches):
            (loss, (aux, new_state)), grads = grad_fn(params, state, part(mb), rngs, mb, loss_scale)
            losses.append(loss)
            auxes.append(aux)
            updates.append(new_state)
            total = grads if total is None else jax.tree.map(jax.numpy.add, total, grads)
        loss = losses[0] if microbatches == 1 else sum(losses[1:], losses[0]) / microbatches
        grads = total if microbatches == 1 else jax.tree.map(lambda g: g / microbatches, total)
        grads = jax.tree.map(_on_layout_of, grads, params)
        value = loss_fn.value(loss, mean_aux(auxes))
        if not call.stateful:
            return value, grads
        return (value, mean_updates(updates)), grads

    return value_and_grad


def _on_layout_of(grad, param):
    """``grad`` on ``param``'s layout. Run eagerly, the gradient of a parameter the loss never
    reads is JAX's zeros on one device (``pm.gather`` of it failed); traced, XLA lays it out."""
    sharding = getattr(param, "sharding", None)
    if isinstance(grad, jax.core.Tracer) or sharding is None or getattr(grad, "sharding", None) == sharding:
        return grad
    return jax.device_put(grad, sharding)

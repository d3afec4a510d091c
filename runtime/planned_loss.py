"""The loss planned with the model: ``loss_fn(model(...), batch)`` as one partitioned program.

``pm.value_and_grad(loss_fn)`` / ``pm.train_step`` on one mesh trace the
user's loss of the model's outputs together with the model
(:func:`~axonn_jax.partitioner.trace.trace_composite`) and plan the whole
function with the model's rules and parameter layout
(:func:`~axonn_jax.partitioner.program.composite_program`). A softmax
cross-entropy over vocabulary-split logits then reduces its max and sums
over the split (``pmax`` / ``psum``) and looks up the label's logit where it
lives, instead of gathering the logits and repeating the loss on every
device of the tensor-parallel group. ``pm.apply`` still returns whole outputs.

A loss that cannot be planned so (its tracing fails, or it closes over values
of an enclosing trace; the parameters keep the plan's layouts) runs as
before, outside the planned program on the model's gathered outputs;
:attr:`PlannedLoss.notes` says why, per input signature.

Example:
    >>> loss = PlannedLoss(engine, loss_fn)                          # doctest: +SKIP
    >>> (value, aux), updates = loss(variables, args, kwargs, batch)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

from axonn_jax.partitioner.program import Program, call_signature
from axonn_jax.partitioner.trace import call_leaves
from axonn_jax.runtime.loss_program import BATCH_KEYWORD, loss_program, not_planned_note, scaled_loss
from axonn_jax.runtime.precision import as_planned
from axonn_jax.runtime.sharded import program_function

if TYPE_CHECKING:
    from axonn_jax.runtime.engine.single_mesh import SingleMesh

class PlannedLoss:
    """``(variables, args, kwargs, batch, loss_scale=None) → ((loss, aux), state updates or None)``
    on one mesh, for a :class:`~axonn_jax.runtime.loss_program.ScalarLoss` (``aux`` ``None``
    without ``has_aux``).

    ``args``/``kwargs`` are one model call's inputs (flags, ``rngs``,
    ``mutable`` included, as ``ModelCall.of_inputs`` makes them). The composite
    Program is traced and planned once per input signature.
    """

    def __init__(self, engine: SingleMesh, loss_fn: Callable):
        self.engine, self.loss_fn = engine, loss_fn
        self._scaled = scaled_loss(loss_fn)  # an fp16 step's loss: the scale comes with the batch
        self._programs: dict = {}  # signature → (Program, its function), or None: not planned
        #: input signature → why the loss of that call runs outside the planned program
        self.notes: dict = {}

    def __call__(self, variables, args: tuple, kwargs: dict, batch, *, loss_scale=None):
        loss_fn = self.loss_fn if loss_scale is None else self._scaled
        if loss_scale is not None:  # an input of the program: a new scale compiles nothing
            batch = (batch, loss_scale)
        call_kwargs = {**kwargs, BATCH_KEYWORD: batch}
        planned = self._planned(args, call_kwargs, loss_fn)
        if planned is None:  # the loss outside, on the model's gathered outputs
            outputs, updates = self.engine.call.outputs(self.engine.apply(variables, args, kwargs))
            return loss_fn(outputs, batch), updates
        program, function = planned
        params, _ = self.engine.plan_tree(variables)
        self.engine.placed.check_params(params, dtypes=False)  # a wrong tree never runs
        params = as_planned(params, self.engine.plan)
        arrays, _ = call_leaves(args, call_kwargs)
        result = jax.tree.unflatten(program.out_tree, function(list(jax.tree.leaves(params)), list(arrays)))
        return result if self.engine.call.stateful else (result, None)

    def _planned(self, args: tuple, kwargs: dict, loss_fn: Callable) -> tuple[Program, Callable] | None:
        key = call_signature(args, kwargs)  # a scaled loss's batch is (batch, scale): another key
        if key not in self._programs:  # planned once per signature, a failure too
            engine = self.engine
            try:
                program = loss_program(engine.program, engine.plan, engine.options, engine.call, loss_fn, args,
                                       kwargs)  # fmt: skip
            except Exception as err:  # noqa: BLE001 - any failure keeps the exact old path
                self.notes[key] = not_planned_note(err)
                program = None
            self._programs[key] = None if program is None else (
                program, program_function(program, engine.mesh, overlap=engine.overlap))
        return self._programs[key]

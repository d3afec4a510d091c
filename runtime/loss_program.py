"""``loss_fn(model(...), batch)`` traced and planned as one Program: the loss planned with the model.

Shared by the one-mesh engine (:mod:`~axonn_jax.runtime.planned_loss`) and
the pipeline's last stage (:mod:`~axonn_jax.runtime.pipeline.setup`). The
batch travels as one more keyword of the call (:data:`BATCH_KEYWORD`), so it
is planned, placed and split like the model's inputs.

Example:
    >>> program = loss_program(model_program, plan, options, call, loss_fn, args,
    ...                        {**kwargs, BATCH_KEYWORD: batch})          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.program import PlanOptions, Program, composite_program
from axonn_jax.partitioner.trace import trace_composite
from axonn_jax.runtime.model_call import ModelCall

#: the keyword the batch takes in the traced composite call (beside the model's inputs)
BATCH_KEYWORD = "_loss_batch"


def loss_program(model: Program, plan: Plan, options: PlanOptions, call: ModelCall, loss_fn: Callable,
                 args: tuple, kwargs: dict) -> Program:  # fmt: skip
    """The Program of ``loss_fn(outputs of model(*args, **kwargs), kwargs[BATCH_KEYWORD])``
    (with the state updates of a model with state), laid out as ``plan``.

    Raises ``ValueError`` when it cannot be planned so: the loss closes over
    values of an enclosing trace, planning it would move a parameter, or (on
    a pipeline plan) the model's equations traced with the loss differ.
    """

    def composite(variables, *a, **k):
        batch = k.pop(BATCH_KEYWORD)
        outputs, updates = call.outputs(model.traced.apply(variables, *a, **k))
        loss = loss_fn(outputs, batch)
        return loss if updates is None else (loss, updates)

    traced = trace_composite(model.traced, composite, args, kwargs, returns_updates=call.stateful)
    if any(isinstance(c, jax.core.Tracer) for c in traced.jaxpr.consts):
        raise ValueError("it closes over values of the enclosing trace (pass them in the batch instead)")
    return composite_program(traced, plan, options=options, model=model)


@dataclasses.dataclass(frozen=True)
class ScalarLoss:
    """A user's ``loss_fn(outputs, batch)``, checked to return the loss alone: one scalar
    floating array. Anything else (a ``(loss, metrics)`` tuple, a per-example vector, an
    integer) is refused by name with the remedy, where JAX would only say that gradients
    need a scalar output. Equal (and hashed) as the function it wraps, so that steps made
    from one ``loss_fn`` share their compiled programs.

    Example:
        >>> import jax.numpy as jnp
        >>> ScalarLoss(lambda out, batch: (out ** 2).mean())(jnp.ones(3), None)
        Array(1., dtype=float32)
        >>> ScalarLoss(lambda out, batch: out)(jnp.ones(3), None)
        Traceback (most recent call last):
        TypeError: loss_fn returned an array of shape (3,); the loss must be one scalar. Remedy: reduce it, e.g. loss.mean().
    """

    fn: Callable

    @classmethod
    def of(cls, loss_fn: Callable) -> ScalarLoss:
        return loss_fn if isinstance(loss_fn, cls) else cls(loss_fn)

    def __call__(self, outputs, batch):
        return _checked(self.fn(outputs, batch))


def _checked(loss):
    if isinstance(loss, (tuple, list, dict)):
        raise TypeError(
            f"loss_fn returned a {type(loss).__name__} of {len(loss)} items; it must return the loss "
            "alone, one scalar (value_and_grad has no has_aux). Remedy: return the loss only, and "
            "compute metrics from pm.apply(params, inputs) outside the step."
        )
    shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"loss_fn returned a {type(loss).__name__}, not an array computed from the outputs; it "
            "must return the loss as one scalar float array. Remedy: compute it with jax.numpy."
        )
    if shape != ():
        raise TypeError(f"loss_fn returned an array of shape {tuple(shape)}; the loss must be one scalar. "
                        "Remedy: reduce it, e.g. loss.mean().")  # fmt: skip
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"loss_fn returned a {dtype} scalar; the loss must be floating (an integer has no "
            "gradient). Remedy: compute it in floating point, e.g. loss.astype(jnp.float32)."
        )
    return loss


def without_batch(kwargs: dict) -> dict:
    """The model's own keywords of a composite call."""
    return {k: v for k, v in kwargs.items() if k != BATCH_KEYWORD}


def not_planned_note(err: Exception) -> str:
    """What ``step.loss_notes`` says of a loss that :func:`loss_program` could not plan."""
    return f"loss not planned with the model ({type(err).__name__}: {err})"


def scaled(loss: jax.Array, loss_scale: jax.Array | None) -> jax.Array:
    """``loss * loss_scale`` in the loss's dtype (as ``LossScale.scale_loss``), or ``loss``."""
    return loss if loss_scale is None else loss * loss_scale.astype(loss.dtype)


def scaled_loss(loss_fn: Callable) -> Callable:
    """``(outputs, (batch, scale)) → loss_fn(outputs, batch) · scale``: the scale one more input."""

    def loss(outputs, batch_and_scale):
        batch, loss_scale = batch_and_scale
        return scaled(loss_fn(outputs, batch), loss_scale)

    return loss

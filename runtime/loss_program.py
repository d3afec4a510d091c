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
from typing import Any

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
    values of an enclosing trace, or (on a pipeline plan) the model's equations
    traced with the loss differ. The parameters keep the plan's layouts.
    """

    def composite(variables, *a, **k):
        batch = k.pop(BATCH_KEYWORD)
        outputs, updates = call.outputs(model.traced.apply(variables, *a, **k))
        value = loss_fn(outputs, batch)  # (loss, aux) of a ScalarLoss
        return value if updates is None else (value, updates)

    traced = trace_composite(model.traced, composite, args, kwargs, returns_updates=call.stateful)
    if any(isinstance(c, jax.core.Tracer) for c in traced.jaxpr.consts):
        raise ValueError("it closes over values of the enclosing trace (pass them in the batch instead)")
    return composite_program(traced, plan, options=options, model=model)


@dataclasses.dataclass(frozen=True)
class ScalarLoss:
    """A user's ``loss_fn(outputs, batch)``, checked to return the loss alone: one scalar
    floating array; with ``has_aux``, a pair ``(loss, aux)`` whose aux is any pytree of
    arrays (metrics). Anything else (a ``(loss, metrics)`` tuple without ``has_aux``, a
    per-example vector, an integer) is refused by name with the remedy, where JAX would
    only say that gradients need a scalar output. Called, it returns ``(loss, aux)``
    (``aux`` ``None`` without ``has_aux``). Equal (and hashed) as the function it wraps
    and ``has_aux``, so that steps made from one ``loss_fn`` share their compiled programs.

    Example:
        >>> import jax.numpy as jnp
        >>> ScalarLoss(lambda out, batch: (out ** 2).mean())(jnp.ones(3), None)
        (Array(1., dtype=float32), None)
        >>> ScalarLoss(lambda out, batch: (out.sum(), {"max": out.max()}), has_aux=True)(jnp.ones(3), None)
        (Array(3., dtype=float32), {'max': Array(1., dtype=float32)})
        >>> ScalarLoss(lambda out, batch: out)(jnp.ones(3), None)
        Traceback (most recent call last):
        TypeError: loss_fn returned an array of shape (3,); the loss must be one scalar. Remedy: reduce it, e.g. loss.mean().
    """

    fn: Callable
    has_aux: bool = False

    @classmethod
    def of(cls, loss_fn: Callable, has_aux: bool = False) -> ScalarLoss:
        if isinstance(loss_fn, cls):
            return loss_fn if loss_fn.has_aux == has_aux else cls(loss_fn.fn, has_aux)
        return cls(loss_fn, has_aux)

    def __call__(self, outputs, batch) -> tuple[jax.Array, Any]:
        value = self.fn(outputs, batch)
        if not self.has_aux:
            return _checked(value), None
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise TypeError(
                f"loss_fn returned {_described(value)}; with has_aux=True it must return a pair "
                "(loss, aux): the scalar loss and a pytree of arrays (e.g. {'accuracy': acc}). "
                "Remedy: return (loss, aux), or has_aux=False for a loss alone."
            )
        return _checked(value[0]), value[1]

    def value(self, loss, aux):
        """What a step returns for the loss: ``(loss, aux)`` with ``has_aux``, else ``loss``."""
        return (loss, aux) if self.has_aux else loss

    def parts(self, value) -> tuple[Any, Any]:
        """``(loss, aux)`` of what :meth:`value` made (``aux`` ``None`` without ``has_aux``)."""
        return value if self.has_aux else (value, None)


def _described(value) -> str:
    """``a tuple of 3 items``, ``a float32 array of shape ()``, ``a float``."""
    if isinstance(value, (tuple, list, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # an array, or a tracer of one
        return f"a {value.dtype} array of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _checked(loss):
    if isinstance(loss, (tuple, list, dict)):
        raise TypeError(
            f"loss_fn returned {_described(loss)}; it must return the loss "
            "alone, one scalar. Remedy: return the loss only, or, for (loss, metrics), pass "
            "has_aux=True to value_and_grad / train_step."
        )
    shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"loss_fn returned {_described(loss)}, not an array computed from the outputs; it "
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


def mean_aux(auxes: list) -> Any:
    """The aux of several microbatches, as the step returns it: every leaf averaged over them,
    as the loss is (a per-batch statistic such as an accuracy then equals the whole batch's,
    for equal microbatches). A leaf that is not floating (a count, a flag) cannot be averaged
    and is refused, naming its path.

    Example:
        >>> mean_aux([{"acc": 0.5}, {"acc": 1.0}])
        {'acc': 0.75}
    """
    if len(auxes) == 1:
        return auxes[0]

    def mean(path, *xs):
        if not jnp.issubdtype(jnp.result_type(xs[0]), jnp.inexact):
            raise TypeError(
                f"loss_fn's aux{jax.tree_util.keystr(path)} has dtype {jnp.result_type(xs[0])}; with "
                f"{len(xs)} microbatches the aux is averaged over them, as the loss is, and this "
                "one cannot be. Remedy: return it as a float (e.g. a mean, or count.astype(jnp.float32)), "
                "or microbatches=1."
            )
        return sum(xs[1:], xs[0]) / len(xs)

    return jax.tree_util.tree_map_with_path(mean, *auxes)


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
    """``(outputs, (batch, scale)) → (loss · scale, aux)`` of a :class:`ScalarLoss`: the scale one
    more input; the aux is not scaled."""

    def loss(outputs, batch_and_scale):
        batch, loss_scale = batch_and_scale
        value, aux = loss_fn(outputs, batch)
        return scaled(value, loss_scale), aux

    return loss

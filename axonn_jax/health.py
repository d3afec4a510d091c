"""Numerical health: find the first layer (and pipeline stage) that makes a NaN or Inf.

A debugging tool, slower than a training step: the planned model is run on
its own grid (same layouts, same collectives) with a check after every
equation of the forward pass and, given a loss, of the backward pass.

* :func:`first_nonfinite` returns a :class:`NonFinite` naming the first
  offender — a model input, a parameter, an equation of the forward pass, the
  loss, the backward of an equation, or a parameter gradient — with its
  primitive, its layer (the linen module path, or for nnx the parameters
  nearest to it in the data flow) and its pipeline stage; ``None`` when
  everything is finite.
* :func:`check_finite` raises ``FloatingPointError`` with that description.
* :func:`check_replicas` (from :mod:`axonn_jax.runtime.replicas`) raises when the
  copies of a parameter shard held by data-parallel replicas (any rank, any
  device) stopped being bitwise equal, naming the parameter, shard and ranks.
* :func:`diagnose_step` takes the arguments of ``pm.value_and_grad``'s step
  (``loss_fn(outputs, batch)``, ``inputs(batch)``): call it when a training
  step returned a non-finite loss or gradient.

Example:
    >>> found = first_nonfinite(pm, params, tokens,                            # doctest: +SKIP
    ...                         loss_fn=lambda logits: next_token_loss(logits, tokens))
    >>> print(found)                                                          # doctest: +SKIP
    NaN in the forward pass: equation 41 'log' in layer 'block_1/mlp' ..., pipeline stage 1 of 2
"""

from __future__ import annotations

from collections.abc import Callable

from axonn_jax.runtime import nonfinite
from axonn_jax.runtime.loss_program import ScalarLoss
from axonn_jax.runtime.microbatches import default_inputs
from axonn_jax.runtime.model_call import model_inputs
from axonn_jax.runtime.nonfinite import WHERES, NonFinite
from axonn_jax.runtime.replicas import check_replicas

__all__ = ["WHERES", "NonFinite", "check_finite", "check_replicas", "diagnose_step", "first_nonfinite"]


def first_nonfinite(
    pm,
    params,
    *args,
    loss_fn: Callable | None = None,
    intermediates: bool = False,
    **kwargs,
) -> NonFinite | None:
    """The first NaN/Inf that ``pm``'s model produces on ``args`` (``None`` if none).

    Args:
        pm: a :class:`~axonn_jax.Partitioned`.
        params: its parameters (from ``pm.init`` / ``pm.shard``).
        *args, **kwargs: the model's call arguments.
        loss_fn: ``outputs → scalar``; when given the backward pass is checked too.
        intermediates: also report a non-finite intermediate value that is
            masked later (e.g. the unused branch of ``jnp.where``). By default
            the forward pass is examined only when the outputs or the loss are
            non-finite, and the backward pass only when a parameter gradient is.

    Runs every stage of the plan in order on its own mesh; needs every
    process of the job (like a training step). With a pipeline spread over
    several processes it is not available (run it in one process with
    simulated devices instead).
    """
    return nonfinite.first_nonfinite(pm.engine, params, args, kwargs, loss_fn=loss_fn,
                                     intermediates=intermediates)  # fmt: skip


def check_finite(pm, params, *args, loss_fn: Callable | None = None, **kwargs) -> None:
    """Raise ``FloatingPointError`` naming the first NaN/Inf (see :func:`first_nonfinite`)."""
    found = first_nonfinite(pm, params, *args, loss_fn=loss_fn, **kwargs)
    if found is not None:
        raise FloatingPointError(str(found))


def diagnose_step(pm, loss_fn: Callable, params, batch, *, inputs: Callable | None = None,
                  has_aux: bool = False) -> NonFinite | None:  # fmt: skip
    """:func:`first_nonfinite` for the arguments of ``pm.value_and_grad(loss_fn, inputs=...,
    has_aux=...)`` (with ``has_aux``, the loss is the first of ``loss_fn``'s pair).

    Example (inside a training loop)::

        loss, grads = step(params, batch)
        if not np.isfinite(loss):
            raise FloatingPointError(str(diagnose_step(pm, loss_fn, params, batch)))
    """
    given = inputs(batch) if inputs else default_inputs(batch, keywords=pm.engine.call.keywords)
    args, kwargs = model_inputs(given)
    loss = ScalarLoss.of(loss_fn, has_aux)  # the step's loss: the first of a has_aux pair
    return first_nonfinite(pm, params, *args, loss_fn=lambda out: loss(out, batch)[0], **kwargs)

"""Activation checkpointing (rematerialisation) policies by name.

A policy decides which intermediate values of a function's forward pass are
kept for the backward pass; the rest is recomputed:

=============  =================================================================
``none``       no checkpointing: everything autodiff needs is kept (fastest)
``full``       keep nothing but the inputs; recompute the whole forward
``save_dots``  keep matmul outputs without batch dimensions (the layer
               projections), recompute the cheap element-wise work
``offload``    like ``save_dots``, but the kept matmul outputs go to host
               memory (``pinned_host``) and come back for the backward pass
=============  =================================================================

Apply one to a layer, a pipeline stage's forward function, or a whole loss::

    loss_fn = apply_remat(lambda p, b: loss(pm.apply(p, b), b), "save_dots")
    grads = jax.grad(loss_fn)(params, batch)

Gradients are the same under every policy (the same operations are executed,
only when differs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

#: Policy names accepted by :func:`apply_remat` (and ``--remat``).
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "save_dots", "offload")


def remat_policy(name: str) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy for ``name`` (``None`` for "none" and "full").

    Example:
        >>> remat_policy("save_dots") is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        True
    """
    policies = jax.checkpoint_policies
    if name not in REMAT_POLICIES:
        raise ValueError(
            f"unknown remat policy {name!r}; choose one of {', '.join(REMAT_POLICIES)} "
            "(e.g. --remat save_dots)."
        )
    if name == "save_dots":
        return policies.dots_with_no_batch_dims_saveable
    if name == "offload":
        return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return None


def apply_remat(fn: Callable, policy: str = "none", *, static_argnums: tuple[int, ...] = ()) -> Callable:
    """``fn`` with activation checkpointing ``policy`` (one of :data:`REMAT_POLICIES`).

    "none" returns ``fn`` itself; the others wrap it in ``jax.checkpoint``.

    Example:
        >>> import jax.numpy as jnp
        >>> f = apply_remat(lambda w, x: jnp.tanh(x @ w).sum(), "full")
        >>> float(jax.grad(f)(jnp.eye(2), jnp.ones((3, 2)))[0, 0]) > 0
        True
    """
    chosen = remat_policy(policy)
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=chosen, static_argnums=static_argnums)


@functools.lru_cache(maxsize=None)
def remat_wrapper(policy: str) -> Callable[[Callable], Callable]:
    """``f → apply_remat(f, policy)`` (one object per policy, so compiled programs are shared)."""
    remat_policy(policy)  # validates the name

    def wrap(fn: Callable) -> Callable:
        return apply_remat(fn, policy)

    return wrap


def resolve_remat(remat: str | Callable | None) -> Callable | None:
    """A policy name ("none", "full", "save_dots", "offload"), a wrapper, or None."""
    if remat is None or callable(remat):
        return remat
    return remat_wrapper(str(remat))

"""Mixed precision: a precision policy and dynamic loss scaling.

A :class:`Precision` says which dtype the parameters (and so their gradients)
have on the accelerator; master weights are always float32 (they live with the
optimizer, see :mod:`axonn_jax.runtime.master_optimizer`). A :class:`LossScale` is the dynamic
loss scale that fp16 needs: multiply the loss before differentiating, divide
the gradients after, skip the step and halve the scale when any gradient
overflowed, double it after ``growth_interval`` good steps in a row.

The skip decision must be the same everywhere. Inside one ``jax.jit`` over
global arrays :func:`all_finite` already is global (XLA reduces over every
shard). Runtimes that run separate programs — pipeline stages, processes with
process-local arrays — combine the local flags first: :func:`combine_finite`
for the stages of one process, :func:`mpi_all_finite` across MPI ranks.

Example::

    policy = Precision.of("fp16")
    scale = policy.loss_scale()                        # LossScale, 2**15, dynamic

    @jax.jit
    def step(params, state, scale, batch):             # params: fp16 on device
        loss_fn = lambda p: loss(pm.apply(as_planned(p, pm.plan), batch))
        loss, grads = jax.value_and_grad(lambda p: scale.scale_loss(loss_fn(p)))(params)
        finite = all_finite(grads)
        params, state = opt.update(grads, state, params, finite=finite, grad_scale=scale.scale)
        return params, state, scale.update(finite), loss / scale.scale
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axonn_jax.runtime.collectives import HostComm, world

#: Precision names accepted by :meth:`Precision.of` (and ``--precision``).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes of parameters and gradients on the device; masters are float32.

    Example:
        >>> Precision.of("bf16").param_dtype
        dtype(bfloat16)
        >>> Precision.of("fp16").loss_scaling, Precision.of("bf16").loss_scaling
        (True, False)
    """

    name: str = "fp32"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(
                f"unknown precision {self.name!r}; choose one of {', '.join(PRECISIONS)} "
                "(e.g. Precision.of('bf16') or --precision bf16)."
            )

    @classmethod
    def of(cls, value: str | Precision | None) -> Precision:
        """A policy from its name (``None`` means fp32); policies pass through."""
        if isinstance(value, Precision):
            return value
        return cls("fp32" if value is None else str(value))

    @property
    def param_dtype(self) -> np.dtype:
        """Dtype of the parameters kept on the device."""
        return np.dtype(_DTYPES[self.name])

    @property
    def grad_dtype(self) -> np.dtype:
        """Dtype of the gradients on the device (that of the parameters)."""
        return self.param_dtype

    @property
    def master_dtype(self) -> np.dtype:
        """Dtype of the master weights and of the optimizer arithmetic."""
        return np.dtype(jnp.float32)

    @property
    def half(self) -> bool:
        """True when device parameters are narrower than the master weights."""
        return self.param_dtype != self.master_dtype

    @property
    def loss_scaling(self) -> bool:
        """fp16 needs dynamic loss scaling (its range is too small for gradients)."""
        return self.name == "fp16"

    def to_device(self, tree):
        """Cast the floating leaves of ``tree`` to :attr:`param_dtype`."""
        return cast_floating(tree, self.param_dtype)

    def loss_scale(self, initial: float = 2.0**15, **options) -> LossScale:
        """A dynamic :class:`LossScale` for fp16, the constant 1 otherwise."""
        if self.loss_scaling:
            return LossScale.create(initial, **options)
        return LossScale.constant(1.0)


def cast_floating(tree, dtype):
    """Cast every floating-point leaf of ``tree`` to ``dtype``; others unchanged."""
    dtype = np.dtype(dtype)

    def cast(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.result_type(x) != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def as_planned(params, plan):
    """``params`` cast to the dtypes the plan was traced with (for ``pm.apply``).

    Half-precision device parameters enter the model at its own parameter dtype
    (float32 for Flax defaults), so the planned program runs unchanged and the
    gradient with respect to the half-precision leaves comes back in half
    precision. The casts are free when the dtypes already match.
    """
    leaves, tree = jax.tree.flatten(params)
    if len(leaves) != len(plan.params):
        raise ValueError(
            f"params have {len(leaves)} leaves, the plan has {len(plan.params)} parameters. "
            "Remedy: pass the pytree returned by MasterOptimizer.init / pm.init."
        )
    cast = [x if x.dtype == np.dtype(p.dtype) else x.astype(p.dtype) for x, p in zip(leaves, plan.params)]
    return jax.tree.unflatten(tree, cast)


# --- finiteness -----------------------------------------------------------------


def all_finite(tree) -> jax.Array:
    """A boolean scalar: every element of every floating leaf of ``tree`` is finite.

    Inside one jit over global (sharded) arrays the result is global.
    """
    flags = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def combine_finite(flags: Iterable) -> jax.Array:
    """AND of several finiteness flags (e.g. one per pipeline stage of a process)."""
    flags = [jnp.asarray(f, bool) for f in flags]
    if not flags:
        raise ValueError("combine_finite needs at least one flag")
    return functools.reduce(jnp.logical_and, flags)


def mpi_all_finite(flag, comm: Any = None) -> bool:
    """AND of ``flag`` over the processes of ``comm`` (default: all processes).

    A blocking host-side reduction (one byte), for runtimes whose ranks hold
    process-local gradients (pipeline stages on different processes). Every rank
    must call it, once per step. Returns a Python bool, usable as ``finite=``.
    ``comm``: a :class:`~axonn_jax.runtime.collectives.HostComm`, an mpi4py
    communicator, or ``None``; in a single process the flag itself.

    Example (under ``mpiexec -n 2``; rank 1 saw an overflow)::

        finite = mpi_all_finite(all_finite(local_grads))   # False on both ranks
        scale = scale.update(finite)                       # halved on both ranks
    """
    local = bool(np.asarray(flag))
    if comm is None:
        comm = world()
        if comm is None:
            return local
    if not isinstance(comm, HostComm):
        comm = HostComm(comm)
    return comm.all_true(local)


# --- dynamic loss scaling -------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["scale", "good_steps"],
    meta_fields=["growth_interval", "growth_factor", "backoff_factor", "min_scale", "max_scale", "dynamic"],
)
@dataclasses.dataclass(frozen=True)
class LossScale:
    """Dynamic loss scale (a pytree: pass it through ``jax.jit``).

    ``scale`` (float32) multiplies the loss; ``good_steps`` (int32) counts
    consecutive finite steps. :meth:`update` with ``finite=False`` multiplies the
    scale by ``backoff_factor`` (never below ``min_scale``) and resets the count;
    after ``growth_interval`` finite steps in a row the scale is multiplied by
    ``growth_factor`` (never above ``max_scale``) and the count restarts.

    Example:
        >>> s = LossScale.create(8.0, growth_interval=2)
        >>> float(s.update(False).scale), float(s.update(True).update(True).scale)
        (4.0, 16.0)
    """

    scale: jax.Array
    good_steps: jax.Array
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    dynamic: bool = True

    @classmethod
    def create(
        cls,
        initial: float = 2.0**15,
        *,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> LossScale:
        """A dynamic loss scale starting at ``initial``."""
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        if not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, "
                f"{backoff_factor} (e.g. 2.0 and 0.5)"
            )
        if not 0.0 < min_scale <= initial <= max_scale:
            raise ValueError(
                f"need 0 < min_scale <= initial <= max_scale, got {min_scale}, {initial}, {max_scale}"
            )
        return cls(jnp.asarray(initial, jnp.float32), jnp.asarray(0, jnp.int32),
                   growth_interval, float(growth_factor), float(backoff_factor),
                   float(min_scale), float(max_scale), True)  # fmt: skip

    @classmethod
    def constant(cls, value: float = 1.0) -> LossScale:
        """A scale that :meth:`update` never changes (bf16, fp32)."""
        return cls(jnp.asarray(value, jnp.float32), jnp.asarray(0, jnp.int32), dynamic=False)

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        """``loss * scale`` (differentiate this one)."""
        return loss * self.scale.astype(loss.dtype)

    def unscale(self, grads, dtype=jnp.float32):
        """Gradients divided by the scale, computed (and returned) in ``dtype``."""
        inverse = (1.0 / self.scale).astype(dtype)
        return jax.tree.map(lambda g: g.astype(dtype) * inverse, grads)

    def update(self, finite) -> LossScale:
        """The scale for the next step, given whether this step's gradients were finite.

        ``finite`` must be the global decision (see the module docstring).
        """
        if not self.dynamic:
            return self
        finite = jnp.asarray(finite, bool)
        grows = self.good_steps + 1 >= self.growth_interval
        up = jnp.where(grows, jnp.minimum(self.scale * self.growth_factor, self.max_scale), self.scale)
        down = jnp.maximum(self.scale * self.backoff_factor, self.min_scale)
        scale = jnp.where(finite, up, down).astype(jnp.float32)
        good = jnp.where(finite & ~grows, self.good_steps + 1, 0).astype(jnp.int32)
        return dataclasses.replace(self, scale=scale, good_steps=good)

"""A complete training step: gradients (pipelined or not) and the optimizer update.

The optimizer is any optax ``GradientTransformation`` wrapped in a
:class:`~axonn_jax.offload.MasterOptimizer`: the device holds the parameters
in the chosen precision; float32 master weights and the optimizer state sit
next to them or, with ``offload=True``, in host memory, with layouts derived
from the parameters' layouts. fp16 adds dynamic loss scaling: a step whose
gradients overflowed anywhere (any shard, stage or process) is skipped
everywhere and the scale halves. Every program has fixed output shardings, so
a step compiles once.

Example:
    >>> step = pm.train_step(loss_fn, optax.adamw(1e-3), microbatches=4,   # doctest: +SKIP
    ...                      precision="bf16", offload=True)
    >>> params, opt_state = step.init(params)                             # doctest: +SKIP
    >>> params, opt_state, loss = step(params, opt_state, batch)          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.offload import MasterOptimizer
from axonn_jax.precision import LossScale, Precision, all_finite, as_planned


class OptState(NamedTuple):
    """What :class:`TrainStep` carries between steps besides the device parameters."""

    optimizer: Any  # MasterState (or {stage: MasterState} with a pipeline)
    loss_scale: LossScale | None  # fp16 only


def _none(x) -> bool:
    return x is None


def state_shardings(optimizer: optax.GradientTransformation, params, param_shardings, mesh):
    """Shardings of ``optimizer``'s state: parameter-like leaves follow their parameter.

    Scalars such as the step count are replicated on ``mesh``. ``params`` may be
    arrays or ShapeDtypeStructs; leaves that are ``None`` (other stages) stay ``None``.
    """
    abstract = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, abstract, param_shardings,
        transform_non_params=lambda _: replicated, is_leaf=_none,
    )  # fmt: skip


class TrainStep:
    """``(params, opt_state, batch) → (params, opt_state, loss)``.

    Without a pipeline the whole step is one jitted program. With a pipeline,
    the gradients come from the dispatch queue and the update runs as one
    program per stage on this process (each stage's parameters live on that
    stage's mesh); the finiteness flag of fp16 is combined over stages and
    processes before any stage updates.

    Args:
        pm: the :class:`~axonn_jax.Partitioned` model.
        loss_fn: ``loss_fn(outputs, batch) → scalar``.
        optimizer: any optax ``GradientTransformation``.
        precision: "fp32" (default), "bf16" or "fp16" parameters and gradients on device.
        offload: master weights and optimizer state in host memory.
        update_on, bucket_bytes: see :class:`~axonn_jax.offload.MasterOptimizer`.
        **options: those of :meth:`~axonn_jax.Partitioned.value_and_grad`.
    """

    def __init__(self, pm, loss_fn: Callable, optimizer: optax.GradientTransformation, *,
                 precision: str | Precision = "fp32", offload: bool = False,
                 update_on: str = "host", bucket_bytes: int = 64 * 2**20, **options):  # fmt: skip
        self.pm, self.loss_fn, self.optimizer = pm, loss_fn, optimizer
        self.precision = Precision.of(precision)
        self.master = dict(precision=self.precision, offload=offload, update_on=update_on,
                           bucket_bytes=bucket_bytes)  # fmt: skip
        self.options = options
        if pm.grid.pipeline > 1 and self.precision.loss_scaling:
            raise ValueError(
                f"precision fp16 needs dynamic loss scaling, which pipelined steps "
                f"({pm.grid}) do not support yet. Remedy: precision='bf16' (no loss scale "
                "needed), or a grid with pipeline=1."
            )
        self.value_and_grad = pm.value_and_grad(loss_fn, **options)
        self._programs: dict = {}  # stage (or None) → (MasterOptimizer, jitted step/update)

    # --- pieces -----------------------------------------------------------------
    def _groups(self) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, home in enumerate(self.pm.stage_layout.home):
            if home is not None:
                groups.setdefault(home, []).append(i)
        return groups

    def _subtree(self, leaves: list, keep: list[int]):
        picked = [leaf if i in keep else None for i, leaf in enumerate(leaves)]
        return jax.tree.unflatten(self.pm.plan.param_tree, picked)

    def _optimizer(self, stage) -> MasterOptimizer:
        if stage is None:
            shardings = self.pm.param_shardings
        else:
            shardings = self._subtree(jax.tree.leaves(self.pm.param_shardings, is_leaf=_none),
                                      self._groups()[stage])  # fmt: skip
        return MasterOptimizer(self.optimizer, shardings, **self.master)

    def _compiled(self, stage):
        if stage in self._programs:
            return self._programs[stage]
        master = self._optimizer(stage)
        abstract = [jax.ShapeDtypeStruct(p.shape, np.dtype(p.dtype)) for p in self.pm.plan.params]
        if stage is not None:
            abstract = jax.tree.leaves(self._subtree(abstract, self._groups()[stage]), is_leaf=_none)
        abstract = jax.tree.unflatten(self.pm.plan.param_tree, abstract)
        # fixed output layouts: the outputs of step k are exactly the inputs of step k+1
        out = (master.param_shardings, master.state_shardings(abstract))
        if stage is None:
            replicated = NamedSharding(self.pm.mesh, P())
            scale = replicated if self.precision.loss_scaling else None
            run = jax.jit(self._whole_step(master), donate_argnums=(0, 1),
                          out_shardings=(out[0], OptState(out[1], scale), replicated))  # fmt: skip
        else:

            def update(params, grads, state, finite):
                return master.update(grads, state, params, finite=finite)

            run = jax.jit(update, donate_argnums=(0, 2), out_shardings=out)
        self._programs[stage] = (master, run)
        return self._programs[stage]

    def _whole_step(self, master: MasterOptimizer):
        pm, loss_fn, options = self.pm, self.loss_fn, self.options

        def step(params, opt_state: OptState, batch):
            scale = opt_state.loss_scale

            def scaled_loss(outputs, b):
                loss = loss_fn(outputs, b)
                return scale.scale_loss(loss) if scale is not None else loss

            value_and_grad = pm.value_and_grad(scaled_loss, **options)
            loss, grads = value_and_grad(as_planned(params, pm.plan), batch)
            finite = all_finite(grads) if scale is not None else None
            params, state = master.update(grads, opt_state.optimizer, params, finite=finite,
                                          grad_scale=None if scale is None else scale.scale)  # fmt: skip
            if scale is not None:
                loss, scale = loss / scale.scale, scale.update(finite)
            return params, OptState(state, scale), loss

        return step

    # --- the public calls -----------------------------------------------------------
    def init(self, params) -> tuple[Any, OptState]:
        """``(device params, opt_state)`` from full-precision ``params`` (``pm.init``)."""
        scale = self.precision.loss_scale() if self.precision.loss_scaling else None
        if self.pm.grid.pipeline == 1:
            device, state = self._compiled(None)[0].init(params)
            if scale is not None:
                scale = jax.device_put(scale, NamedSharding(self.pm.mesh, P()))
            return device, OptState(state, scale)
        leaves = self.pm._param_leaves(params)
        out, states = list(leaves), {}
        for s, idx in self._groups().items():
            device, states[s] = self._compiled(s)[0].init(self._subtree(leaves, idx))
            new = jax.tree.leaves(device, is_leaf=_none)
            for i in idx:
                out[i] = new[i]
        return jax.tree.unflatten(self.pm.plan.param_tree, out), OptState(states, scale)

    def __call__(self, params, opt_state: OptState, batch):
        if self.pm.grid.pipeline == 1:
            return self._compiled(None)[1](params, opt_state, batch)
        loss, grads = self.value_and_grad(params, batch)
        p_leaves = self.pm._param_leaves(params)
        g_leaves = self.pm._param_leaves(grads)
        finite = None
        if self.precision.half:  # skip the step everywhere if any stage, on any process, overflowed
            finite = _all_finite_everywhere(self.pm, [g for g in g_leaves if g is not None])
        out, states = list(p_leaves), {}
        for s, idx in self._groups().items():
            new_params, states[s] = self._compiled(s)[1](
                self._subtree(p_leaves, idx), self._subtree(g_leaves, idx),
                opt_state.optimizer[s], finite,
            )  # fmt: skip
            new = jax.tree.leaves(new_params, is_leaf=_none)
            for i in idx:
                out[i] = new[i]
        return jax.tree.unflatten(self.pm.plan.param_tree, out), OptState(states, None), loss


def _all_finite_everywhere(pm, grads: list) -> bool:
    local = all(bool(np.asarray(all_finite(g))) for g in grads)
    if not pm.multiprocess:
        return local
    from axonn_jax.precision import mpi_all_finite

    return mpi_all_finite(local, pm.transport.comm)

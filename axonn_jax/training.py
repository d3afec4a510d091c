"""A complete training step: gradients (pipelined or not) and an optax update.

The optimizer state's layout is derived from the parameters' layout (each
parameter-shaped state leaf is sharded like its parameter, scalars such as the
step count are replicated on the same mesh), and every program has fixed output
shardings, so a step compiles once and never again.

Example:
    >>> step = pm.train_step(loss_fn, optax.adamw(1e-3), microbatches=4)  # doctest: +SKIP
    >>> opt_state = step.init(params)                                     # doctest: +SKIP
    >>> params, opt_state, loss = step(params, opt_state, batch)          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _update(optimizer):
    def update(params, grads, opt_state):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def state_shardings(optimizer: optax.GradientTransformation, params, param_shardings, mesh):
    """Shardings of ``optimizer``'s state: parameter-like leaves follow their parameter."""
    abstract = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, abstract, param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: x is None,
    )  # fmt: skip


class TrainStep:
    """``(params, opt_state, batch) → (params, opt_state, loss)``.

    Without a pipeline the whole step is one jitted program. With a pipeline,
    the gradients come from the dispatch queue and the optimizer runs as one
    jitted program per stage on this process (each stage's parameters live on
    that stage's mesh); ``opt_state`` is then ``{stage: optax state}``.
    """

    def __init__(self, pm, value_and_grad: Callable, optimizer: optax.GradientTransformation):
        self.pm, self.value_and_grad, self.optimizer = pm, value_and_grad, optimizer
        self._programs: dict = {}  # stage (or None) → (init, update or step)

    def _compiled(self, stage, params):
        """The jitted init and step/update of one stage, with fixed output shardings."""
        if stage in self._programs:
            return self._programs[stage]
        pm, update = self.pm, _update(self.optimizer)
        if stage is None:
            shardings, mesh = pm.param_shardings, pm.mesh
        else:
            shardings, mesh = self._subtree(jax.tree.leaves(pm.param_shardings, is_leaf=_none),
                                            self._groups()[stage]), pm.stage_meshes[stage]  # fmt: skip
        states = state_shardings(self.optimizer, params, shardings, mesh)
        init = jax.jit(self.optimizer.init, out_shardings=states)
        if stage is None:
            value_and_grad = self.value_and_grad

            def step(params, opt_state, batch):
                loss, grads = value_and_grad(params, batch)
                params, opt_state = update(params, grads, opt_state)
                return params, opt_state, loss

            run = jax.jit(step, donate_argnums=(0, 1),
                          out_shardings=(shardings, states, NamedSharding(mesh, P())))  # fmt: skip
        else:
            run = jax.jit(update, donate_argnums=(0, 2), out_shardings=(shardings, states))
        self._programs[stage] = (init, run)
        return self._programs[stage]

    # --- pipelined helpers ------------------------------------------------------
    def _groups(self) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, home in enumerate(self.pm.stage_layout.home):
            if home is not None:
                groups.setdefault(home, []).append(i)
        return groups

    def _subtree(self, leaves: list, keep: list[int]):
        picked = [leaf if i in keep else None for i, leaf in enumerate(leaves)]
        return jax.tree.unflatten(self.pm.plan.param_tree, picked)

    def init(self, params):
        """The optimizer state for ``params`` (``{stage: state}`` with a pipeline)."""
        if self.pm.grid.pipeline == 1:
            return self._compiled(None, params)[0](params)
        leaves = self.pm._param_leaves(params)
        states = {}
        for s, idx in self._groups().items():
            sub = self._subtree(leaves, idx)
            states[s] = self._compiled(s, sub)[0](sub)
        return states

    def __call__(self, params, opt_state, batch):
        if self.pm.grid.pipeline == 1:
            return self._compiled(None, params)[1](params, opt_state, batch)
        loss, grads = self.value_and_grad(params, batch)
        p_leaves = self.pm._param_leaves(params)
        g_leaves = self.pm._param_leaves(grads)
        out = list(p_leaves)
        new_state = {}
        for s, idx in self._groups().items():
            sub = self._subtree(p_leaves, idx)
            new_params, new_state[s] = self._compiled(s, sub)[1](
                sub, self._subtree(g_leaves, idx), opt_state[s]
            )
            new_leaves = jax.tree.leaves(new_params, is_leaf=_none)
            for i in idx:
                out[i] = new_leaves[i]
        return jax.tree.unflatten(self.pm.plan.param_tree, out), new_state, loss


def _none(x) -> bool:
    return x is None

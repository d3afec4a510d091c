"""The ``pm.apply``-based jitted AdamW train step of ``benchmarks/grid_prediction.py``, compiled
ahead of time for a grid (nothing runs): what the model-vs-program tests read."""

from __future__ import annotations

import jax
import optax

from axonn_jax.compiled_check import squares_loss
from axonn_jax.partitioned import partition
from axonn_jax.partitioner.grid import Grid


def compile_apply_step(model, inputs, grid: Grid, loss=None, kwargs=None):
    """The compiled step of ``model`` on ``grid``. ``inputs``: one input or a tuple of them
    (arrays or ShapeDtypeStructs); ``loss(outputs, *inputs)``, by default the squares loss."""
    args, kwargs = (inputs if isinstance(inputs, tuple) else (inputs,)), kwargs or {}
    loss = loss or squares_loss
    pm = partition(model, grid, *args, **kwargs)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          jax.eval_shape(pm.init, jax.random.key(0)), pm.param_shardings)  # fmt: skip
    opt = optax.adamw(1e-3)

    def step(p, s, *xs):
        value, grads = jax.value_and_grad(lambda q: loss(pm.apply(q, *xs, **kwargs), *xs))(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    return jax.jit(step).lower(params, jax.eval_shape(opt.init, params), *args).compile()

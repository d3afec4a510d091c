"""Eager ``pm.apply`` (and eager ``jax.grad`` of it) equals the jitted call on every grid."""

import jax
import numpy as np
import pytest
from conftest import grid_id
from partition_cases import GRIDS, build, reference_apply

import axonn_jax


@pytest.mark.parametrize("grid", GRIDS, ids=grid_id)
@pytest.mark.parametrize("name", ["gpt_linen", "mlp_nnx"])
def test_eager_apply_and_grad_equal_jitted(name, grid, devices):
    case = build(name)
    params, _ = reference_apply(case)
    pm = axonn_jax.partition(case.model, axonn_jax.Grid(**grid), *case.args)
    placed = pm.shard(params)

    def loss(p):
        return case.loss(pm.apply(p, *case.args), *case.args)

    eager_out, jitted_out = pm.apply(placed, *case.args), jax.jit(pm.apply)(placed, *case.args)
    np.testing.assert_array_equal(np.asarray(eager_out), np.asarray(jitted_out))
    eager_grads, jitted_grads = jax.grad(loss)(placed), jax.jit(jax.grad(loss))(placed)
    for a, b in zip(jax.tree.leaves(eager_grads), jax.tree.leaves(jitted_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    pm.apply(placed, *case.args)  # a second eager call reuses the compiled program
    (function,) = pm._functions.values()
    assert function._cache_size() == 1

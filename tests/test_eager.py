"""Eager ``pm.apply`` (and eager ``jax.grad`` of it) equals the jitted call on the grids of the table."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import grid_id, spread
from partition_cases import GRIDS, build, reference_apply

import axonn_jax


#: each variant on two grids, every grid of the table under some variant (conftest.spread)
VARIANTS = spread([("gpt_linen", "all"), ("mlp_nnx", "all"), ("gpt_linen", "none")], GRIDS)


@pytest.mark.parametrize("variant,grid", VARIANTS, ids=lambda v: grid_id(v) if isinstance(v, dict) else "-".join(v))
def test_eager_apply_and_grad_equal_jitted(variant, grid, devices):
    name, overlap = variant
    case = build(name)
    params, _ = reference_apply(case)
    pm = axonn_jax.partition(case.model, axonn_jax.Grid(**grid), *case.args, overlap=overlap)
    placed = pm.shard(params)

    def loss(p):
        return case.loss(pm.apply(p, *case.args), *case.args)

    eager_out, jitted_out = pm.apply(placed, *case.args), jax.jit(pm.apply)(placed, *case.args)
    np.testing.assert_array_equal(np.asarray(eager_out), np.asarray(jitted_out))
    eager_grads, jitted_grads = jax.grad(loss)(placed), jax.jit(jax.grad(loss))(placed)
    for a, b in zip(jax.tree.leaves(eager_grads), jax.tree.leaves(jitted_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    pm.apply(placed, *case.args)  # a second eager call reuses the compiled program
    (function,) = pm.engine._functions.values()
    assert function._cache_size() == 1


def test_third_party_docs_example_runs_eagerly(devices):
    """The code of docs/third_party_models.md, as written (eager pm.apply), gives the plain logits."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "third_party_models.md").read_text()
    scope: dict = {}
    exec(re.search(r"```python\n(.*?)```", text, re.S).group(1), scope)
    pm, model = scope["pm"], scope["model"]
    params = pm.gather(pm.init(jax.random.key(0)))  # the example's parameters
    ref = model.apply({"params": params}, scope["tokens"], scope["mask"], scope["positions"]).logits
    np.testing.assert_allclose(np.asarray(scope["logits"]), np.asarray(ref), rtol=1e-5, atol=1e-5)

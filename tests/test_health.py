"""NaN/Inf detection names the first offending layer, its parameters and its pipeline stage."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import axonn_jax
from axonn_jax import Grid
from axonn_jax.health import check_finite, diagnose_step, first_nonfinite

X = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)


class LogLayer(nn.Module):
    """Dense then log: the log of the negative entries is NaN."""

    @nn.compact
    def __call__(self, x):
        return jnp.log(nn.Dense(16, name="dense")(x))


class MaskedSqrt(nn.Module):
    """``where(h > 0, sqrt(h), 0)``: finite forward, NaN gradient (0 · 1/sqrt(negative))."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="dense")(x)
        return jnp.where(h > 0, jnp.sqrt(h), 0.0)


class Net(nn.Module):
    """``depth`` relu layers ``layer_1..``, layer ``bad`` replaced by ``special``, then a head."""

    depth: int = 3
    bad: int = 2
    special: type = LogLayer

    @nn.compact
    def __call__(self, x):
        for i in range(1, self.depth + 1):
            if i == self.bad:
                x = self.special(name=f"layer_{i}")(x)
            else:
                x = nn.relu(nn.Dense(16, name=f"layer_{i}")(x))
        return nn.Dense(4, name="head")(x)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(12, 16, rngs=rngs)
        self.second = nnx.Linear(16, 16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.log(self.second(nnx.relu(self.first(x)))))


def _mse(out):
    return jnp.mean(out**2)


def test_linen_names_the_layer_and_equation(devices):
    pm = axonn_jax.partition(Net(), Grid(x=2, y=2, z=2), X)
    params = pm.init(jax.random.key(0))
    found = diagnose_step(pm, lambda out, batch: _mse(out), params, X)
    assert found.where == "forward" and found.kind == "NaN"
    assert found.equation.primitive == "log" and found.layer == "layer_2"
    assert found.equation.params == ("layer_2/dense/bias",)
    assert found.shape == (8, 16) and found.dtype == "float32"
    text = str(found)
    assert "'log' in layer 'layer_2'" in text and "Remedy" in text
    with pytest.raises(FloatingPointError, match=r"NaN first produced in the forward pass.*'log'"):
        check_finite(pm, params, X, loss_fn=_mse)


def test_healthy_model_and_masked_gradient(devices):
    """A finite model gives None; a NaN that appears only in the backward is traced there."""
    model = Net(special=MaskedSqrt)
    params = model.init(jax.random.key(0), X)["params"]
    ref = jax.grad(lambda p: _mse(model.apply({"params": p}, X)))(params)
    assert not np.all(np.isfinite(ref["layer_2"]["dense"]["kernel"]))  # plain Flax: NaN too
    pm = axonn_jax.partition(model, Grid(x=2, z=2, data=2), X)
    sharded = pm.shard(params)
    assert first_nonfinite(pm, sharded, X) is None  # outputs are finite
    masked = first_nonfinite(pm, sharded, X, intermediates=True)
    assert masked.where == "forward" and masked.equation.primitive == "sqrt"
    found = first_nonfinite(pm, sharded, X, loss_fn=_mse)
    assert found.where == "backward" and found.kind == "NaN"
    assert found.equation.primitive == "sqrt" and found.layer == "layer_2"
    assert "made the gradient of the output of" in str(found)


def test_nnx_names_the_consumed_parameters(devices):
    pm = axonn_jax.partition(NnxNet(nnx.Rngs(0)), Grid(x=2, y=2, z=2), X)
    params = pm.init(jax.random.key(0))
    found = first_nonfinite(pm, params, X)
    assert found.equation.primitive == "log" and found.equation.layer is None
    assert found.equation.params == ("second/bias",) and found.layer == "second"
    bad = jax.tree.map(np.array, pm.gather(params))
    bad["second"]["kernel"][3, 5] = np.inf
    found = first_nonfinite(pm, pm.shard(bad), X)
    assert found.where == "parameter" and found.name == "second/kernel" and found.kind == "Inf"
    x = X.copy()
    x[2, 7] = np.nan
    found = first_nonfinite(pm, params, x)
    assert found.where == "input" and found.name == "args[0]"


def test_pipeline_names_the_stage(devices):
    model = Net(depth=4, bad=3)
    pm = axonn_jax.partition(model, Grid(pipeline=2, x=2, z=2), X, stages=["layer_3"])
    assert "layer_3/dense/kernel" in pm.plan.stages[1].params
    found = first_nonfinite(pm, pm.init(jax.random.key(0)), X)
    assert found.where == "forward" and found.layer == "layer_3" and found.stage == 1
    assert "pipeline stage 1 of 2" in str(found)

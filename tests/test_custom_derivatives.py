"""Custom derivative rules survive partitioning (partitioner/pointwise.py, runtime/pointwise.py).

Pointwise ``custom_jvp`` functions keep their rule on every grid; other custom
rules are inlined and named in the plan's warnings. Gradients are compared
with plain Flax on one device, with the bounds of ``test_partition.py``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axonn_jax
from axonn_jax.partitioner.pointwise import keeps_whole
from axonn_jax.partitioner.trace import inline_calls, trace_model

GRIDS = [dict(x=2, y=2, z=2), dict(x=4, z=2), dict(y=2, z=2, data=2), dict(z=8)]


@jax.custom_jvp
def straight_through_clip(x):
    """Forward: clip to [-1, 1]; derivative: 1 everywhere (not the body's)."""
    return jnp.clip(x, -1.0, 1.0)


@straight_through_clip.defjvp
def _clip_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return straight_through_clip(x), t * jnp.ones_like(x)


class Net(nn.Module):
    activation: object

    @nn.compact
    def __call__(self, x):
        h = self.activation(nn.Dense(32)(x))
        return nn.Dense(8)(self.activation(nn.Dense(16)(h)))


def _inputs():
    x = np.random.default_rng(0).standard_normal((16, 12)).astype(np.float32)
    x[::2] = 0.0  # zero rows: zero-initialised biases give pre-activations exactly 0
    return 3.0 * x  # large enough that the clip saturates


PROBE = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)


def _grads(apply, params, x):
    """Gradients of a loss whose output gradient is nonzero on every row (the zero ones too)."""
    return jax.jit(jax.grad(lambda p: jnp.sum(apply(p, x) * PROBE)))(params)


def _max_errors(got, ref) -> dict:
    scale = max(float(np.max(np.abs(r))) for r in jax.tree.leaves(ref))
    return {jax.tree_util.keystr(k): (float(np.max(np.abs(np.asarray(g) - r))),
                                      1e-5 * float(np.max(np.abs(r))) + 1e-6 * scale)
            for (k, g), r in zip(jax.tree_util.tree_leaves_with_path(got),
                                 jax.tree.leaves(ref))}  # fmt: skip


@pytest.mark.parametrize("activation", [nn.relu, straight_through_clip], ids=["relu", "ste_clip"])
def test_rule_differs_from_autodiff_of_the_body(activation):
    """The case is not vacuous: autodiff of the inlined body gives other gradients."""
    model, x = Net(activation), _inputs()
    params = model.init(jax.random.key(0), x)["params"]
    body = {nn.relu: lambda v: jnp.maximum(v, 0.0), straight_through_clip: lambda v: jnp.clip(v, -1.0, 1.0)}
    ref = _grads(lambda p, a: model.apply({"params": p}, a), params, x)
    inlined = _grads(lambda p, a: Net(body[activation]).apply({"params": p}, a), params, x)
    errors = _max_errors(inlined, ref)
    assert any(err > bound for err, bound in errors.values()), errors


@pytest.mark.parametrize("activation", [nn.relu, straight_through_clip], ids=["relu", "ste_clip"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: ",".join(f"{k}={v}" for k, v in g.items()))
def test_pointwise_rule_is_kept_on_every_grid(activation, grid, devices):
    model, x = Net(activation), _inputs()
    params = model.init(jax.random.key(0), x)["params"]
    ref = _grads(lambda p, a: model.apply({"params": p}, a), params, x)
    pm = axonn_jax.partition(model, axonn_jax.Grid(**grid), x)
    got = pm.gather(_grads(pm.apply, pm.shard(params), x))
    for path, (err, bound) in _max_errors(got, ref).items():
        assert err <= bound, f"{path} on {grid}: {err:.3e} > {bound:.3e}"
    assert not [w for w in pm.plan.warnings if "inlined" in w], pm.plan.warnings


class _Heads(nn.Module):
    """An ensemble of relu MLP heads under ``nn.vmap`` (one set of weights per head)."""

    @nn.compact
    def __call__(self, x):
        head = nn.vmap(Net, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None,
                       out_axes=0, axis_size=4)  # fmt: skip
        return jnp.mean(head(nn.relu)(x), axis=0)


@pytest.mark.parametrize("grid", [dict(z=2, data=4), dict(x=2, y=2, z=2)], ids=lambda g: ",".join(
    f"{k}={v}" for k, v in g.items()))  # fmt: skip
def test_a_batched_relu_keeps_its_rule(grid, devices):
    """Under ``vmap`` relu's rule fills its zero tangent at the unbatched shape and broadcasts
    it over the batch: still pointwise. It used to be inlined (with a warning), so on the
    zero rows the gradients were autodiff of max(x, 0)'s (relu'(0) = 0.5), not relu's."""
    model, x = _Heads(), _inputs()
    params = model.init(jax.random.key(0), x)["params"]
    ref = _grads(lambda p, a: model.apply({"params": p}, a), params, x)
    pm = axonn_jax.partition(model, axonn_jax.Grid(**grid), x)
    assert not [w for w in pm.plan.warnings if "inlined" in w], pm.plan.warnings
    got = pm.gather(_grads(pm.apply, pm.shard(params), x))
    for path, (err, bound) in _max_errors(got, ref).items():
        assert err <= bound, f"{path} on {grid}: {err:.3e} > {bound:.3e}"


def test_kept_call_is_one_equation_split_like_its_operand():
    model, x = Net(nn.relu), _inputs()
    traced = trace_model(model, x)
    kept = [e for e in inline_calls(traced.jaxpr).jaxpr.eqns if e.primitive.name == "custom_jvp_call"]
    assert len(kept) == 2 and all(keeps_whole(e) for e in kept)
    # a Dense → relu → Dense chain still splits both weights (relu is elementwise)
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, y=2), x)
    assert not pm.plan.fallbacks
    assert pm.plan.param("Dense_0/kernel").bytes_per_device(pm.plan.grid) * 4 == 12 * 32 * 4


def test_non_pointwise_rule_is_named_in_the_plan():
    @jax.custom_jvp
    def normalise(v):
        return v / jnp.sum(v, axis=-1, keepdims=True)

    normalise.defjvps(lambda t, ans, v: t / jnp.sum(v, axis=-1, keepdims=True))

    @jax.custom_vjp
    def ste_round(v):
        return jnp.round(v)

    ste_round.defvjp(lambda v: (jnp.round(v), None), lambda _, g: (g,))

    class Odd(nn.Module):
        @nn.compact
        def __call__(self, x):
            return ste_round(normalise(nn.Dense(8)(x)))

    x = _inputs()
    pm = axonn_jax.partition(Odd(), axonn_jax.Grid(x=2), x)
    notes = [w for w in pm.plan.warnings if "is inlined" in w]
    assert any("custom_jvp function 'normalise'" in n for n in notes), pm.plan.warnings
    assert any("custom_vjp function 'ste_round'" in n for n in notes), pm.plan.warnings


def test_forward_mode_through_pm_apply_is_refused_with_the_remedy(devices):
    """The split matmuls define their reverse-mode derivative (``jax.custom_vjp``): ``jax.jvp``
    through ``pm.apply`` on a tensor-parallel grid names the grid and the remedy (it was JAX's
    bare "can't apply forward-mode autodiff (jvp) to a custom_vjp function"); reverse mode
    (``jax.jacrev``) and a data-parallel grid's ``jax.jvp`` give the plain model's."""
    x = np.random.default_rng(1).standard_normal((8, 3)).astype(np.float32)
    model = nn.Sequential([nn.Dense(16), jnp.tanh, nn.Dense(4)])
    params = model.init(jax.random.key(0), x)["params"]
    plain = lambda a: model.apply({"params": params}, a)  # noqa: E731
    split = axonn_jax.partition(model, axonn_jax.Grid(x=2, data=4), x)
    with pytest.raises(TypeError, match=r"forward-mode differentiation .* grid .*x=2.*Remedy: reverse mode"):
        jax.jvp(lambda a: split.apply(split.shard(params), a), (x,), (np.ones_like(x),))
    jac = jax.jacrev(lambda a: split.apply(split.shard(params), a).sum())(x)
    np.testing.assert_allclose(np.asarray(jac), np.asarray(jax.jacrev(lambda a: plain(a).sum())(x)), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    data = axonn_jax.partition(model, axonn_jax.Grid(data=8), x)
    _, tangent = jax.jvp(lambda a: data.apply(data.shard(params), a), (x,), (np.ones_like(x),))
    np.testing.assert_allclose(np.asarray(tangent), np.asarray(jax.jvp(plain, (x,), (np.ones_like(x),))[1]),
                               rtol=1e-5, atol=1e-6)  # fmt: skip

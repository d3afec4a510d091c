"""Parameters a model never reads, or returns as they are (a learnable temperature), on one
mesh and on a pipeline: held where they are needed, and their gradients the plain model's;
and complex parameters (a Fourier neural operator's spectral weights) trained as optax does.

Both are common in reinforcement learning (SAC's ``log_alpha`` returned beside the actions;
a target network's parameters created but used by another method).

Bounds (float32): the loss to rtol 1e-6, every gradient to rtol 1e-5 / atol 1e-6.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import axonn_jax

X = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)


class WithTemperature(nn.Module):
    """Four Dense layers, a parameter never read, and ``log_alpha`` returned as it is."""

    @nn.compact
    def __call__(self, x):
        self.param("unused", nn.initializers.normal(1.0), (8, 8))
        for width in (32, 32, 32):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(4)(x), self.param("log_alpha", nn.initializers.constant(0.3), ())


def loss_fn(out, batch):
    actions, log_alpha = out
    return jnp.mean(actions**2) * jnp.exp(log_alpha) - log_alpha


def _plain(params):
    return jax.value_and_grad(lambda p: loss_fn(WithTemperature().apply({"params": p}, X), X))(params)


def _check(pm, params):
    loss, grads = pm.value_and_grad(loss_fn, inputs=lambda b: (b,))(pm.shard(params), X)
    want_loss, want = _plain(params)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    got = pm.gather(grads)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=str(path))
    return grads


def test_an_unused_parameter_s_gradient_is_zero_in_its_layout(devices):
    """Eager ``pm.value_and_grad`` gave the never-read parameter JAX's zeros on one device, and
    ``pm.gather(grads)`` failed ('SingleDeviceSharding' object has no attribute 'mesh')."""
    params = WithTemperature().init(jax.random.key(0), X)["params"]
    pm = axonn_jax.partition(WithTemperature(), axonn_jax.Grid(x=2, y=2, z=2), X)
    grads = _check(pm, params)
    assert grads["unused"].sharding == pm.shard(params)["unused"].sharding
    assert not np.asarray(pm.gather(grads)["unused"]).any()


def test_a_parameter_returned_as_an_output_is_held_by_the_last_stage(devices):
    """``log_alpha`` is read by no equation, only returned: no stage listed it, so it was kept
    with stage 0, while the last stage's program reads it. Under mpiexec the last stage's process
    had ``None`` there ('NoneType' object has no attribute 'dtype'); now the last stage holds it."""
    params = WithTemperature().init(jax.random.key(0), X)["params"]
    pm = axonn_jax.partition(WithTemperature(), axonn_jax.Grid(pipeline=2, x=2, z=2), X)
    assert "log_alpha" in pm.plan.stages[-1].params and "log_alpha" not in pm.plan.stages[0].params
    assert not any("unused" in st.params for st in pm.plan.stages)
    _check(pm, params)


class SpectralMix(nn.Module):
    """A complex weight multiplied into the (complexified) features, as Fourier neural
    operators keep their spectral weights, then a real head."""

    @nn.compact
    def __call__(self, x):
        def complex_normal(key, shape):
            re, im = jax.random.normal(key, (2, *shape))
            return ((re + 1j * im) / 4).astype(jnp.complex64)

        h = jnp.real((x + 0j) @ self.param("spectral", complex_normal, (8, 16)))
        return nn.Dense(4)(h)


def test_a_complex_parameter_trains_as_plain_optax_does(devices):
    """``pm.train_step`` of a model with a complex64 parameter: three AdamW steps equal plain
    Flax + optax (it used to fail building the step: the update's fingerprint formatted its
    complex constants with ``float``); mixed precision keeps the parameter complex."""
    import optax

    model = SpectralMix()
    params = model.init(jax.random.key(0), X)["params"]
    loss_fn = lambda out, batch: jnp.mean(out**2)  # noqa: E731
    optimizer = optax.adamw(1e-2)
    want, state = params, optimizer.init(params)
    for _ in range(3):
        grads = jax.grad(lambda p: loss_fn(model.apply({"params": p}, X), X))(want)
        updates, state = optimizer.update(grads, state, want)
        want = optax.apply_updates(want, updates)
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, y=2, z=2), X)
    for precision in ("fp32", "bf16"):
        step = pm.train_step(loss_fn, optimizer, precision=precision)
        p, s = step.init(pm.shard(params))
        for _ in range(3):
            p, s, loss = step(p, s, X)
        got = pm.gather(step.checkpoint_state(p, s)[0])
        assert got["spectral"].dtype == jnp.complex64 and np.isfinite(float(loss))
        if precision == "fp32":
            leaves = dict(jax.tree_util.tree_leaves_with_path(got))
            for path, w in jax.tree_util.tree_leaves_with_path(want):
                np.testing.assert_allclose(leaves[path], w, rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_gradients_a_jitted_step_returns_as_constants_are_gathered(devices):
    """A loss that does not depend on the parameters: the user's jitted step returns their
    zero gradients as constants on one device (no mesh); ``pm.gather`` reads them as they are
    (it raised ``AttributeError``: 'SingleDeviceSharding' has no mesh), NumPy leaves too."""
    model = WithTemperature()
    params = model.init(jax.random.key(0), X)["params"]
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, y=2, z=2), X)
    grads = jax.jit(jax.grad(lambda p: jnp.mean(jax.lax.stop_gradient(pm.apply(p, X)[0]) ** 2)))(pm.shard(params))
    assert not hasattr(jax.tree.leaves(grads)[0].sharding, "mesh")  # the case: constants on one device
    gathered = pm.gather(grads)
    assert all(not np.any(g) for g in jax.tree.leaves(gathered))
    assert jax.tree.map(np.shape, gathered) == jax.tree.map(np.shape, params)
    host = pm.gather(jax.tree.map(np.asarray, pm.gather(pm.shard(params))))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(params)))

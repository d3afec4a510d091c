"""Python scalars in the call (flags like ``deterministic=True``) are static, as in jax.jit."""

import flax.linen as nn
import jax
import numpy as np

import axonn_jax


class Flagged(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = False, scale: float = 1.0):
        h = nn.Dropout(0.5, deterministic=deterministic)(nn.Dense(16)(x))  # needs a Python bool
        return nn.Dense(4)(h) * scale


def test_python_flags_are_static(devices):
    model, x = Flagged(), np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, z=2, data=2), x, deterministic=True, scale=2.0)
    params = pm.init(jax.random.key(0))
    full = pm.gather(params)
    for scale in (2.0, 3.0):  # another value: another program, same layout
        got = jax.jit(lambda p, x, s=scale: pm.apply(p, x, deterministic=True, scale=s))(params, x)
        want = model.apply({"params": full}, x, deterministic=True, scale=scale)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert pm.report().communication.wire_bytes > 0  # the report traces the same call

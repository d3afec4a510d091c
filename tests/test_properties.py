"""Property: for random small linen models and random 8-device grids, partitioned == plain Flax.

Hypothesis draws a model (depth 1–3, widths from {8, 16, 32}, activation,
bias on/off, LayerNorm/RMSNorm/none, residual connections, optional
self-attention block) and a grid x·y·z·data = 8, and checks the loss and the
gradients of ``pm.apply`` inside ``jax.jit`` against ``model.apply`` on one
device, with the bounds of tests/test_partition.py (fp32):

* loss: |Δ| ≤ 1e-5·|ref|;
* gradients, per leaf: max|Δ| ≤ 1e-5·max|ref leaf| + 1e-6·G (G: the largest
  gradient entry of the model).

The examples are derandomised (the same ones on every run) and bounded
(``max_examples``) so the file stays fast.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import axonn_jax
from axonn_jax import Grid
from axonn_jax.partitioner.trace import path_string

BATCH, SEQ, IN = 8, 4, 16
ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu, "tanh": jnp.tanh, "silu": nn.silu}
NORMS = {"none": None, "layer": nn.LayerNorm, "rms": nn.RMSNorm}


class RandomNet(nn.Module):
    """[batch, seq, IN] → optional attention block → Dense layers → [batch, seq, 8]."""

    widths: tuple[int, ...]
    activation: str
    bias: bool
    norm: str
    residual: bool
    attention: bool

    @nn.compact
    def __call__(self, x):
        act = ACTIVATIONS[self.activation]
        if self.attention:
            y = nn.MultiHeadDotProductAttention(num_heads=2, use_bias=self.bias, name="attn")(x)
            x = x + y
        for i, width in enumerate(self.widths):
            h = x
            if NORMS[self.norm] is not None:
                h = NORMS[self.norm](name=f"norm_{i}")(h)
            h = act(nn.Dense(width, use_bias=self.bias, name=f"dense_{i}")(h))
            x = x + h if self.residual and h.shape == x.shape else h
        return nn.Dense(8, use_bias=self.bias, name="out")(x)


models = st.builds(
    RandomNet,
    widths=st.lists(st.sampled_from([8, 16, 32]), min_size=1, max_size=3).map(tuple),
    activation=st.sampled_from(sorted(ACTIVATIONS)),
    bias=st.booleans(),
    norm=st.sampled_from(sorted(NORMS)),
    residual=st.booleans(),
    attention=st.booleans(),
)
grids = st.sampled_from(
    [Grid(x=x, y=y, z=z, data=8 // (x * y * z))
     for x in (1, 2, 4, 8) for y in (1, 2, 4, 8) for z in (1, 2, 4, 8)
     if 8 % (x * y * z) == 0]  # fmt: skip
)


def _leaves(tree) -> dict[str, np.ndarray]:
    return {path_string(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(model=models, grid=grids, seed=st.integers(0, 2**16))
def test_partitioned_equals_plain_flax(model, grid, seed):
    assert jax.device_count() == 8
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SEQ, IN)).astype(np.float32)
    target = rng.standard_normal((BATCH, SEQ, 8)).astype(np.float32)
    params = model.init(jax.random.key(seed), x)["params"]

    def loss(out):
        return jnp.mean((out - target) ** 2)

    ref_loss, ref = jax.jit(jax.value_and_grad(lambda p: loss(model.apply({"params": p}, x))))(params)
    pm = axonn_jax.partition(model, grid, x)
    got_loss, got = jax.jit(jax.value_and_grad(lambda p: loss(pm.apply(p, x))))(pm.shard(params))
    where = f"{model} on {grid}"
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-5, err_msg=where)
    ref_g, got_g = _leaves(ref), _leaves(pm.gather(got))
    assert ref_g.keys() == got_g.keys()
    scale = max(np.max(np.abs(g)) for g in ref_g.values())
    for path, r in ref_g.items():
        err = np.max(np.abs(got_g[path] - r))
        bound = 1e-5 * np.max(np.abs(r)) + 1e-6 * scale
        assert err <= bound, f"{where}: grad {path} {err:.3e} > {bound:.3e}"


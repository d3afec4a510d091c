"""A multi-layer perceptron, in Flax linen (:class:`MLP`) and nnx (:class:`MLPNNX`).

Dense layers of the given widths with gelu between them and nothing after the
last one. The nnx twin has the same parameter shapes and numerics (its layers
live in ``self.layers[i]``, the linen ones are named ``dense_i``).

Example::

    import jax, jax.numpy as jnp
    from flax import nnx
    from axonn_jax.models import MLP, MLPNNX

    x = jnp.ones((4, 16))
    model = MLP(features=(32, 32, 10))
    params = model.init(jax.random.key(0), x)["params"]
    y = model.apply({"params": params}, x)                       # [4, 10]
    y2 = MLPNNX(16, (32, 32, 10), rngs=nnx.Rngs(0))(x)           # [4, 10]
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

Dtype = Any


class MLP(nn.Module):
    """Dense(features[0]) → gelu → … → Dense(features[-1]) on the last axis."""

    features: Sequence[int]
    use_bias: bool = True
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., in] -> [..., features[-1]]."""
        if not self.features:
            raise ValueError("MLP.features must name at least one layer width")
        for i, width in enumerate(self.features):
            if i:
                x = nn.gelu(x)
            x = nn.Dense(width, use_bias=self.use_bias, dtype=self.dtype, name=f"dense_{i}")(x)
        return x


class MLPNNX(nnx.Module):
    """nnx twin of :class:`MLP`; needs the input width ``in_features``."""

    def __init__(
        self,
        in_features: int,
        features: Sequence[int],
        *,
        use_bias: bool = True,
        dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if not features:
            raise ValueError("MLPNNX features must name at least one layer width")
        widths = (in_features, *features)
        self.layers = nnx.List(
            [
                nnx.Linear(a, b, use_bias=use_bias, dtype=dtype, rngs=rngs)
                for a, b in zip(widths[:-1], widths[1:])
            ]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., in_features] -> [..., features[-1]]."""
        for i, layer in enumerate(self.layers):
            if i:
                x = nnx.gelu(x)
            x = layer(x)
        return x

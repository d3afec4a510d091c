"""A small convolutional classifier in Flax linen.

Two 3×3 SAME convolutions, each followed by relu and 2×2 average pooling, then
flatten and a Dense layer to the class logits. Inputs are NHWC.

Example::

    import jax, jax.numpy as jnp
    from axonn_jax.models import CNN

    images = jnp.ones((8, 28, 28, 1))
    model = CNN(channels=(8, 16), num_classes=10)
    params = model.init(jax.random.key(0), images)["params"]
    logits = model.apply({"params": params}, images)          # [8, 10]
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any


class CNN(nn.Module):
    """Conv(3×3)→relu→avg_pool(2×2) per entry of ``channels``, flatten, Dense(num_classes)."""

    channels: Sequence[int] = (8, 16)
    num_classes: int = 10
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        """[batch, H, W, C] -> logits [batch, num_classes]."""
        if images.ndim != 4:
            raise ValueError(f"CNN expects NHWC images [batch, H, W, C], got shape {images.shape}")
        x = images
        for i, width in enumerate(self.channels):
            conv = nn.Conv(
                width, kernel_size=(3, 3), padding="SAME", dtype=self.dtype, name=f"conv_{i}"
            )
            x = conv(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)

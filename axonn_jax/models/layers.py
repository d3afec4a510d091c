"""Transformer building blocks shared by the reference models (linen and nnx).

Plain Flax layers and ``jnp`` ops only: no sharding annotations, no
``nn.scan``/``nn.remat``, so that the automatic partitioner sees an ordinary
program when it traces a model that uses them. Dropout (attention weights)
only with a rate, in train mode.

Example::

    import jax, jax.numpy as jnp
    from axonn_jax.models.layers import Attention

    attn = Attention(num_heads=4, head_dim=16, causal=True)
    x = jnp.ones((2, 8, 64))
    params = attn.init(jax.random.key(0), x)
    y = attn.apply(params, x)                      # [2, 8, 64]

Each linen block has an nnx twin (``AttentionNNX``, ``FeedForwardNNX``) with the
same numerics and the same parameter names and shapes; the names are part of the
contract with the linen→nnx converter in :mod:`axonn_jax.models.gpt`.
``Attention``: ``query``/``key``/``value`` kernels [hidden, heads, head_dim],
``out`` kernel [heads, head_dim, hidden]. ``FeedForward``: ``fc_in`` [hidden,
ffn], ``fc_out`` [ffn, hidden].
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

Dtype = Any

#: Names accepted for the ``norm`` option of the model configs.
NORMS = ("layernorm", "rmsnorm")

#: Initializer of token and position embeddings (GPT-2 style).
EMBED_INIT = nn.initializers.normal(stddev=0.02)


def make_norm(kind: str, *, dtype: Dtype, name: str) -> nn.Module:
    """Returns ``nn.LayerNorm`` or ``nn.RMSNorm`` (``kind`` in :data:`NORMS`)."""
    if kind == "layernorm":
        return nn.LayerNorm(dtype=dtype, name=name)
    if kind == "rmsnorm":
        return nn.RMSNorm(dtype=dtype, name=name)
    raise ValueError(f"unknown norm {kind!r}; expected one of {NORMS}")


def causal_mask(q_len: int, kv_len: int) -> jax.Array:
    """Boolean [q_len, kv_len] mask, True where query ``i`` may see key ``j <= i``."""
    return jnp.tril(jnp.ones((q_len, kv_len), dtype=jnp.bool_))


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, dropout=None
) -> jax.Array:
    """Softmax attention over [batch, seq, heads, head_dim] arrays.

    Scores are computed and normalised in float32 (a no-op for fp32 models) and
    cast back to the dtype of ``v``; ``dropout`` (a function) drops weights.
    """
    q = q * (1.0 / math.sqrt(q.shape[-1]))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    if causal:
        mask = causal_mask(q.shape[1], k.shape[1])
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if dropout is not None:
        weights = dropout(weights)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Attention(nn.Module):
    """Multi-head dot-product attention with q/k/v/out projections.

    ``__call__(x, context=None)``: self-attention when ``context`` is None,
    otherwise cross-attention from ``x`` (queries) to ``context`` (keys/values).
    ``dropout_rate`` drops attention weights when called with ``deterministic=False``.
    """

    num_heads: int
    head_dim: int
    causal: bool = False
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array | None = None,
                 deterministic: bool = True) -> jax.Array:  # fmt: skip
        """[b, s, hidden] (and optional context [b, t, hidden]) -> [b, s, hidden]."""
        hidden = x.shape[-1]
        context = x if context is None else context

        def proj(name: str) -> nn.DenseGeneral:
            return nn.DenseGeneral(
                features=(self.num_heads, self.head_dim),
                use_bias=self.use_bias,
                dtype=self.dtype,
                name=name,
            )

        q = proj("query")(x)
        k = proj("key")(context)
        v = proj("value")(context)
        drop = None
        if self.dropout_rate and not deterministic:
            drop = nn.Dropout(self.dropout_rate, deterministic=False, name="dropout")
        y = dot_product_attention(q, k, v, causal=self.causal, dropout=drop)
        return nn.DenseGeneral(
            features=hidden,
            axis=(-2, -1),
            use_bias=self.use_bias,
            dtype=self.dtype,
            name="out",
        )(y)


class FeedForward(nn.Module):
    """Two-layer MLP: Dense(hidden→ffn), gelu, Dense(ffn→hidden)."""

    ffn_hidden: int
    use_bias: bool = True
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., hidden] -> [..., hidden]."""
        hidden = x.shape[-1]
        h = nn.Dense(self.ffn_hidden, use_bias=self.use_bias, dtype=self.dtype, name="fc_in")(x)
        h = nn.gelu(h)
        return nn.Dense(hidden, use_bias=self.use_bias, dtype=self.dtype, name="fc_out")(h)


# --------------------------------------------------------------------------- nnx


def make_norm_nnx(kind: str, num_features: int, *, dtype: Dtype, rngs: nnx.Rngs) -> nnx.Module:
    """nnx twin of :func:`make_norm`."""
    if kind == "layernorm":
        return nnx.LayerNorm(num_features, dtype=dtype, rngs=rngs)
    if kind == "rmsnorm":
        return nnx.RMSNorm(num_features, dtype=dtype, rngs=rngs)
    raise ValueError(f"unknown norm {kind!r}; expected one of {NORMS}")


class AttentionNNX(nnx.Module):
    """nnx twin of :class:`Attention` (same parameter names and shapes)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        head_dim: int,
        *,
        causal: bool = False,
        use_bias: bool = True,
        dtype: Dtype = jnp.float32,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
    ):
        def proj() -> nnx.LinearGeneral:
            return nnx.LinearGeneral(
                hidden, (num_heads, head_dim), use_bias=use_bias, dtype=dtype, rngs=rngs
            )

        self.causal = causal
        self.query, self.key, self.value = proj(), proj(), proj()
        self.out = nnx.LinearGeneral(
            (num_heads, head_dim), hidden, axis=(-2, -1), use_bias=use_bias, dtype=dtype, rngs=rngs
        )
        if dropout_rate:
            self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x: jax.Array, context: jax.Array | None = None) -> jax.Array:
        """[b, s, hidden] (and optional context [b, t, hidden]) -> [b, s, hidden]."""
        context = x if context is None else context
        q, k, v = self.query(x), self.key(context), self.value(context)
        drop = getattr(self, "dropout", None)
        return self.out(dot_product_attention(q, k, v, causal=self.causal, dropout=drop))


class FeedForwardNNX(nnx.Module):
    """nnx twin of :class:`FeedForward`."""

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        *,
        use_bias: bool = True,
        dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.fc_in = nnx.Linear(hidden, ffn_hidden, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.fc_out = nnx.Linear(ffn_hidden, hidden, use_bias=use_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., hidden] -> [..., hidden]."""
        return self.fc_out(nnx.gelu(self.fc_in(x)))

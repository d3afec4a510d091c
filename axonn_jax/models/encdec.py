"""A small transformer encoder–decoder in Flax linen.

Encoder: ``num_encoder_layers`` pre-norm blocks of (non-causal) self-attention
and MLP. Decoder: ``num_decoder_layers`` pre-norm blocks of causal
self-attention, cross-attention to the encoder output, and MLP. Source and
target share one token embedding (``embed``), each side has its own learned
position embedding, and the output head is tied to the token embedding. There
is no padding mask: every position of ``src_tokens`` is attended to.

Example::

    import jax, jax.numpy as jnp
    from axonn_jax.models import EncDecConfig, EncoderDecoder

    model = EncoderDecoder(EncDecConfig(vocab_size=128, hidden=64, num_heads=4))
    src = jnp.zeros((2, 12), jnp.int32)
    tgt = jnp.zeros((2, 10), jnp.int32)
    params = model.init(jax.random.key(0), src, tgt)["params"]
    logits = model.apply({"params": params}, src, tgt)          # [2, 10, 128]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from axonn_jax.models.layers import EMBED_INIT, NORMS, Attention, FeedForward, make_norm

Dtype = Any


@dataclasses.dataclass(frozen=True)
class EncDecConfig:
    """Hyper-parameters of :class:`EncoderDecoder` (validated on construction).

    ``ffn_hidden=None`` resolves to ``4 * hidden``; ``max_seq_len`` bounds both
    the source and the target length.
    """

    vocab_size: int = 256
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    ffn_hidden: int | None = None
    max_seq_len: int = 64
    norm: str = "layernorm"
    use_bias: bool = True
    dtype: Dtype = jnp.float32

    def __post_init__(self):
        for name in (
            "vocab_size", "num_encoder_layers", "num_decoder_layers",
            "hidden", "num_heads", "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EncDecConfig.{name} must be a positive int, got {value!r}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"EncDecConfig.hidden={self.hidden} is not divisible by "
                f"num_heads={self.num_heads}; choose a multiple of the number of heads"
            )
        if self.norm not in NORMS:
            raise ValueError(f"EncDecConfig.norm={self.norm!r} is unknown; expected one of {NORMS}")
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        elif not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 1:
            raise ValueError(
                f"EncDecConfig.ffn_hidden must be a positive int or None, got {self.ffn_hidden!r}"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head, ``hidden // num_heads``."""
        return self.hidden // self.num_heads


class EncoderBlock(nn.Module):
    """x + self_attn(norm(x)) (non-causal), then x + mlp(norm(x))."""

    config: EncDecConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """[b, s, hidden] -> [b, s, hidden]."""
        c = self.config
        h = make_norm(c.norm, dtype=c.dtype, name="norm_attn")(x)
        x = x + Attention(
            c.num_heads, c.head_dim, use_bias=c.use_bias, dtype=c.dtype, name="attn"
        )(h)
        h = make_norm(c.norm, dtype=c.dtype, name="norm_mlp")(x)
        return x + FeedForward(c.ffn_hidden, use_bias=c.use_bias, dtype=c.dtype, name="mlp")(h)


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to ``memory``, MLP; each pre-norm + residual."""

    config: EncDecConfig

    @nn.compact
    def __call__(self, x: jax.Array, memory: jax.Array) -> jax.Array:
        """x [b, t, hidden], encoder output memory [b, s, hidden] -> [b, t, hidden]."""
        c = self.config
        h = make_norm(c.norm, dtype=c.dtype, name="norm_self")(x)
        x = x + Attention(
            c.num_heads, c.head_dim, causal=True, use_bias=c.use_bias, dtype=c.dtype,
            name="self_attn",
        )(h)
        h = make_norm(c.norm, dtype=c.dtype, name="norm_cross")(x)
        x = x + Attention(
            c.num_heads, c.head_dim, use_bias=c.use_bias, dtype=c.dtype, name="cross_attn"
        )(h, memory)
        h = make_norm(c.norm, dtype=c.dtype, name="norm_mlp")(x)
        return x + FeedForward(c.ffn_hidden, use_bias=c.use_bias, dtype=c.dtype, name="mlp")(h)


class EncoderDecoder(nn.Module):
    """(src [b, s], tgt [b, t]) int32 tokens -> logits [b, t, vocab]."""

    config: EncDecConfig

    @nn.compact
    def __call__(self, src_tokens: jax.Array, tgt_tokens: jax.Array) -> jax.Array:
        c = self.config
        for name, tokens in (("src_tokens", src_tokens), ("tgt_tokens", tgt_tokens)):
            if tokens.ndim != 2 or tokens.shape[1] > c.max_seq_len:
                raise ValueError(
                    f"{name} must be [batch, seq] with seq <= max_seq_len={c.max_seq_len}, "
                    f"got shape {tokens.shape}"
                )
        embed = nn.Embed(
            c.vocab_size, c.hidden, dtype=c.dtype, embedding_init=EMBED_INIT, name="embed"
        )
        src_pos = self.param("src_pos_embed", EMBED_INIT, (c.max_seq_len, c.hidden))
        tgt_pos = self.param("tgt_pos_embed", EMBED_INIT, (c.max_seq_len, c.hidden))

        x = embed(src_tokens) + src_pos[: src_tokens.shape[1]].astype(c.dtype)
        for i in range(c.num_encoder_layers):
            x = EncoderBlock(c, name=f"encoder_{i}")(x)
        memory = make_norm(c.norm, dtype=c.dtype, name="norm_encoder")(x)

        y = embed(tgt_tokens) + tgt_pos[: tgt_tokens.shape[1]].astype(c.dtype)
        for i in range(c.num_decoder_layers):
            y = DecoderBlock(c, name=f"decoder_{i}")(y, memory)
        y = make_norm(c.norm, dtype=c.dtype, name="norm_decoder")(y)
        return embed.attend(y)

"""A small GPT (decoder-only transformer), in Flax linen and in Flax nnx.

Both implementations are the same model: same architecture, same parameter
names and shapes, same numerics (see :func:`gpt_nnx_from_linen_params`).

Architecture: token embedding + learned position embedding, ``num_layers``
pre-norm blocks (norm → causal self-attention → residual, norm → MLP with gelu
→ residual), final norm, output head tied to the token embedding
(``embed.attend``) or an untied ``head`` Dense without bias.

Example::

    import jax, jax.numpy as jnp
    from axonn_jax.models import GPT, GPTConfig, next_token_loss

    config = GPTConfig(vocab_size=256, num_layers=2, hidden=64, num_heads=4)
    model = GPT(config)
    tokens = jnp.zeros((2, 16), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    logits = model.apply({"params": params}, tokens)     # [2, 16, 256]
    loss = next_token_loss(logits, tokens)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from axonn_jax.models.layers import (
    EMBED_INIT,
    NORMS,
    Attention,
    AttentionNNX,
    FeedForward,
    FeedForwardNNX,
    make_norm,
    make_norm_nnx,
)

Dtype = Any


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT` / :class:`GPTNNX` (validated on construction).

    ``ffn_hidden=None`` resolves to ``4 * hidden``. ``use_bias`` controls the
    biases of the Dense layers (attention and MLP); LayerNorm always has a bias.
    ``dtype`` is the computation dtype; parameters are always float32.
    ``dropout`` is GPT-2's: on the embeddings, the attention weights and both
    residual branches, in train mode (linen ``deterministic=False`` with
    ``rngs={'dropout': key}``; nnx: the module's ``'dropout'`` stream unless
    ``.eval()``); 0 adds no dropout at all.
    """

    vocab_size: int = 256
    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    ffn_hidden: int | None = None
    max_seq_len: int = 64
    norm: str = "layernorm"
    tie_embeddings: bool = True
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "hidden", "num_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"GPTConfig.hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                "choose a hidden size that is a multiple of the number of heads"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.norm not in NORMS:
            raise ValueError(f"GPTConfig.norm={self.norm!r} is unknown; expected one of {NORMS}")
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        elif not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 1:
            raise ValueError(
                f"GPTConfig.ffn_hidden must be a positive int or None, got {self.ffn_hidden!r}"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head, ``hidden // num_heads``."""
        return self.hidden // self.num_heads

    def num_params(self) -> int:
        """Exact number of parameters of the model."""
        h, f, v, b = self.hidden, self.ffn_hidden, self.vocab_size, int(self.use_bias)
        norm = 2 * h if self.norm == "layernorm" else h
        attention = 4 * (h * h + b * h)
        mlp = h * f + b * f + f * h + b * h
        per_layer = 2 * norm + attention + mlp
        head = 0 if self.tie_embeddings else h * v
        return v * h + self.max_seq_len * h + self.num_layers * per_layer + norm + head

    def flops_per_token(
        self, seq_len: int | None = None, *, activation_recompute: bool = True
    ) -> float:
        """Matmul FLOPs of one training step (forward + backward), per token.

        Counts the dense layers (2·in·out per token), the two attention matmuls
        (QKᵀ and AV over the full, unmasked ``seq_len``) and the output head,
        times 3 for forward + backward, plus one more forward of the blocks when
        ``activation_recompute`` (the head is not recomputed). With
        ``ffn_hidden = 4·hidden`` and recompute this is exactly IPDPS'22 eq. 3,
        ``96·b·s·l·h²·(1 + s/(6h) + V/(16·l·h))``, divided by ``b·s``.
        Norms, softmax and elementwise ops are ignored.
        """
        s = self.max_seq_len if seq_len is None else seq_len
        h, f, l, v = self.hidden, self.ffn_hidden, self.num_layers, self.vocab_size
        block_forward = 2 * (4 * h * h + 2 * h * f) + 2 * 2 * s * h
        head_forward = 2 * h * v
        passes = 4 if activation_recompute else 3
        return float(passes * l * block_forward + 3 * head_forward)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting each next token; a scalar.

    ``logits`` is [batch, S, vocab]. ``tokens`` is either

    * int [batch, S + 1], a window of :class:`~axonn_jax.loader.Loader`: the
      model read ``tokens[:, :-1]`` (:func:`window_inputs`) and every logit
      predicts the token after it, ``tokens[:, 1:]``; or
    * int [batch, S], the model's own input: ``logits[:, :-1]`` predict
      ``tokens[:, 1:]`` (the last logit has no target).
    """
    logits, targets = _next_token_pairs(logits, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).mean()


def next_token_accuracy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """The share of positions whose most likely next token is the right one (float32 scalar);
    ``logits`` and ``tokens`` as in :func:`next_token_loss`."""
    logits, targets = _next_token_pairs(logits, tokens)
    return jnp.mean((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32))


def _next_token_pairs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The logits that predict a next token and the tokens they predict."""
    if tokens.shape[1] == logits.shape[1] + 1:
        return logits, tokens[:, 1:]
    if tokens.shape[1] == logits.shape[1]:
        return logits[:, :-1], tokens[:, 1:]
    raise ValueError(
        f"tokens {tokens.shape} do not pair with logits {logits.shape}: expected the model's "
        "input [batch, S] or a loader window [batch, S + 1]."
    )


def window_inputs(window: jax.Array) -> tuple[jax.Array]:
    """The model's inputs from a loader window [batch, S + 1]: ``(window[:, :-1],)``.

    Pairs with :func:`next_token_loss`, e.g.
    ``pm.train_step(next_token_loss, optimizer, inputs=window_inputs)``.
    """
    return (window[:, :-1],)


def _check_tokens(config: GPTConfig, tokens: jax.Array) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if tokens.shape[1] > config.max_seq_len:
        raise ValueError(
            f"sequence length {tokens.shape[1]} exceeds max_seq_len={config.max_seq_len}; "
            "use shorter sequences or a config with a larger max_seq_len"
        )


# ------------------------------------------------------------------------ linen


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        """[b, s, hidden] -> [b, s, hidden]."""
        c = self.config
        drop = _dropout(c.dropout, deterministic)
        h = make_norm(c.norm, dtype=c.dtype, name="norm_attn")(x)
        x = x + drop(Attention(
            c.num_heads, c.head_dim, causal=True, use_bias=c.use_bias, dtype=c.dtype,
            dropout_rate=c.dropout, name="attn",
        )(h, deterministic=deterministic))
        h = make_norm(c.norm, dtype=c.dtype, name="norm_mlp")(x)
        return x + drop(FeedForward(c.ffn_hidden, use_bias=c.use_bias, dtype=c.dtype, name="mlp")(h))


def _dropout(rate: float, deterministic: bool):
    """``nn.Dropout(rate)`` in train mode with a rate; otherwise the identity (no module)."""
    if deterministic or not rate:
        return lambda x: x
    return lambda x: nn.Dropout(rate, deterministic=False)(x)


class GPT(nn.Module):
    """Decoder-only transformer: int32 tokens [batch, seq] -> logits [batch, seq, vocab]."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool = True) -> jax.Array:
        c = self.config
        _check_tokens(c, tokens)
        embed = nn.Embed(
            c.vocab_size, c.hidden, dtype=c.dtype, embedding_init=EMBED_INIT, name="embed"
        )
        pos_embed = self.param("pos_embed", EMBED_INIT, (c.max_seq_len, c.hidden))
        x = embed(tokens) + pos_embed[: tokens.shape[1]].astype(c.dtype)
        x = _dropout(c.dropout, deterministic)(x)
        for i in range(c.num_layers):
            x = Block(c, name=f"block_{i}")(x, deterministic)
        x = make_norm(c.norm, dtype=c.dtype, name="norm_final")(x)
        if c.tie_embeddings:
            return embed.attend(x)
        return nn.Dense(c.vocab_size, use_bias=False, dtype=c.dtype, name="head")(x)


# -------------------------------------------------------------------------- nnx


class BlockNNX(nnx.Module):
    """nnx twin of :class:`Block`."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = config
        self.norm_attn = make_norm_nnx(c.norm, c.hidden, dtype=c.dtype, rngs=rngs)
        self.attn = AttentionNNX(
            c.hidden, c.num_heads, c.head_dim, causal=True, use_bias=c.use_bias, dtype=c.dtype,
            dropout_rate=c.dropout, rngs=rngs,
        )
        self.norm_mlp = make_norm_nnx(c.norm, c.hidden, dtype=c.dtype, rngs=rngs)
        self.mlp = FeedForwardNNX(
            c.hidden, c.ffn_hidden, use_bias=c.use_bias, dtype=c.dtype, rngs=rngs
        )
        self.drop = _dropout_nnx(c.dropout, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[b, s, hidden] -> [b, s, hidden]."""
        x = x + self.drop(self.attn(self.norm_attn(x)))
        return x + self.drop(self.mlp(self.norm_mlp(x)))


def _dropout_nnx(rate: float, rngs: nnx.Rngs):
    """``nnx.Dropout(rate)`` drawing from the ``'dropout'`` stream, or the identity for 0."""
    return nnx.Dropout(rate, rngs=rngs) if rate else (lambda x: x)


class GPTNNX(nnx.Module):
    """nnx twin of :class:`GPT`: ``GPTNNX(config, rngs=nnx.Rngs(0))(tokens) -> logits``.

    The blocks live in ``self.blocks`` (an ``nnx.List``); everything else has the
    linen name (``embed``, ``pos_embed``, ``norm_final``, ``head``).
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Embed(
            c.vocab_size, c.hidden, dtype=c.dtype, embedding_init=EMBED_INIT, rngs=rngs
        )
        self.pos_embed = nnx.Param(EMBED_INIT(rngs.params(), (c.max_seq_len, c.hidden)))
        self.blocks = nnx.List([BlockNNX(c, rngs=rngs) for _ in range(c.num_layers)])
        self.norm_final = make_norm_nnx(c.norm, c.hidden, dtype=c.dtype, rngs=rngs)
        self.drop = _dropout_nnx(c.dropout, rngs)
        if not c.tie_embeddings:
            self.head = nnx.Linear(c.hidden, c.vocab_size, use_bias=False, dtype=c.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int32 tokens [batch, seq] -> logits [batch, seq, vocab]."""
        c = self.config
        _check_tokens(c, tokens)
        x = self.drop(self.embed(tokens) + self.pos_embed[: tokens.shape[1]].astype(c.dtype))
        for block in self.blocks:
            x = block(x)
        x = self.norm_final(x)
        if c.tie_embeddings:
            return self.embed.attend(x)
        return self.head(x)


def gpt_nnx_from_linen_params(config: GPTConfig, params: Mapping[str, Any]) -> GPTNNX:
    """Builds a :class:`GPTNNX` holding the given :class:`GPT` (linen) parameters.

    ``params`` is the ``"params"`` collection of ``GPT(config).init(...)``. The
    nnx model is created abstractly (no random init), then filled in.
    """
    model = nnx.eval_shape(lambda: GPTNNX(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    params = flax.core.unfreeze(params)
    pure = {name: value for name, value in params.items() if not name.startswith("block_")}
    blocks = sorted(
        (name for name in params if name.startswith("block_")), key=lambda n: int(n[len("block_"):])
    )
    pure["blocks"] = {int(name[len("block_"):]): params[name] for name in blocks}
    expected = jax.tree_util.tree_structure(nnx.to_pure_dict(state))
    got = jax.tree_util.tree_structure(pure)
    if expected != got:
        raise ValueError(
            f"linen params do not match GPTNNX({config}):\nexpected {expected}\ngot      {got}"
        )
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)

"""Reference models written in this repository (used by tests, examples, benchmarks).

Ordinary Flax models, as a user would write them: the partitioner takes them
unmodified.

Example::

    import jax, jax.numpy as jnp
    from axonn_jax.models import GPT, GPTConfig

    model = GPT(GPTConfig(num_layers=2, hidden=64, num_heads=4))
    tokens = jnp.zeros((2, 16), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
"""

from axonn_jax.models.cnn import CNN
from axonn_jax.models.encdec import EncDecConfig, EncoderDecoder
from axonn_jax.models.gpt import (
    GPT,
    GPTNNX,
    GPTConfig,
    gpt_nnx_from_linen_params,
    next_token_accuracy,
    next_token_loss,
    window_inputs,
)
from axonn_jax.models.mlp import MLP, MLPNNX

__all__ = [
    "CNN",
    "EncDecConfig",
    "EncoderDecoder",
    "GPT",
    "GPTConfig",
    "GPTNNX",
    "MLP",
    "MLPNNX",
    "gpt_nnx_from_linen_params",
    "next_token_accuracy",
    "next_token_loss",
    "window_inputs",
]

"""Reference models: shapes, linen ≡ nnx, causality, parameter counts, loss, validation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from axonn_jax.models import (
    CNN,
    GPT,
    GPTNNX,
    MLP,
    MLPNNX,
    EncDecConfig,
    EncoderDecoder,
    GPTConfig,
    gpt_nnx_from_linen_params,
    next_token_loss,
)

VARIANTS = [
    dict(norm="layernorm", tie_embeddings=True, use_bias=True),
    dict(norm="layernorm", tie_embeddings=False, use_bias=True),
    dict(norm="rmsnorm", tie_embeddings=True, use_bias=False),
    dict(norm="rmsnorm", tie_embeddings=False, use_bias=False),
]


def variant_id(v):
    tie = "tied" if v["tie_embeddings"] else "untied"
    return f"{v['norm']}-{tie}-{'bias' if v['use_bias'] else 'nobias'}"


def random_tokens(config, batch=2, seq=16, seed=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq)), jnp.int32)


def random_params(model, *args, seed=0):
    """Parameters of ``model`` filled with numpy noise (skips compiling the RNG-based init)."""
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)["params"])
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(0.2 * rng.standard_normal(a.shape), a.dtype), abstract
    )


def init_gpt(config, tokens):
    return random_params(GPT(config), tokens)


def count(tree):
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


# ------------------------------------------------------------------------ shapes
# Shape checks trace abstractly (jax.eval_shape), so they compile nothing.


def test_gpt_shapes():
    config = GPTConfig()
    tokens = random_tokens(config)
    params = jax.eval_shape(lambda: GPT(config).init(jax.random.key(0), tokens)["params"])
    logits = jax.eval_shape(lambda p, t: GPT(config).apply({"params": p}, t), params, tokens)
    assert logits.shape == (2, 16, config.vocab_size) and logits.dtype == jnp.float32
    nnx_logits = jax.eval_shape(lambda t: GPTNNX(config, rngs=nnx.Rngs(0))(t), tokens)
    assert nnx_logits.shape == (2, 16, config.vocab_size)
    attn = params["block_0"]["attn"]
    h, n, d = config.hidden, config.num_heads, config.head_dim
    assert attn["query"]["kernel"].shape == (h, n, d)
    assert attn["out"]["kernel"].shape == (n, d, h)
    assert params["pos_embed"].shape == (config.max_seq_len, h)


def test_gpt_bf16_compute():
    config = GPTConfig(dtype=jnp.bfloat16)
    tokens = random_tokens(config)
    params = jax.eval_shape(lambda: GPT(config).init(jax.random.key(0), tokens)["params"])
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    logits = jax.eval_shape(lambda p, t: GPT(config).apply({"params": p}, t), params, tokens)
    assert logits.dtype == jnp.bfloat16
    nnx_logits = jax.eval_shape(lambda t: GPTNNX(config, rngs=nnx.Rngs(0))(t), tokens)
    assert nnx_logits.dtype == jnp.bfloat16


def test_mlp_shapes_and_nnx_twin():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16)), jnp.float32)
    model = MLP(features=(32, 24, 10))
    params = random_params(model, x)
    y = model.apply({"params": params}, x)
    assert y.shape == (4, 10)
    twin = nnx.eval_shape(lambda: MLPNNX(16, (32, 24, 10), rngs=nnx.Rngs(0)))
    for i, layer in enumerate(twin.layers):
        layer.kernel = nnx.Param(params[f"dense_{i}"]["kernel"])
        layer.bias = nnx.Param(params[f"dense_{i}"]["bias"])
    np.testing.assert_allclose(twin(x), y, rtol=1e-6, atol=1e-6)


def test_cnn_shapes():
    images = jnp.ones((3, 16, 16, 2))
    model = CNN(channels=(4, 8), num_classes=7)
    params = random_params(model, images)
    assert model.apply({"params": params}, images).shape == (3, 7)
    assert params["conv_0"]["kernel"].shape == (3, 3, 2, 4)
    assert params["head"]["kernel"].shape == (4 * 4 * 8, 7)


def test_encoder_decoder_shapes():
    config = EncDecConfig(vocab_size=100, hidden=32, num_heads=4, max_seq_len=32)
    src = jnp.zeros((2, 12), jnp.int32)
    tgt = jnp.zeros((2, 9), jnp.int32)
    model = EncoderDecoder(config)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), src, tgt)["params"])
    logits = jax.eval_shape(lambda p: model.apply({"params": p}, src, tgt), params)
    assert logits.shape == (2, 9, 100)
    assert params["decoder_0"]["cross_attn"]["key"]["kernel"].shape == (32, 4, 8)


# ---------------------------------------------------------------- linen ≡ nnx


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_gpt_linen_and_nnx_are_the_same_model(variant):
    config = GPTConfig(**variant)
    tokens = random_tokens(config)
    params = init_gpt(config, tokens)
    model = gpt_nnx_from_linen_params(config, params)
    want = GPT(config).apply({"params": params}, tokens)
    np.testing.assert_allclose(model(tokens), want, rtol=1e-6, atol=1e-6)
    assert count(nnx.state(model, nnx.Param)) == count(params)


def test_gpt_linen_and_nnx_trace_the_same_matmuls():
    config = GPTConfig(tie_embeddings=False)
    tokens = random_tokens(config)
    params = init_gpt(config, tokens)
    graphdef, state = nnx.split(gpt_nnx_from_linen_params(config, params))
    linen = jax.make_jaxpr(lambda p, t: GPT(config).apply({"params": p}, t))(params, tokens)
    nnx_ = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)

    def matmuls(closed):
        return [
            tuple(v.aval.shape for v in eqn.invars)
            for eqn in closed.jaxpr.eqns
            if eqn.primitive.name == "dot_general"
        ]

    assert matmuls(linen) == matmuls(nnx_)
    assert len(linen.jaxpr.invars) == len(nnx_.jaxpr.invars)


def test_converter_rejects_mismatched_params():
    config = GPTConfig()
    params = init_gpt(config, random_tokens(config))
    with pytest.raises(ValueError, match="do not match"):
        gpt_nnx_from_linen_params(GPTConfig(num_layers=3), params)


# ------------------------------------------------------------------- causality


@pytest.mark.parametrize("impl", ["linen", "nnx"])
def test_gpt_is_causal(impl):
    config = GPTConfig()
    tokens = random_tokens(config)
    params = init_gpt(config, tokens)
    if impl == "linen":
        forward = lambda t: GPT(config).apply({"params": params}, t)  # noqa: E731
    else:
        forward = gpt_nnx_from_linen_params(config, params)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % config.vocab_size)
    before, after = forward(tokens), forward(changed)
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert not np.allclose(before[:, 10:], after[:, 10:])


def test_encoder_decoder_causal_decoder_full_encoder():
    config = EncDecConfig()  # same sizes as GPTConfig(): reuses the compiled eager ops
    src = random_tokens(config, seed=0)
    tgt = random_tokens(config, seed=1)
    model = EncoderDecoder(config)
    params = random_params(model, src, tgt)
    apply = lambda s, t: model.apply({"params": params}, s, t)  # noqa: E731
    base = apply(src, tgt)
    later_tgt = apply(src, tgt.at[:, 5].set((tgt[:, 5] + 1) % 256))
    np.testing.assert_array_equal(base[:, :5], later_tgt[:, :5])
    assert not np.allclose(base[:, 5:], later_tgt[:, 5:])
    last_src = apply(src.at[:, -1].set((src[:, -1] + 1) % 256), tgt)
    assert not np.allclose(base[:, 0], last_src[:, 0])  # the encoder is not causal


# ---------------------------------------------------------- counts and FLOPs


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        dict(tie_embeddings=False),
        dict(norm="rmsnorm", use_bias=False),
        dict(num_layers=3, hidden=48, num_heads=6, ffn_hidden=100, vocab_size=97, max_seq_len=20),
    ],
)
def test_num_params_is_exact(kwargs):
    config = GPTConfig(**kwargs)
    tokens = random_tokens(config, seq=8)
    abstract = jax.eval_shape(lambda: GPT(config).init(jax.random.key(0), tokens)["params"])
    assert config.num_params() == count(abstract)


def test_flops_per_token_matches_ipdps_formula():
    config = GPTConfig(vocab_size=51200, num_layers=24, hidden=2048, num_heads=16)
    s, h, l, v = 2048, config.hidden, config.num_layers, config.vocab_size
    ipdps = 96 * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert config.flops_per_token(s) == pytest.approx(ipdps / s, rel=1e-12)
    no_recompute = config.flops_per_token(s, activation_recompute=False)
    assert no_recompute < config.flops_per_token(s)


# ------------------------------------------------------------------------ loss


def test_next_token_loss():
    vocab = 256
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (2, 16)), jnp.int32)
    uniform = jnp.zeros((2, 16, vocab))
    assert float(next_token_loss(uniform, tokens)) == pytest.approx(math.log(vocab), rel=1e-6)
    noisy = jnp.asarray(1e-3 * rng.standard_normal((2, 16, vocab)), jnp.float32)
    assert float(next_token_loss(noisy, tokens)) == pytest.approx(math.log(vocab), rel=1e-3)
    # the target of position i is token i + 1
    targets = np.roll(np.asarray(tokens), -1, axis=1)
    perfect = jnp.asarray(100.0 * np.eye(vocab)[targets], jnp.float32)
    assert float(next_token_loss(perfect, tokens)) < 1e-6


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden=64, num_heads=5), "not divisible"),
        (dict(norm="batchnorm"), "norm"),
        (dict(num_layers=0), "num_layers"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(ffn_hidden=0), "ffn_hidden"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)
    with pytest.raises(ValueError, match=message.replace("num_layers", "num_encoder_layers")):
        renamed = {k.replace("num_layers", "num_encoder_layers"): v for k, v in kwargs.items()}
        EncDecConfig(**renamed)


def test_config_defaults():
    config = GPTConfig(hidden=32, num_heads=4)
    assert config.ffn_hidden == 128 and config.head_dim == 8
    assert GPTConfig(ffn_hidden=100).ffn_hidden == 100


def test_sequence_longer_than_max_is_rejected():
    config = GPTConfig(max_seq_len=8)
    tokens = jnp.zeros((1, 9), jnp.int32)
    with pytest.raises(ValueError, match="max_seq_len"):
        jax.eval_shape(lambda: GPT(config).init(jax.random.key(0), tokens))
    with pytest.raises(ValueError, match="max_seq_len"):
        jax.eval_shape(lambda: GPTNNX(config, rngs=nnx.Rngs(0))(tokens))


def test_real_init_starts_near_uniform_loss():
    config = GPTConfig()  # tied embeddings, std 0.02: the first logits are nearly uniform
    tokens = random_tokens(config)

    @jax.jit  # one compiled program: init + forward + loss
    def loss_at_init(tokens):
        return next_token_loss(GPTNNX(config, rngs=nnx.Rngs(0))(tokens), tokens)

    loss = loss_at_init(tokens)
    assert float(loss) == pytest.approx(math.log(config.vocab_size), rel=0.02)

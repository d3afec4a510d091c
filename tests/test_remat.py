"""Remat policies: same gradients, different saved residuals.

GPT (1 layer, hidden 32) partitioned on x=2, z=2, data=2 (8 simulated CPU
devices). Bound: gradients under every policy equal the un-checkpointed ones
bitwise (the same float32 operations run, only their timing differs).
"""

import jax
import numpy as np
import pytest

import axonn_jax
from axonn_jax.models import GPT, GPTConfig, next_token_loss
from axonn_jax.runtime.remat import REMAT_POLICIES, apply_remat, remat_policy


@pytest.fixture(scope="module")
def gpt():
    config = GPTConfig(vocab_size=64, num_layers=1, hidden=32, num_heads=4, max_seq_len=16)
    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 16)).astype(np.int32)
    pm = axonn_jax.partition(GPT(config), axonn_jax.Grid(x=2, z=2, data=2), tokens)
    loss = lambda p, t: next_token_loss(pm.apply(p, t), t)  # noqa: E731
    return loss, pm.init(jax.random.key(0)), tokens


def test_every_policy_gives_identical_gradients(gpt):
    loss, params, tokens = gpt

    @jax.jit
    def all_grads(params, tokens):  # one program, one compile for all policies
        return {name: jax.grad(apply_remat(loss, name))(params, tokens) for name in REMAT_POLICIES}

    grads = all_grads(params, tokens)
    for name in REMAT_POLICIES[1:]:
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                                                err_msg=name),
                     grads[name], grads["none"])  # fmt: skip


def test_policies_save_what_they_say(gpt):
    loss, params, tokens = gpt

    def residuals(name):  # what the backward pass keeps: the leaves of the vjp closure
        closure = lambda p, t: jax.tree.leaves(jax.vjp(apply_remat(loss, name), p, t)[1])  # noqa: E731
        kept = [v.aval for v in jax.make_jaxpr(closure)(params, tokens).jaxpr.outvars]
        inputs = len(jax.tree.leaves((params, tokens)))
        return kept[inputs:] if name != "none" else kept

    none, full, dots, offload = (residuals(n) for n in REMAT_POLICIES)
    assert full == [] and len(none) > len(dots) > 0
    assert [str(a) for a in offload] == [str(a).replace("float32[", "float32<host>[") for a in dots]
    assert not any("host" in str(a) for a in none + dots)


def test_unknown_policy_is_refused():
    assert apply_remat(len, "none") is len
    with pytest.raises(ValueError, match="unknown remat policy 'everything'.*save_dots"):
        remat_policy("everything")


def test_a_model_s_own_checkpoint_names_are_planned_as_the_values_they_name(devices):
    """``checkpoint_name`` with ``nn.remat(policy=save_only_these_names(...))`` (MaxText's remat
    tags): the tagged value keeps its layout (the ``name`` primitive had no rule, so the
    whole block after it ran replicated, with a warning); gradients the plain model's."""
    import flax.linen as nn
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            a = checkpoint_name(nn.Dense(64)(h), "mlp_in")
            return h + nn.Dense(32)(nn.silu(a))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(32)(x)
            policy = jax.checkpoint_policies.save_only_these_names("mlp_in")
            for i in range(2):
                h = nn.remat(Block, policy=policy)(name=f"block{i}")(h)
            return nn.Dense(8)(h)

    x = np.random.default_rng(2).standard_normal((8, 6, 16)).astype(np.float32)
    model = Net()
    params = model.init(jax.random.key(0), x)["params"]
    loss = lambda apply, p: jnp.mean(apply(p, x) ** 2)  # noqa: E731
    want = jax.grad(lambda p: loss(lambda q, a: model.apply({"params": q}, a), p))(params)
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, y=2, z=2), x)
    assert pm.plan.warnings == () and pm.plan.fallbacks == ()
    assert pm.report().compute.redundancy <= 1.05
    got = pm.gather(jax.jit(jax.grad(lambda p: loss(pm.apply, p)))(pm.shard(params)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)

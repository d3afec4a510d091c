"""Shared by the dropout tests in one process and under mpiexec: HF GPT-2 with dropout 0.1.

The plain references: AdamW steps with one dropout key per step, and gradient
accumulation where microbatch ``m`` draws from ``fold_in(key, m)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from partition_cases import BATCH, LR, SEQ, VOCAB, _padding_mask, _positions, _tokens

from axonn_jax.models import next_token_loss

KEY = jax.random.key(42)


def gpt2_with_dropout():
    import transformers as hf
    from transformers.models.gpt2 import modeling_flax_gpt2 as gpt2

    config = hf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                           resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # fmt: skip
    return gpt2.FlaxGPT2LMHeadModule(config), (_tokens(4), _padding_mask(), _positions())


def dropout_loss(out, tokens):
    return next_token_loss(out.logits, tokens)


def dropout_trajectory(apply, params, args, keys):
    """AdamW steps of ``apply(params, *args, rngs)`` with one dropout key per step."""
    optimizer = optax.adamw(LR)

    @jax.jit
    def step(p, s, key):
        loss, grads = jax.value_and_grad(lambda q: dropout_loss(apply(q, *args, {"dropout": key}), args[0]))(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, grads

    p, s, losses, first = params, optimizer.init(params), [], None
    for key in keys:
        p, s, loss, grads = step(p, s, key)
        losses.append(float(loss))
        first = grads if first is None else first
    return losses, first, p


def accumulated_reference(model, params, args, key, microbatches):
    """Plain gradient accumulation: microbatch m draws from fold_in(key, m)."""
    size = BATCH // microbatches

    def loss_of(p, part, k):
        out = model.apply({"params": p}, *part, deterministic=False, rngs={"dropout": k})
        return dropout_loss(out, part[0])

    total_loss, total = 0.0, None
    for mb in range(microbatches):
        part = tuple(a[mb * size : (mb + 1) * size] for a in args)
        k = key if microbatches == 1 else jax.random.fold_in(key, mb)
        loss, grads = jax.value_and_grad(loss_of)(params, part, k)
        total_loss += float(loss)
        total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    return total_loss / microbatches, jax.tree.map(lambda g: np.asarray(g) / microbatches, total)




def plain_dropout_run(steps: int):
    """(model, args, initial params, per-step keys, plain trajectory) of GPT-2 with dropout."""
    model, args = gpt2_with_dropout()
    params = model.init(jax.random.key(0), *args)["params"]

    def plain(p, *a_rngs):
        *a, rngs = a_rngs
        return model.apply({"params": p}, *a, deterministic=False, rngs=rngs)

    keys = [jax.random.fold_in(KEY, t) for t in range(steps)]
    return model, args, jax.tree.map(np.asarray, params), keys, dropout_trajectory(plain, params, args, keys)

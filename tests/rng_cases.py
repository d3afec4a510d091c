"""Shared by the dropout tests in one process and under mpiexec: HF GPT-2 with dropout 0.1.

The plain references: AdamW steps with one dropout key per step, and gradient
accumulation where microbatch ``m`` draws from ``fold_in(key, m)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from partition_cases import BATCH, LR, SEQ, VOCAB, _padding_mask, _positions, _tokens, optimizer_state

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


def dropout_trajectory(apply, params, args, keys, loss_fn=dropout_loss, pm=None):
    """AdamW steps of ``apply(params, *args, rngs)`` with one dropout key per step.

    ``loss_fn(outputs, args[0])``: GPT-2's next-token loss by default.
    """
    optimizer = optax.adamw(LR)

    @jax.jit
    def step(p, s, key):
        loss, grads = jax.value_and_grad(lambda q: loss_fn(apply(q, *args, {"dropout": key}), args[0]))(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, grads

    p, s, losses, first = params, optimizer_state(optimizer, params, pm), [], None
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


# --- BatchNorm on a pipeline --------------------------------------------------------


class DeepBN(nn.Module):
    """Four Dense–BatchNorm blocks: the statistics of both pipeline stages are updated."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        for _ in range(4):
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(32, use_bias=False)(x)))
        return nn.Dense(16)(x)


def _bn_loss(out, batch):
    return jnp.mean((out - batch[1]) ** 2)


def clipped_adamw():
    """A stage-mixing optimizer: the global norm of every stage's gradients clips all of them
    (0.05 is below the gradient norm of every step of these references, so it always clips)."""
    return optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(LR))


def batchnorm_reference(steps: int, microbatches: int, optimizer=None):
    """Plain AdamW (or ``optimizer``) with gradient accumulation; new statistics: the mean of the
    microbatches'."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 16)).astype(np.float32)
    y = rng.standard_normal((16, 16)).astype(np.float32)
    model, optimizer = DeepBN(), optimizer or optax.adamw(LR)
    variables = model.init(jax.random.key(0), x, train=False)
    size = 16 // microbatches

    def step(v, s):
        grads, updates, losses = [], [], []
        for m in range(microbatches):
            part = (x[m * size : (m + 1) * size], y[m * size : (m + 1) * size])

            def loss_of(p, part=part):
                out, upd = model.apply({**v, "params": p}, part[0], mutable=["batch_stats"])
                return _bn_loss(out, part), upd

            (loss, upd), g = jax.value_and_grad(loss_of, has_aux=True)(v["params"])
            grads.append(g), updates.append(upd), losses.append(float(loss))
        g = jax.tree.map(lambda *a: sum(a) / microbatches, *grads)
        norms.append(float(optax.global_norm(g)))
        delta, s = optimizer.update(g, s, v["params"])
        new = {"params": optax.apply_updates(v["params"], delta),
               **jax.tree.map(lambda *a: sum(a) / microbatches, *updates)}  # fmt: skip
        return new, s, float(np.mean(losses))

    v, s, losses, norms = variables, optimizer.init(variables["params"]), [], []
    for _ in range(steps):
        v, s, loss = step(v, s)
        losses.append(loss)
    if steps and min(norms) <= 0.05:
        raise AssertionError(f"gradient norms {norms}: clipped_adamw() would not always clip")
    return x, y, variables, losses, v


def batchnorm_pipeline_failures(grid, microbatches, x, y, variables, ref_losses, ref_final,
                                optimizer=None) -> list:  # fmt: skip
    """Train DeepBN with pm.train_step on ``grid``; what differs from the reference (this rank's leaves)."""
    import axonn_jax
    from axonn_jax.partitioner.trace import path_string

    size = 16 // microbatches
    pm = axonn_jax.partition(DeepBN(), grid, x[:size], mutable=["batch_stats"])
    failures = []
    if not all(any(p.startswith("batch_stats/") for p in st.params) for st in pm.plan.stages):
        failures.append("a stage without BatchNorm statistics: the test would not cover both")
    step = pm.train_step(_bn_loss, optimizer or optax.adamw(LR), inputs=lambda batch: (batch[0],),
                         microbatches=microbatches)  # fmt: skip
    p, s = step.init(pm.shard(variables))
    losses = []
    for _ in ref_losses:
        p, s, loss = step(p, s, (x, y))
        losses.append(float(loss))
    if not np.allclose(losses, ref_losses, rtol=1e-5, atol=0):
        failures.append(f"losses {losses} != {ref_losses}")
    got = {path_string(k): v for k, v in jax.tree_util.tree_leaves_with_path(pm.gather(p))}
    init = {path_string(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(variables)}
    for k, ref in jax.tree_util.tree_leaves_with_path(ref_final):
        path, ref = path_string(k), np.asarray(ref)
        err = np.linalg.norm(got[path] - ref)
        if err > 1e-3 * np.linalg.norm(ref - init[path]) + 1e-6:
            failures.append(f"{path}: {err:.3e}")
    return failures


# --- nnx state: BatchStat and a Dropout stream ----------------------------------------


class NNXNet(nnx.Module):
    """Linear, BatchNorm, Dropout (its own RNG stream), Linear: nnx state in and out."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(16, 32, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.dense(x)))))

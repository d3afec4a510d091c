"""Combined collectives (runtime/param_reads.py): one call for several arrays, same values.

``all_gather_together`` and ``reduce_scatter_together`` must give bitwise the
values, and under ``jax.grad`` the gradients, of one collective per array, and
issue one collective (and one transposed collective) for the whole group.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from axonn_jax import Grid, partition
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.param_reads import all_gather_together, reduce_scatter_together

SHAPES = [(4, 3), (2, 5, 3), (6,)]  # per-device shards, gathered along DIMS
DIMS = [0, 1, 0]


def _mesh(devices) -> Mesh:
    return Mesh(np.asarray(devices[:2]).reshape(2, 1), ("z", "data"))


def _shards():
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.normal(size=(2 * s[0], *s[1:])).astype(np.float32)) for s in SHAPES]


def _grad_of_gathers(gather, devices):
    """(loss, gradients) of a weighted sum of the gathered arrays, and the compiled HLO."""
    weights = [jnp.cos(jnp.arange(np.prod(s) * 2, dtype=jnp.float32)) for s in SHAPES]

    def local(*xs):
        full = gather(list(xs))
        return sum(jnp.sum(f.reshape(-1) * w) for f, w in zip(full, weights))[None]

    f = jax.shard_map(local, mesh=_mesh(devices), in_specs=(P("z"),) * 3, out_specs=P("z"))
    g = jax.jit(jax.value_and_grad(lambda xs: jnp.sum(f(*xs))))
    xs = _shards()
    return g(xs), g.lower(xs).compile().as_text()


def test_all_gather_together_equals_one_gather_per_array(devices):
    (loss, grads), text = _grad_of_gathers(lambda xs: all_gather_together(xs, DIMS, "z"), devices)
    (loss1, grads1), text1 = _grad_of_gathers(
        lambda xs: [lax.all_gather(x, "z", axis=d, tiled=True) for x, d in zip(xs, DIMS)], devices)
    assert np.array_equal(loss, loss1)
    assert all(np.array_equal(a, b) for a, b in zip(grads, grads1))
    assert (text.count(" all-gather("), text.count(" reduce-scatter(")) == (1, 1)
    assert (text1.count(" all-gather("), text1.count(" reduce-scatter(")) == (3, 3)


def test_reduce_scatter_together_equals_one_per_array(devices):
    rng = np.random.default_rng(1)
    xs = [jnp.asarray(rng.normal(size=(4, 6, 3)).astype(np.float32)) for _ in range(3)]
    xs.append(jnp.asarray(rng.normal(size=(4, 6, 2)).astype(np.float32)))  # another shape: its own

    def run(scatter):
        def local(*parts):
            return tuple(scatter([p[0] for p in parts]))

        f = jax.shard_map(local, mesh=_mesh(devices), in_specs=(P("z"),) * 4, out_specs=(P("z"),) * 4)
        stacked = [jnp.stack([x, 2 * x]) for x in xs]  # each device its own partial sums
        g = jax.jit(jax.value_and_grad(lambda s: sum(jnp.sum(jnp.sin(o)) for o in f(*s))))
        return g(stacked), g.lower(stacked).compile().as_text()

    (loss, grads), text = run(lambda ps: reduce_scatter_together(ps, ("z",), 1))
    (loss1, grads1), text1 = run(
        lambda ps: [lax.psum_scatter(p, "z", scatter_dimension=1, tiled=True) for p in ps])
    assert np.array_equal(loss, loss1)
    assert all(np.array_equal(a, b) for a, b in zip(grads, grads1))
    assert (text.count(" reduce-scatter("), text.count(" all-gather(")) == (2, 2)
    assert (text1.count(" reduce-scatter("), text1.count(" all-gather(")) == (4, 4)


def _gpt_step(grid: str, overlap: Overlap):
    """(loss, gradients, compiled HLO) of a 2-block GPT's loss on ``grid``."""
    from axonn_jax.models import GPT, GPTConfig, next_token_loss

    model = GPT(GPTConfig(vocab_size=64, num_layers=2, hidden=64, num_heads=4, max_seq_len=8))
    tokens = jax.random.randint(jax.random.key(1), (8, 8), 0, 64)
    pm = partition(model, Grid.parse(grid), tokens, overlap=overlap)
    params = pm.init(jax.random.key(0))
    step = jax.jit(jax.value_and_grad(lambda p: next_token_loss(pm.apply(p, tokens), tokens)))
    (loss, grads), text = step(params), step.lower(params).compile().as_text()
    return loss, grads, text


@pytest.mark.parametrize("grid", ["x=2,z=2,data=2", "x=2,y=2,z=2"])
def test_block_gathers_equal_layer_gathers(grid, devices):
    """A block's weights in one z all-gather (its gradients in one reduce-scatter): loss and
    every gradient leaf bitwise those of one gather per layer, 3 calls fewer per block each way
    (q/k/v, out, fc_in, fc_out: 4 layers, one gather). One reduce-scatter per block
    (``bucket_blocks=1``; buckets: tests/test_grad_buckets.py)."""
    loss, grads, text = _gpt_step(grid, Overlap(bucket_blocks=1))
    loss1, grads1, text1 = _gpt_step(grid, Overlap(gather_blocks=False))
    assert np.array_equal(loss, loss1)
    leaves, leaves1 = jax.tree.leaves(grads), jax.tree.leaves(grads1)
    assert len(leaves) == len(leaves1) and all(np.array_equal(a, b) for a, b in zip(leaves, leaves1))
    for op in (" all-gather(", " reduce-scatter("):
        assert text1.count(op) - text.count(op) == 2 * 3, op

"""Weight-gradient buckets (runtime/grad_buckets.py): one z reduce-scatter for several gathers.

The sink and routes must give bitwise the gradients of one reduce-scatter per
gather, and issue one reduce-scatter for the bucket; in a GPT the default
buckets (``Overlap.bucket_blocks``) must leave loss and gradients bitwise
those of one reduce-scatter per block, with one call fewer per extra block in
a bucket, and the perf model must count what the compiled program issues.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner.grid import Grid
from axonn_jax.perf import collectives, gpt_spec
from axonn_jax.runtime.grad_buckets import GradBucket
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.param_reads import all_gather_together
from test_param_reads import _gpt_step

SHAPES = [(4, 3), (6,), (2, 5)]  # per-device shards of three gathers (one per "block")


def _mesh(devices) -> Mesh:
    return Mesh(np.asarray(devices[:4]).reshape(2, 2), ("z", "data"))


def _gathers(bucketed: bool, devices):
    """(loss, gradients) of a nonlinear loss of three z all-gathers, and the compiled HLO."""
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.normal(size=(2 * s[0], *s[1:])).astype(np.float32)) for s in SHAPES]
    ws = [jnp.asarray(rng.normal(size=(2 * int(np.prod(s)),)).astype(np.float32)) for s in SHAPES]

    def local(*shards):
        bucket = None
        if bucketed:
            bucket = GradBucket.open({k: x.reshape(1, -1) for k, x in enumerate(shards)}, "z", ("data",))
        total = 0.0
        for k, (x, w) in enumerate(zip(shards, ws)):
            grad_to = bucket.columns([k]) if bucketed else None
            (full,) = all_gather_together([x], [0], "z", vary=("data",), grad_to=grad_to)
            total = total + jnp.sum(jnp.sin(full.reshape(-1) * w))
        return total[None, None]

    f = jax.shard_map(local, mesh=_mesh(devices), in_specs=(P("z"),) * 3, out_specs=P("z", "data"))
    g = jax.jit(jax.value_and_grad(lambda s: jnp.sum(f(*s))))
    return g(xs), g.lower(xs).compile().as_text()


def test_a_bucket_equals_one_reduce_scatter_per_gather(devices):
    (loss, grads), text = _gathers(True, devices)
    (loss1, grads1), text1 = _gathers(False, devices)
    assert np.array_equal(loss, loss1)
    assert all(np.array_equal(a, b) for a, b in zip(grads, grads1))
    assert (text.count(" all-gather("), text.count(" reduce-scatter(")) == (3, 1)
    assert (text1.count(" all-gather("), text1.count(" reduce-scatter(")) == (3, 3)


def test_columns_are_the_members_pieces_in_order():
    bucket = GradBucket({0: jnp.zeros((2, 3)), 1: jnp.ones((2, 2)), 2: 2 * jnp.ones((2, 1))})
    assert np.array_equal(bucket.columns([2, 0]), np.array([[2, 0, 0, 0]] * 2, np.float32))
    assert bucket.columns([1]) is bucket.pieces[1]
    assert bucket.covers([0, 2]) and not bucket.covers([0, 3])


def test_gpt_buckets_equal_one_reduce_scatter_per_block(devices):
    """2 blocks in one bucket (default): loss and every gradient leaf bitwise those of one
    reduce-scatter per block, one reduce-scatter fewer, the gathers unchanged."""
    loss, grads, text = _gpt_step("x=2,z=2,data=2", Overlap())
    loss1, grads1, text1 = _gpt_step("x=2,z=2,data=2", Overlap(bucket_blocks=1))
    assert np.array_equal(loss, loss1)
    leaves, leaves1 = jax.tree.leaves(grads), jax.tree.leaves(grads1)
    assert len(leaves) == len(leaves1) and all(np.array_equal(a, b) for a, b in zip(leaves, leaves1))
    assert text1.count(" reduce-scatter(") - text.count(" reduce-scatter(") == 1
    assert text1.count(" all-gather(") == text.count(" all-gather(")


@pytest.mark.parametrize("bucket, fewer", [(1, 0), (2, 2), (3, 2), (4, 3), (8, 3)])
def test_model_counts_one_reduce_scatter_per_bucket(bucket, fewer):
    """4 blocks: buckets of 2 take 2 calls, of 3 take 2 (3 + 1), of 4 or more take 1."""

    def calls(spec):
        out = collections.Counter()
        for c in collectives(spec, Grid(x=2, z=2, data=2), recompute=False):
            out[c.kind] += c.calls
        return out

    spec = dict(layers=4, hidden=64, heads=4, seq=32, batch=8, vocab=256)
    one, ours = calls(gpt_spec(**spec, bucket_blocks=1)), calls(gpt_spec(**spec, bucket_blocks=bucket))
    assert one["reduce-scatter"] - ours["reduce-scatter"] == fewer
    assert one["all-gather"] == ours["all-gather"]


def test_overlap_parses_the_bucket():
    assert Overlap.parse("all,bucket=2") == Overlap(bucket_blocks=2)
    assert Overlap.parse(str(Overlap(bucket_blocks=1))) == Overlap(bucket_blocks=1)
    assert str(Overlap()) == "oag,ors,oar"
    assert Overlap(reduce_scatter=False).buckets() == 1 == Overlap(gather_blocks=False).buckets()
    with pytest.raises(ValueError, match="bucket_blocks"):
        Overlap(bucket_blocks=0)
    with pytest.raises(ValueError, match="bucket=N"):
        Overlap.parse("all,bucket=two")

"""Random bits drawn block by block: the plain model's bits, at any size, split like their activation.

The runtime draws each device's block of ``random_bits`` from the block's
global row-major indices (partitionable threefry). The index is a 64-bit
number kept as two uint32 words; arrays of 2**32 elements and more (the
attention probabilities of a real model) need the high word. Those sizes are
tested on the index function and on a block of the bits, against a uint64
reference, without materialising the array.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.extend.random import threefry2x32_p
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner import Grid, plan_model
from axonn_jax.partitioner.flops import count
from axonn_jax.partitioner.flows import variable_layouts
from axonn_jax.runtime.executor import relayout
from axonn_jax.runtime.random_bits import block_bits, linear_index, local_bits
from axonn_jax.runtime.varying import vma

import axonn_jax

#: (global shape, block start, block shape): blocks at and beyond 2**32 elements
HUGE = [
    ((2**20, 2**13), (2**19 - 1, 2**13 - 4), (2, 4)),  # straddles 2**32
    ((16, 32, 4096, 4096), (15, 31, 4094, 4090), (1, 1, 2, 6)),  # attention probs, 2**33 elements
    ((128, 16, 2048, 2048), (64, 0, 0, 0), (1, 1, 1, 8)),  # the first elements past 2**32
    ((3, 2**31 + 5, 7), (2, 2**31 + 1, 1), (1, 4, 5)),  # a dim beyond 2**31, 2**34 elements
    ((2**21, 2**21, 8), (2**21 - 1, 2**21 - 2, 0), (1, 2, 8)),  # 2**45 elements
]


def reference_index(shape, start, local) -> np.ndarray:
    """Row-major linear index of each element of the block, in uint64 (NumPy)."""
    coords = np.indices(local, dtype=np.uint64)
    index = np.zeros(local, np.uint64)
    stride = 1
    for d in reversed(range(len(shape))):
        index += (coords[d] + np.uint64(start[d])) * np.uint64(stride)
        stride *= shape[d]
    return index


@pytest.mark.parametrize("shape,start,local", HUGE)
def test_linear_index_beyond_32_bits(shape, start, local):
    hi, lo = linear_index(shape, [np.uint32(s) for s in start], local)
    want = reference_index(shape, start, local)
    assert int(want.max()) >= 2**32
    np.testing.assert_array_equal(np.asarray(hi).astype(np.uint64), want >> np.uint64(32))
    np.testing.assert_array_equal(np.asarray(lo).astype(np.uint64), want & np.uint64(0xFFFFFFFF))


@pytest.mark.parametrize("bit_width", [32, 64])
@pytest.mark.parametrize("shape,start,local", HUGE[:2])
def test_block_of_huge_bits_is_threefry_of_the_uint64_index(shape, start, local, bit_width):
    """The bits of a block of a ≥ 2**32-element array: threefry of (hi, lo) of the true index."""
    key = jax.random.key(7)
    with jax.enable_x64(bit_width == 64):
        got = np.asarray(block_bits(key, bit_width, shape, list(start), local))
    index = reference_index(shape, start, local)
    k1, k2 = jax.random.key_data(key)
    hi = jnp.asarray((index >> np.uint64(32)).astype(np.uint32))
    lo = jnp.asarray((index & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    b1, b2 = (np.asarray(b) for b in threefry2x32_p.bind(k1, k2, hi, lo))
    if bit_width == 32:
        want = b1 ^ b2
    else:
        want = (b1.astype(np.uint64) << np.uint64(32)) | b2.astype(np.uint64)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bit_width", [8, 16, 32, 64])
@pytest.mark.parametrize("shape,blocks", [((4, 6), (2, 3)), ((3, 4, 10), (1, 2, 5))])
def test_every_block_equals_the_plain_bits(shape, blocks, bit_width):
    """Small arrays: each block is the slice of ``jax.random.bits`` (the plain model's bits)."""
    key = jax.random.key(3)
    with jax.enable_x64(bit_width == 64):
        full = np.asarray(jax.random.bits(key, shape, np.dtype(f"uint{bit_width}")))
        local = tuple(s // b for s, b in zip(shape, blocks))
        for block in np.ndindex(*blocks):
            start = [b * n for b, n in zip(block, local)]
            got = np.asarray(block_bits(key, bit_width, shape, start, local))
            want = full[tuple(slice(s, s + n) for s, n in zip(start, local))]
            assert got.dtype == want.dtype == np.dtype(f"uint{bit_width}")
            np.testing.assert_array_equal(got, want, err_msg=str(block))


def test_a_dim_of_2_to_the_32_is_refused():
    with pytest.raises(NotImplementedError, match=r"dim of 4294967296"):
        linear_index((2**32, 2), [np.uint32(0), np.uint32(0)], (1, 2))


class _DenseDropout(nn.Module):
    """Dense → dropout → Dense → dropout broadcast over dim 1 (Flax ``broadcast_dims``)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dropout(0.1, deterministic=False)(nn.Dense(32)(x))
        h = nn.Dense(32)(nn.relu(h))
        return nn.Dropout(0.1, broadcast_dims=(1,), deterministic=False)(h)


@pytest.mark.parametrize("grid", ["x=2,y=2,z=2", "x=4,data=2", "y=2,z=2,data=2"])
def test_bits_are_split_like_the_activation_they_mask(grid):
    """Every split dim of the masked activation splits the bits too (x and y included)."""
    x = jax.ShapeDtypeStruct((8, 4, 16), jnp.float32)
    plan, program = plan_model(_DenseDropout(), Grid.parse(grid), x, rngs={"dropout": jax.random.key(0)})
    assert not plan.warnings, plan.warnings
    # every variable's layout, by the rules the executor runs
    layouts = variable_layouts(program.jaxpr, plan.grid, program.param_storage, program.arg_layouts,
                               scatter_batch=program.scatter_batch,
                               random_layouts=program.random_layouts)  # fmt: skip
    selects = [e for e in program.jaxpr.eqns if e.primitive.name == "select_n"]
    bits = [e.outvars[0] for e in program.jaxpr.eqns if e.primitive.name == "random_bits"]
    assert len(selects) == len(bits) == 2
    for select, var in zip(selects, bits):
        masked = layouts[select.invars[2]]  # select_n(mask, zeros, activation / keep)
        want = tuple(axes if n == m else () for axes, n, m in
                     zip(masked, var.aval.shape, select.outvars[0].aval.shape))  # fmt: skip
        assert layouts[var] == want, (layouts[var], masked)
        assert {"x", "y"} & {a for axes in want for a in axes if plan.grid.axis_size(a) > 1}


def test_random_bits_count_alike_on_both_sides():
    """The FLOP count: one per bit drawn, for the plain random_bits and the runtime's block."""
    key = jax.random.key(0)
    plain = count(jax.make_jaxpr(lambda k: jax.random.bits(k, (8, 64)))(key))
    assert plain.total == 8 * 64
    block = count(jax.make_jaxpr(lambda k: block_bits(k, 32, (8, 64), [0, 16], (8, 16)))(key))
    assert block.total == 8 * 16, block.by_line


def test_a_block_of_bits_is_typed_varying_over_the_axes_that_split_it(devices):
    """Inside ``shard_map`` a device's block is typed varying over its axes (threefry2x32 alone
    types its bits invariant), so regathering the dim is an all-gather, never this block tiled."""
    grid = Grid.parse("z=2,data=4")
    key, layout = jax.random.key(5), (("data", "z"), ())
    mesh = jax.make_mesh((1, 1, 2, 4), ("x", "y", "z", "data"))

    def draw(k):
        block = local_bits(k, 32, (8, 3), layout, grid)
        assert vma(block) == {"data", "z"}, vma(block)
        return relayout(block, layout, ((), ()), grid)

    whole = jax.shard_map(draw, mesh=mesh, in_specs=P(), out_specs=P())(key)
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(jax.random.bits(key, (8, 3))))


#: grids whose batch axes split a batch of 8: all of it, data with z, z beside x and y
BATCH_GRIDS = ["data=8", "z=2,data=4", "x=2,y=2,z=2"]


class _Mixup(nn.Module):
    """Mixup: each example mixed with another of a random permutation of the batch."""

    @nn.compact
    def __call__(self, x):
        perm_key, weight_key = jax.random.split(self.make_rng("mix"))
        perm = jax.random.permutation(perm_key, x.shape[0])
        lam = jax.random.uniform(weight_key, (x.shape[0], 1))
        return nn.Dense(4)(lam * x + (1 - lam) * x[perm]), perm


class _OrderOfBits(nn.Module):
    """Operations needing the whole batch dim of uniform bits: sort, argsort, cumsum, flip."""

    @nn.compact
    def __call__(self, x):
        u = jax.random.uniform(self.make_rng("mix"), (x.shape[0],))
        mixed = nn.Dense(4)(x * jnp.cumsum(u)[:, None])
        return mixed, (jnp.sort(u), jnp.argsort(u), jnp.cumsum(u), u[::-1], jnp.sort(jax.random.bits(
            self.make_rng("mix"), (x.shape[0],))))  # fmt: skip


@pytest.mark.parametrize("grid", BATCH_GRIDS)
@pytest.mark.parametrize("model", [_Mixup(), _OrderOfBits()], ids=["mixup", "sort-cumsum-flip"])
def test_whole_batch_operations_on_random_bits_match_plain(model, grid, devices):
    """A permutation, sort or cumsum of bits split over the batch axes: the plain model's values
    and gradients, the bits still drawn split (each device its block)."""
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    key = jax.random.key(3)
    params = model.init({"params": jax.random.key(0), "mix": key}, x)["params"]

    def loss(out):
        return jnp.mean(jnp.square(out[0] - 1.0))

    def plain(p, k):
        return model.apply({"params": p}, x, rngs={"mix": k})

    pm = axonn_jax.partition(model, Grid.parse(grid), x, rngs={"mix": key})
    assert not pm.plan.warnings, pm.plan.warnings
    _, program = plan_model(model, Grid.parse(grid), x, rngs={"mix": key})
    layouts = variable_layouts(program.jaxpr, pm.plan.grid, program.param_storage, program.arg_layouts,
                               scatter_batch=program.scatter_batch,
                               random_layouts=program.random_layouts)  # fmt: skip
    drawn = [layouts[e.outvars[0]] for e in program.jaxpr.eqns if e.primitive.name == "random_bits"]
    assert drawn and all(any(pm.plan.grid.axis_size(a) > 1 for a in lay[0]) for lay in drawn), drawn

    def part(p, k):
        return pm.apply(p, x, rngs={"mix": k})

    for k in (key, jax.random.key(11)):
        ref, got = plain(params, k), jax.jit(part)(pm.shard(params), k)
        for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
            if np.issubdtype(np.asarray(r).dtype, np.integer):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
            else:
                np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
        ref_grads = jax.grad(lambda p: loss(plain(p, k)))(params)
        got_grads = pm.gather(jax.jit(jax.grad(lambda p: loss(part(p, k))))(pm.shard(params)))
        for r, g in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(got_grads)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)

"""Random bits drawn shard by shard, equal to the plain model's bits.

With JAX's partitionable threefry (``jax_threefry_partitionable``, the
default since JAX 0.5) the bits of ``jax.random.bits(key, shape)`` at global
index ``i`` are ``threefry2x32(key, hi(i), lo(i))`` of the row-major 64-bit
linear index. A device therefore draws exactly its block of the global array
from the block's global indices, and dropout on a partitioned model uses the
very mask of the unpartitioned one. Anything else (another PRNG, the legacy
non-partitionable threefry, batched keys) draws the whole array and slices it:
still exact, at full size.

Example (inside ``shard_map``)::

    bits = local_bits(key, 32, (8, 64), layout=(("data", "z"), ()), grid=grid)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from axonn_jax.partitioner.flops import RANDOM_BITS_CALL
from axonn_jax.partitioner.grid import Grid
from axonn_jax.partitioner.layout import Layout, factor, live, local_shape
from axonn_jax.runtime.shard_index import shard_index
from axonn_jax.runtime.varying import vary, vma

_MASK16 = 0xFFFF


def local_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...], layout: Layout,
               grid: Grid) -> jax.Array:  # fmt: skip
    """This device's block (``layout`` of the global ``shape``) of ``random_bits(key)``."""
    if not _blockwise(key):
        full = jax.random.bits(key, shape, np.dtype(f"uint{bit_width}"))
        return _slice(full, layout, grid)
    local = local_shape(shape, layout, grid)
    return block_bits(key, bit_width, shape, _offsets(shape, layout, grid), local)


def block_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...], offsets,
               local: tuple[int, ...]) -> jax.Array:  # fmt: skip
    """The block of ``random_bits(key, bit_width, shape)`` at ``offsets`` (per dim) of shape ``local``.

    ``key``: a scalar partitionable-threefry key. Runs as one call named
    :data:`~axonn_jax.partitioner.flops.RANDOM_BITS_CALL`, which the FLOP count
    counts as the bits it draws (as it counts the plain model's ``random_bits``).

    Example:
        >>> key = jax.random.key(0)
        >>> block = block_bits(key, 32, (4, 6), [np.uint32(2), np.uint32(3)], (2, 3))
        >>> bool((block == jax.random.bits(key, (4, 6))[2:, 3:]).all())
        True
    """
    dtype = np.dtype(f"uint{bit_width}")

    def block(key, offsets):
        hi, lo = linear_index(shape, offsets, local)
        k1, k2 = jax.random.key_data(key)
        bits1, bits2 = threefry2x32_p.bind(k1, k2, hi, lo)
        # threefry2x32's abstract eval drops its operands' varying axes: typed invariant,
        # the block would pass for one identical on every device, and a relayout
        # regathering the dim (sort, cumsum, rev need it whole) tiles this block
        varying = vma(k1) | vma(k2) | vma(hi) | vma(lo)
        bits1, bits2 = vary(bits1, varying), vary(bits2, varying)
        if bit_width == 64:
            return lax.shift_left(bits1.astype(dtype), dtype.type(32)) | bits2.astype(dtype)
        return (bits1 ^ bits2).astype(dtype)

    block.__name__ = RANDOM_BITS_CALL
    return jax.jit(block)(key, [jnp.asarray(o, jnp.uint32) for o in offsets])


def _blockwise(key: jax.Array) -> bool:
    impl = str(jax.random.key_impl(key)) if jnp.ndim(key) == 0 else ""
    return "threefry2x32" in impl and bool(jax.config.jax_threefry_partitionable)


def _offsets(shape, layout: Layout, grid: Grid) -> list:
    """Global start of this device's block in each dim (traced: uses ``axis_index``)."""
    offsets = []
    for size, axes in zip(shape, live(layout, grid)):
        block = size // factor(axes, grid)
        offsets.append(jnp.uint32(0) if not axes else (shard_index(axes, grid) * block).astype(jnp.uint32))
    return offsets


def linear_index(shape, offsets, local) -> tuple[jax.Array, jax.Array]:
    """Row-major global linear index of every element of a block, as uint32 ``(hi, lo)``.

    ``offsets``: the block's global start in each dim (uint32); ``local``: its
    shape. The index is exact up to ``2**64`` elements (the high word carries
    everything from ``2**32`` on: attention probabilities of a real model pass it).

    Example:
        >>> hi, lo = linear_index((2**20, 2**13), [np.uint32(2**19), np.uint32(0)], (1, 2))
        >>> int(hi[0, 1]), int(lo[0, 1])
        (1, 1)
    """
    if math.prod(shape) >= 2**64:
        raise NotImplementedError(f"random bits of {math.prod(shape)} elements (≥ 2**64)")
    if any(size >= 2**32 for size in shape):
        raise NotImplementedError(
            f"random bits of shape {tuple(shape)}: a dim of {max(shape)} elements (≥ 2**32) has "
            "coordinates beyond uint32. Remedy: draw them in a shape whose dims are below 2**32 "
            "and reshape."
        )
    # dim by dim: the index of the leading dims so far (shape local[:d]) plus this dim's
    # term, multiplied on its own coordinates (1-D): one 64-bit add per element in all
    hi = lo = jnp.zeros((), jnp.uint32)
    for d in range(len(shape)):
        coord = lax.iota(jnp.uint32, local[d]) + jnp.asarray(offsets[d], jnp.uint32)
        t_hi, t_lo = _mul(coord, math.prod(shape[d + 1 :]))
        hi, lo = _add(hi[..., None], lo[..., None], t_hi, t_lo)
    return hi, lo


def _mul(a: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """``a * c mod 2**64`` as (hi, lo) uint32, for uint32 ``a`` and a Python int ``c``."""
    c_hi, c_lo = (c >> 32) & 0xFFFFFFFF, c & 0xFFFFFFFF
    a_lo, a_hi = a & _MASK16, a >> 16
    l_lo, l_hi = np.uint32(c_lo & _MASK16), np.uint32(c_lo >> 16)
    ll, lh, hl, hh = a_lo * l_lo, a_lo * l_hi, a_hi * l_lo, a_hi * l_hi
    mid = lh + hl
    mid_carry = (mid < lh).astype(jnp.uint32)
    lo = ll + (mid << 16)
    lo_carry = (lo < ll).astype(jnp.uint32)
    hi = hh + (mid >> 16) + (mid_carry << 16) + lo_carry + a * np.uint32(c_hi)
    return hi, lo


def _add(h1, l1, h2, l2) -> tuple[jax.Array, jax.Array]:
    lo = l1 + l2
    return h1 + h2 + (lo < l1).astype(jnp.uint32), lo


def _slice(full: jax.Array, layout: Layout, grid: Grid) -> jax.Array:
    local = local_shape(full.shape, layout, grid)
    return lax.dynamic_slice(full, _offsets(full.shape, layout, grid), local)

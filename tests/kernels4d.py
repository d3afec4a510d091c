"""The 4D tensor-parallel layer kernels (the AxoNN SC'24 4D algorithm), for use inside ``shard_map``.

Every function here runs on *local shards* inside a ``jax.shard_map`` over a
stage mesh with axes ``(data, z, y, x)`` and ``check_vma=True``. The forward
collectives are written out explicitly; the backward ones follow from JAX's
autodiff with varying-manual-axes typing, which yields exactly the algorithm:

=====================  ==========================  ==============================
forward                backward (derived)          why
=====================  ==========================  ==============================
``all_gather`` over z  ``psum_scatter`` over z     transpose of a tiled all-gather
``psum`` over y        (none)                      transpose of psum is identity
input unvarying in x   ``psum`` over x of dI       implicit pvary → psum
weight unvarying in    ``psum`` over data of the   explicit ``pcast(data)`` *before*
data                   z-shard of dW               the gather, so the data
                                                   all-reduce moves k·n/(xyz)
=====================  ==========================  ==============================

A layer is *normal* (input features over y, output features over x) or
*transposed* (x and y swapped); alternating them along the data flow means
one layer's output layout is the next one's input layout.

Parameters that are not matmul weights (biases, norm scales) are sharded like
the activation feature dim they touch and replicated elsewhere; because they
are unvarying over ``data`` and ``z`` while the activations vary, autodiff sums
their gradients over every group holding a different batch shard.

Example (one normal layer on a 2×2×2 grid)::

    mesh = stage_meshes(Grid(x=2, y=2, z=2))[0]
    f = jax.shard_map(lambda a, w: linear(a, w), mesh=mesh,
                      in_specs=(activation_spec(2, Y), weight_spec(2)),
                      out_specs=activation_spec(2, X))
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from axonn_jax.partitioner.grid import DATA, X, Z
from kernel_specs import layer_axes

AxisNames = str | tuple[str, ...]


def gather_depth(shard: jax.Array, *, dim: int) -> jax.Array:
    """All-gather a depth(z)-sharded parameter along ``dim`` (FSDP-style).

    The parameter is first marked varying over ``data`` so that, in backward,
    the gradient is reduce-scattered over ``z`` *before* it is all-reduced over
    ``data`` (the cheaper order of the SC'24 paper's eq. 5).
    """
    shard = lax.pcast(shard, DATA, to="varying")
    return lax.all_gather(shard, Z, axis=dim, tiled=True)


def contract(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: tuple,
    *,
    reduce_axes: AxisNames | Sequence[str] = (),
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """Local ``dot_general`` followed by an all-reduce over the contracted axes.

    ``reduce_axes`` are the mesh axes that shard the contracting dimensions (both
    operands must be sharded identically there).
    """
    out = lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    reduce_axes = (reduce_axes,) if isinstance(reduce_axes, str) else tuple(reduce_axes)
    return lax.psum(out, reduce_axes) if reduce_axes else out


def linear(
    inputs: jax.Array,
    weight_shard: jax.Array,
    *,
    transposed: bool = False,
    contracting: int = 1,
    depth_dim: int = 0,
    precision=None,
) -> jax.Array:
    """One 4D fully connected layer: ``inputs[..., K] · W[K, N]``.

    The last ``contracting`` dims of ``inputs`` contract with the first
    ``contracting`` dims of the weight (``DenseGeneral``-style kernels such as
    attention projections ``(H, heads, head_dim)`` or ``(heads, head_dim, H)``
    are covered). Layout, for a normal layer (swap x and y when ``transposed``):
    inputs ``[(data, z), ..., y]``, weight ``[(y, z), x, ...]`` with z on
    ``depth_dim``, output ``[(data, z), ..., x, ...]``.
    """
    in_axis, _ = layer_axes(transposed)
    weight = gather_depth(weight_shard, dim=depth_dim)
    lhs_dims = tuple(range(inputs.ndim - contracting, inputs.ndim))
    rhs_dims = tuple(range(contracting))
    return contract(
        inputs,
        weight,
        ((lhs_dims, rhs_dims), ((), ())),
        reduce_axes=in_axis,
        precision=precision,
    )


def add_bias(outputs: jax.Array, bias: jax.Array) -> jax.Array:
    """Add a bias sharded like the output's feature dim (gradients reduced by autodiff)."""
    return outputs + bias


def embed(ids: jax.Array, table_shard: jax.Array, *, vocab_axis: str | None = X) -> jax.Array:
    """Embedding lookup with the table ``[V, H]`` sharded ``[(vocab_axis, z), y]``.

    Each device looks up the ids that fall in its vocabulary slice (zeros
    elsewhere) and the slices are summed over ``vocab_axis``; the output
    ``[(data, z), ..., y]`` is the input layout of a normal layer. With
    ``vocab_axis=None`` the vocabulary is only depth-sharded.
    """
    table = gather_depth(table_shard, dim=0)
    if vocab_axis is None:
        return jnp.take(table, ids, axis=0)
    rows = table.shape[0]
    local = ids - lax.axis_index(vocab_axis) * rows
    hit = (local >= 0) & (local < rows)
    looked_up = jnp.take(table, jnp.where(hit, local, 0), axis=0)
    return lax.psum(jnp.where(hit[..., None], looked_up, 0), vocab_axis)


def feature_sum(values: jax.Array, *, axis: str | None) -> jax.Array:
    """Sum over the (sharded) last dim, keeping it as size 1."""
    total = jnp.sum(values, axis=-1, keepdims=True)
    return lax.psum(total, axis) if axis else total


def layer_norm(
    inputs: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    *,
    feature_axis: str | None,
    features: int,
    epsilon: float = 1e-6,
) -> jax.Array:
    """LayerNorm over a last dim sharded on ``feature_axis`` (``features`` = full size)."""
    mean = feature_sum(inputs, axis=feature_axis) / features
    centred = inputs - mean
    var = feature_sum(centred * centred, axis=feature_axis) / features
    out = centred * lax.rsqrt(var + epsilon)
    if scale is not None:
        out = out * scale
    if bias is not None:
        out = out + bias
    return out


def rms_norm(
    inputs: jax.Array,
    scale: jax.Array | None,
    *,
    feature_axis: str | None,
    features: int,
    epsilon: float = 1e-6,
) -> jax.Array:
    """RMSNorm over a last dim sharded on ``feature_axis``."""
    mean_square = feature_sum(inputs * inputs, axis=feature_axis) / features
    out = inputs * lax.rsqrt(mean_square + epsilon)
    return out * scale if scale is not None else out

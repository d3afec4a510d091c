"""PartitionSpecs of the 4D algorithm (AxoNN SC'24); pure, needs no devices.

Example:
    >>> weight_spec(2)                    # normal layer W[K, N]
    PartitionSpec(('y', 'z'), 'x')
    >>> weight_spec(2, transposed=True)
    PartitionSpec(('x', 'z'), 'y')
    >>> activation_spec(3, {-1: 'y'})     # [batch, seq, hidden]
    PartitionSpec(('data', 'z'), None, 'y')
"""

from __future__ import annotations

from collections.abc import Mapping

from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner.grid import BATCH_AXES, X, Y, Z


def layer_axes(transposed: bool) -> tuple[str, str]:
    """``(input-feature axis, output-feature axis)``: (y, x), or (x, y) when transposed."""
    return (X, Y) if transposed else (Y, X)


def weight_spec(
    ndim: int, *, transposed: bool = False, contracting: int = 1, depth_dim: int = 0
) -> P:
    """Spec of a matmul weight whose first ``contracting`` dims contract with the input.

    The first contracting dim is split over the layer's input axis, the first
    output dim over its output axis, and ``depth_dim`` additionally over z
    (z minor, so gathering z rebuilds the (y, x) block).
    """
    if not 0 < contracting < ndim:
        raise ValueError(f"a weight of rank {ndim} cannot contract {contracting} dims")
    in_axis, out_axis = layer_axes(transposed)
    dims: list[tuple[str, ...]] = [()] * ndim
    dims[0] = (in_axis,)
    dims[contracting] = (out_axis,)
    dims[depth_dim] = dims[depth_dim] + (Z,)
    return P(*(_entry(d) for d in dims))


def activation_spec(ndim: int, features: Mapping[int, str] | None = None) -> P:
    """Spec of an activation: dim 0 (batch) over (data, z), ``features`` {dim: axis}."""
    dims: list[str | tuple[str, ...] | None] = [None] * ndim
    dims[0] = BATCH_AXES
    for dim, axis in (features or {}).items():
        dims[dim] = axis
    return P(*dims)


def embedding_spec(*, vocab_axis: str | None = X) -> P:
    """Spec of an embedding table [V, H]: vocab over (vocab_axis, z), hidden over y."""
    return P((vocab_axis, Z) if vocab_axis else Z, Y)


def _entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes

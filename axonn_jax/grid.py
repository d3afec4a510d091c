"""Deprecated path: moved to :mod:`axonn_jax.partitioner.grid`."""

from axonn_jax._moved import forward

__getattr__ = forward(__name__, "axonn_jax.partitioner.grid")

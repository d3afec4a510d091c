"""Deprecated path: moved to :mod:`axonn_jax.runtime.memory`."""

from axonn_jax._moved import forward

__getattr__ = forward(__name__, "axonn_jax.runtime.memory")

"""Deprecated path: the performance model's face is :mod:`axonn_jax.perf`."""

from axonn_jax._moved import forward

__getattr__ = forward(__name__, "axonn_jax.perf")

"""The SC'24 communication model of one fully connected layer, exactly as published. Pure.

For a layer ``O[m, n] = I[m, k] · W[k, n]`` on a ``Gx × Gy × Gz × Gdata``
grid (m = rows of the input per data-parallel replica), the paper's
equations (1)–(5) give each collective's time as a number of elements times
``1/β`` of the group it runs on:

====  ===========  ==============================================
eq.   key          elements (what 1/β multiplies)
====  ===========  ==============================================
(1)   ``ag_z``     (Gz − 1) · k·n / (Gx·Gy·Gz)
(2)   ``rs_z``     ((Gz − 1)/Gz) · k·n / (Gx·Gy)
(3)   ``ar_y``     2 · ((Gy − 1)/Gy) · m·n / (Gz·Gx)
(4)   ``ar_x``     2 · ((Gx − 1)/Gx) · m·k / (Gz·Gy)
(5)   ``ar_data``  2 · ((Gdata − 1)/Gdata) · k·n / (Gx·Gy·Gz)
====  ===========  ==============================================

A transposed layer swaps Gx and Gy; the keys name the equations, so for a
transposed layer ``ar_y`` (eq. 3, the forward all-reduce over the layer's
input axis) runs over x and ``ar_x`` (eq. 4) over y. This is the paper's model, not what this
framework's kernels send (see :mod:`axonn_jax.perf.comm`, which adds the
re-gather under recompute, the non-matmul parameters and the norms).

Example:
    >>> v = layer_volumes(1024, 512, 256, x=2, y=2, z=2, data=2)
    >>> v["ag_z"], v["ar_y"]
    (16384.0, 65536.0)
"""

from __future__ import annotations

#: Keys of :func:`layer_volumes`, in the order of the paper's equations (1)–(5).
VOLUME_KEYS = ("ag_z", "rs_z", "ar_y", "ar_x", "ar_data")


def layer_volumes(
    m: int, k: int, n: int, *, x: int, y: int, z: int, data: int, transposed: bool = False
) -> dict[str, float]:
    """Elements per GPU of eqs (1)–(5) of SC'24 for one layer (see module docstring).

    Args:
        m: rows of the layer's input per data-parallel replica (tokens / data).
        k, n: the weight is k × n.
        x, y, z, data: grid sizes.
        transposed: the layer's roles of x and y are swapped.
    """
    for key, value in dict(m=m, k=k, n=n, x=x, y=y, z=z, data=data).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"layer_volumes: {key} must be a positive int, got {value!r}")
    if transposed:
        x, y = y, x
    return {
        "ag_z": (z - 1) * k * n / (x * y * z),
        "rs_z": ((z - 1) / z) * k * n / (x * y),
        "ar_y": 2 * ((y - 1) / y) * m * n / (z * x),
        "ar_x": 2 * ((x - 1) / x) * m * k / (z * y),
        "ar_data": 2 * ((data - 1) / data) * k * n / (x * y * z),
    }

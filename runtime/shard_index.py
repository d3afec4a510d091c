"""Which block of a split dim this device holds (traced: uses ``lax.axis_index``).

Example (inside ``shard_map`` over a mesh with axes ``x`` and ``y``)::

    block = shard_index(("x", "y"), grid)   # x-major: x_index * y + y_index
"""

from __future__ import annotations

import jax
from jax import lax

from axonn_jax.partitioner.grid import Grid


def shard_index(axes: tuple[str, ...], grid: Grid) -> jax.Array | int:
    """Index of this device's block of a dim split over ``axes`` (major first); 0 if unsplit."""
    index = 0
    for axis in axes:
        if grid.axis_size(axis) > 1:
            index = index * grid.axis_size(axis) + lax.axis_index(axis)
    return index

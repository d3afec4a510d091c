"""Small deterministic pytrees for checkpoint tests (shared with tests/scripts/)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def values(step: int) -> dict:
    """Host values that differ per step."""
    return {
        "w": (np.arange(64, dtype=np.float32).reshape(8, 8) + 0.25) * step,
        "b": {"v": np.arange(8, dtype=np.float32) - step},
        "n": np.int32(step),
    }


def shardings(devices, axes=("z", "y", "x"), shape=(2, 2, 2)) -> dict:
    """A layout for :func:`values` on a mesh of ``devices``."""
    mesh = Mesh(np.asarray(devices).reshape(shape), axes)
    return {
        "w": NamedSharding(mesh, P(axes[:2], axes[2])),
        "b": {"v": NamedSharding(mesh, P(axes[2]))},
        "n": NamedSharding(mesh, P()),
    }


def place(host: dict, layout: dict) -> dict:
    return jax.tree.map(lambda v, s: jax.device_put(np.asarray(v), s), host, layout)

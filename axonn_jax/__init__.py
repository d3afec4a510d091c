"""axonn_jax: AxoNN's 4D hybrid parallelism for JAX and Flax.

Public names are re-exported here; everything else is internal. Importing has
no side effects: the engine (:mod:`axonn_jax.runtime`) is loaded on first use,
and under ``mpiexec`` JAX joins the other processes at the first device use
or at :func:`init`.

Example:
    >>> import axonn_jax
    >>> grid = axonn_jax.Grid(x=2, z=2, data=2)
    >>> grid.size
    8
"""

from __future__ import annotations

import importlib
from typing import Any

from axonn_jax.partitioner.grid import Grid
from axonn_jax.partitioner.plan import Plan

__version__ = "0.1.0"

#: public name → module that defines it (imported when the name is first used)
_LAZY = {
    "Partitioned": "axonn_jax.partitioned",
    "partition": "axonn_jax.partitioned",
    "ProcessInfo": "axonn_jax.runtime.launch",
    "init": "axonn_jax.runtime.launch",
    "process_info": "axonn_jax.runtime.launch",
    "Overlap": "axonn_jax.runtime.overlap",
    "build_mesh": "axonn_jax.runtime.mesh",
    "stage_meshes": "axonn_jax.runtime.mesh",
    "MasterOptimizer": "axonn_jax.runtime.master_optimizer",
    "Precision": "axonn_jax.runtime.precision",
    "LossScale": "axonn_jax.runtime.precision",
    "as_planned": "axonn_jax.runtime.precision",
    "apply_remat": "axonn_jax.runtime.remat",
}

__all__ = ["Grid", "Plan", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'axonn_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

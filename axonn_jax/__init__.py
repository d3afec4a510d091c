"""axonn_jax: AxoNN's 4D hybrid parallelism for JAX and Flax.

Public names are re-exported here; everything else is internal.

Example:
    >>> import axonn_jax
    >>> grid = axonn_jax.Grid(x=2, z=2, data=2)
    >>> grid.size
    8
"""

from axonn_jax.grid import Grid
from axonn_jax.partitioned import Partitioned, partition
from axonn_jax.partitioner.plan import Plan
from axonn_jax.runtime.launch import ProcessInfo, init, process_info
from axonn_jax.runtime.overlap import Overlap

__all__ = ["Grid", "Overlap", "Partitioned", "Plan", "ProcessInfo", "init", "partition", "process_info"]
__version__ = "0.1.0"

from axonn_jax.runtime import launch as _launch

_launch.auto_init()
del _launch

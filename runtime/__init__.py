"""The runtime: everything that touches devices or MPI.

Launch and meshes, the 4D executor and its ``shard_map``, the pipeline
(:mod:`axonn_jax.runtime.pipeline`), offload, precision and loss scaling, remat,
the cross-rank consistency check, measured memory and checkpoint storage. It
receives the partitioner's :class:`~axonn_jax.partitioner.program.Program`;
it never imports the face (:mod:`axonn_jax.partitioned` and friends).
"""

from axonn_jax.runtime.compilation_cache import install as _guard_compilation_cache

# JAX's persistent cache must not reload XLA:CPU programs whose collectives lose their order
_guard_compilation_cache()

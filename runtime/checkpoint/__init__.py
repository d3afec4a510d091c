"""Checkpoints: orbax's standard layout, asynchronous, atomic, per-process shards, any grid.

User documentation: :mod:`axonn_jax.checkpoint` (the face re-exports this
package's public names). One concept per module:

* :mod:`.checkpointer`: :class:`Checkpointer` (save, restore, list, wait, close);
* :mod:`.targets`: restore targets checked against what a step holds;
* :mod:`.handler`: the orbax handler writing pytrees in orbax's standard
  layout, shard by shard; :mod:`.shard_store`: checksummed Zarr shards;
* :mod:`.writer_lock`: one writer per directory (a collective on open);
* :mod:`.lifetime`: pending saves finished at exit, failed ones end the process;
* :mod:`.shortcuts`: ``save`` / ``wait`` / ``close`` / ``restore`` /
  ``latest_step`` by directory.

Example::

    from axonn_jax.runtime.checkpoint import Checkpointer

    with Checkpointer("runs/ckpt") as ckpt:
        ckpt.save(step, params, opt_state)
"""

try:
    import orbax.checkpoint  # noqa: F401 - an optional dependency: say how to get it
except ImportError as err:
    raise ImportError(
        "axonn_jax.checkpoint needs orbax-checkpoint. Remedy: pip install 'axonn_jax[extras]' "
        "(or pip install orbax-checkpoint)."
    ) from err

from axonn_jax.runtime.checkpoint.checkpointer import CheckpointError, Checkpointer, Restored
from axonn_jax.runtime.checkpoint.shortcuts import close, latest_step, restore, save, wait
from axonn_jax.runtime.checkpoint.writer_lock import WriterLockError

__all__ = ["CheckpointError", "Checkpointer", "Restored", "WriterLockError", "close", "latest_step",
           "restore", "save", "wait"]

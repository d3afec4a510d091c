"""Checkpoints: orbax's standard layout, asynchronous, atomic, per-process shards, any grid.

A checkpoint step holds the items ``params``, ``opt_state`` and ``rng`` in
the layout of orbax's ``StandardCheckpointHandler`` (each leaf one global
logical Zarr array named by its keys, ``_METADATA`` as the tree index), and
``meta`` (JSON: step, ``extra``). Plain orbax reads them without axonn_jax::

    ocp.StandardCheckpointer().restore(f"runs/ckpt/{step}/params", target)

Since values are stored whole, not per grid, :meth:`Checkpointer.restore`
places them onto whatever shardings you give (another grid, another process
count, pipeline stages or not, offloaded or not). Orbax's ``CheckpointManager``
runs the save in a background thread and renames the step's temporary
directory only after every process has finished, so a save killed midway
never shows up as a step and never touches earlier ones. Chunks are CRC-32C
checked; a truncated or corrupted checkpoint raises :class:`CheckpointError`
naming the step and the steps that remain. Metadata is JSON; nothing is
unpickled.

Every call is collective: run it on every process of the job. A second
writer of one directory is refused (:class:`WriterLockError`).

Example::

    from axonn_jax.checkpoint import Checkpointer

    with Checkpointer("runs/ckpt", max_to_keep=3) as ckpt:   # close() finishes the last save
        ckpt.save(step, params, opt_state, extra={"loader": loader.state()})   # returns at once
        ...
        r = ckpt.restore(params=pm.param_structs, optimizer=optimizer)    # latest step, any grid
    params, opt_state = r.params, r.opt_state
    loader = Loader.from_state(tokens, r.extra["loader"], mesh=pm.mesh)

Leaves held by another process (pipeline stages elsewhere) are ``None`` in
what you save and in the restore targets, and come back as ``None``; processes
may pass different trees (e.g. ``{stage: optimizer state}`` of their own
stages): the checkpoint holds the union, and a path no process holds is saved
empty.
"""

from axonn_jax.runtime.checkpoint import (
    CheckpointError as CheckpointError,
    Checkpointer as Checkpointer,
    Restored as Restored,
    WriterLockError as WriterLockError,
    close as close,
    latest_step as latest_step,
    restore as restore,
    save as save,
    wait as wait,
)

__all__ = ["CheckpointError", "Checkpointer", "Restored", "WriterLockError", "close", "latest_step",
           "restore", "save", "wait"]

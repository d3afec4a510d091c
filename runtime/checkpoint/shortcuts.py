"""Module-level shortcuts: one writing :class:`Checkpointer` per directory, opened on first use.

Example::

    checkpoint.save("runs/ckpt", step, params, opt_state)   # opens a Checkpointer for the directory
    checkpoint.wait()                                       # finishes every pending save
    r = checkpoint.restore("runs/ckpt", params=pm.param_structs)
    checkpoint.close()                                      # finishes and releases them
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax
import optax

from axonn_jax.runtime.checkpoint.checkpointer import CheckpointError, Checkpointer, Restored

_OPEN: dict[Path, Checkpointer] = {}


def save(directory: str | Path, step: int, params, opt_state=None, extra: Mapping | None = None,
         *, rng: jax.Array | None = None, max_to_keep: int | None = 3) -> Checkpointer:  # fmt: skip
    """Asynchronous :meth:`Checkpointer.save` into ``directory``; :func:`wait` finishes it."""
    path = Path(directory).absolute()
    if path not in _OPEN:
        _OPEN[path] = Checkpointer(path, max_to_keep=max_to_keep)
    _OPEN[path].save(step, params, opt_state, extra, rng=rng)
    return _OPEN[path]


def wait(directory: str | Path | None = None) -> None:
    """Finish the pending saves (of ``directory``, or of every directory)."""
    paths = list(_OPEN) if directory is None else [Path(directory).absolute()]
    for path in paths:
        if path in _OPEN:
            _OPEN[path].wait()


def close(directory: str | Path | None = None) -> None:
    """Finish and release the checkpointers opened by :func:`save` (of ``directory``, or all)."""
    paths = list(_OPEN) if directory is None else [Path(directory).absolute()]
    for path in paths:
        if path in _OPEN:
            _OPEN.pop(path).close()


def restore(directory: str | Path, step: int | None = None, *, params, opt_state=None,
            optimizer: optax.GradientTransformation | None = None) -> Restored:  # fmt: skip
    """:meth:`Checkpointer.restore` from ``directory`` (after its pending save)."""
    return _reader(directory).restore(step, params=params, opt_state=opt_state, optimizer=optimizer)


def latest_step(directory: str | Path) -> int | None:
    """The newest complete step in ``directory`` (``None`` if there is none)."""
    return _reader(directory).latest_step()


def _reader(directory: str | Path) -> Checkpointer:
    path = Path(directory).absolute()
    if path in _OPEN:
        return _OPEN[path]
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist. Remedy: check the path")
    return Checkpointer(path, read_only=True)

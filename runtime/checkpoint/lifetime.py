"""The end of the process: pending saves are finished, failed ones end it with status 1.

Orbax writes a save in background threads; a script may end with one still
running, and the threads of a save that failed wait forever for a signal, so
the interpreter would hang joining them. This module keeps the open writing
:class:`~axonn_jax.runtime.checkpoint.Checkpointer` objects and, when the
interpreter starts shutting down (before it joins threads), finishes their
saves (saying so) and leaves with ``os._exit`` after a failed one: status 1
naming the lost step, or 0 if a later save to that directory committed.

Example (what :class:`~axonn_jax.runtime.checkpoint.Checkpointer` does)::

    lifetime.opened(ckpt)                       # a writer: finished at exit
    lifetime.failed(ckpt.directory, message)    # its save failed: exit 1 unless a later one commits
    lifetime.committed(ckpt.directory)
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from pathlib import Path

_WRITERS: weakref.WeakSet = weakref.WeakSet()  # open writing Checkpointers of this process
# writers with a save in flight, held strongly: ``Checkpointer(d).save(7, p)`` drops the
# object at once, and its save must still be finished here, not lost with it
_PENDING: set = set()
_FAILED_SAVES: dict[Path, str] = {}  # per directory, a failed save no later step made good
_threads_stuck = False  # orbax's threads of a failed save never end


def opened(writer) -> None:
    """``writer`` (a writing Checkpointer) is open: its pending save is finished at exit."""
    _WRITERS.add(writer)


def closed(writer) -> None:
    _WRITERS.discard(writer)
    _PENDING.discard(writer)


def pending(writer) -> None:
    """``writer`` started a save: kept alive (even if the script drops it) until it settles."""
    _PENDING.add(writer)


def settled(writer) -> None:
    """``writer``'s save is committed or failed: nothing of it to finish at exit."""
    _PENDING.discard(writer)


def writing_to(directory: Path) -> bool:
    """Whether an open writer of this process saves into ``directory``."""
    return any(w.directory == directory for w in _WRITERS)


def failed(directory: Path, message: str) -> None:
    """A save into ``directory`` failed: the process will exit 1 (unless a later one commits)."""
    global _threads_stuck
    _FAILED_SAVES[directory] = message
    _threads_stuck = True


def committed(directory: Path) -> None:
    """A later save into ``directory`` committed: nothing is lost there."""
    _FAILED_SAVES.pop(directory, None)


def finish_at_exit() -> None:
    """Commit saves still pending when the script ends (warning), or exit 1 if one failed."""
    from axonn_jax.runtime.checkpoint.checkpointer import CheckpointError

    for ckpt in {*_WRITERS, *_PENDING}:
        step = ckpt.pending_step
        try:
            ckpt.close()
        except CheckpointError:
            continue  # recorded by failed()
        if step is not None:
            print(f"axonn_jax.checkpoint: the script ended with the save of step {step} to "
                  f"{ckpt.directory} pending; it is now complete. Remedy: close the Checkpointer "
                  "(or use `with Checkpointer(...)`) so that saves finish where you expect.",
                  file=sys.stderr, flush=True)  # fmt: skip
    if _FAILED_SAVES:
        print("axonn_jax.checkpoint: exiting with status 1 because a save failed:\n  "
              + "\n  ".join(_FAILED_SAVES.values()), file=sys.stderr, flush=True)  # fmt: skip
    if _threads_stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if _FAILED_SAVES else 0)


# before concurrent.futures refuses new work and before threads are joined
getattr(threading, "_register_atexit", __import__("atexit").register)(finish_at_exit)

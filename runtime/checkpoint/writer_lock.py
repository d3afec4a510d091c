"""One writer per checkpoint directory: a lock file naming the job that writes there.

Two jobs saving into one directory would delete each other's steps (retention)
and race on step numbers. The writer's process 0 creates ``.axonn_jax_writer``
(JSON: host, pid, start time) with ``O_EXCL``; a second writer is refused with
a message naming the first. A lock left by a process that died on this host is
taken over; one from another host cannot be checked, so the message names it
and ``takeover=True`` (e.g. a job resumed on other nodes) replaces it.

Every process of a job opens the writer, so :func:`acquire_for_job` takes
the lock on process 0 and tells every process the outcome (one collective).

Example::

    lock = WriterLock.acquire(Path("runs/ckpt"))      # raises WriterLockError if held
    ...
    lock.release()
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from pathlib import Path

import jax

from axonn_jax.runtime.checkpoint.handler import allgather_json

NAME = ".axonn_jax_writer"


class WriterLockError(RuntimeError):
    """Another live writer holds the directory (the message names it and the remedy)."""


@dataclasses.dataclass
class WriterLock:
    """The lock this process holds on ``directory`` (see the module doc)."""

    file: Path

    @classmethod
    def acquire(cls, directory: Path, *, takeover: bool = False) -> WriterLock:
        """Create the lock file, or raise :class:`WriterLockError` naming its holder."""
        file = directory / NAME
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read(file)
                if takeover or _is_stale(holder):
                    file.unlink(missing_ok=True)
                    continue
                raise WriterLockError(_refusal(directory, file, holder)) from None
            with os.fdopen(fd, "w") as out:
                json.dump(mine, out)
            return cls(file)
        raise WriterLockError(f"could not create {file}: another writer keeps creating it")

    def release(self) -> None:
        """Remove the lock file (only if it is still ours)."""
        holder = _read(self.file)
        if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
            self.file.unlink(missing_ok=True)


def acquire_for_job(directory: Path, *, takeover: bool, writing_here: bool) -> WriterLock | None:
    """Process 0 takes ``directory``'s lock (``None`` elsewhere); every process learns the outcome.

    Collective. ``writing_here``: a writer of this process already saves into
    ``directory`` (then a lock naming this process is not taken over). Raises
    :class:`WriterLockError` on every process when process 0 was refused.
    """
    lock, refusal = None, None
    if jax.process_index() == 0:
        mine_but_closed = held_by_this_process(directory) and not writing_here
        try:
            lock = WriterLock.acquire(directory, takeover=takeover or mine_but_closed)
        except WriterLockError as err:
            refusal = str(err)
    refusal = allgather_json(refusal)[0]
    if refusal is not None:
        raise WriterLockError(refusal)
    return lock


def held_by_this_process(directory: Path) -> bool:
    """Whether the lock on ``directory`` names this process."""
    holder = _read(directory / NAME)
    return holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()


def _read(file: Path) -> dict:
    try:
        doc = json.loads(file.read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}  # being written, or damaged: treated as held by an unknown writer


def _is_stale(holder: dict) -> bool:
    """A lock of a process on this host that is no longer running."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    if holder["pid"] == os.getpid():
        return False  # this process already writes there (another Checkpointer)
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _refusal(directory: Path, file: Path, holder: dict) -> str:
    who = (f"process {holder.get('pid')} on host {holder.get('host')}, since "
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started', 0)))}"
           if holder else "an unknown process")  # fmt: skip
    same = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
    if same:
        return (f"{directory} already has an open writing Checkpointer in this process. Remedy: "
                "reuse it, or close() it before opening another.")  # fmt: skip
    return (f"another writer saves into {directory} ({who}; lock file {file}). Two writers would "
            "delete each other's steps. Remedy: use another directory, or stop that job; if it is "
            "no longer running (e.g. it ran on other nodes), pass takeover=True or delete the "
            "lock file.")  # fmt: skip

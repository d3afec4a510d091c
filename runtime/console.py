"""What a process of a job writes to its standard output.

Gloo, JAX's CPU collectives across processes, prints one line per process
and collective group from C++ ("[Gloo] Rank 1 is connected to 1 peer ranks.
Expected number of connected peer ranks is : 1"), often in the middle of a
line of the program's own output. :func:`drop_gloo_lines` removes them at
the file-descriptor level, so they are gone whoever writes them;
:func:`silence_stdout` drops a process's whole standard output (ranks other
than 0).

Example::

    drop_gloo_lines()        # axonn_jax.init() does this under mpiexec
    print("step 1/3: compiling…", end=" ")   # a Gloo line written now vanishes
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading

#: one Gloo connection report, with its line end
GLOO_LINE = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of "
                       rb"connected peer ranks is : \d+\r?\n?")  # fmt: skip
_PREFIX = b"[Gloo] "
_FILTERING: list[threading.Thread] = []


def strip_gloo(chunk: bytes) -> tuple[bytes, bytes]:
    """``chunk`` without Gloo's lines: ``(ready to write, held back)``.

    What may be the start of a Gloo line not yet complete is held back (to be
    prefixed to the next chunk); everything else is ready at once, so a
    progress line without a line end still shows.

    >>> strip_gloo(b"compiling... [Gloo] Rank 0 is connected to 1 peer ranks. Expected "
    ...            b"number of connected peer ranks is : 1\\ndone\\n")
    (b'compiling... done\\n', b'')
    >>> strip_gloo(b"step 1 [Glo")
    (b'step 1 ', b'[Glo')
    """
    chunk = GLOO_LINE.sub(b"", chunk)
    start = chunk.rfind(_PREFIX)
    if start >= 0 and b"\n" not in chunk[start:]:  # a report still being written
        return chunk[:start], chunk[start:]
    for size in range(min(len(_PREFIX) - 1, len(chunk)), 0, -1):  # "[Glo" at the very end
        if chunk.endswith(_PREFIX[:size]):
            return chunk[:-size], chunk[-size:]
    return chunk, b""


def drop_gloo_lines() -> None:
    """Route this process's file descriptor 1 through a filter that drops Gloo's lines.

    Idempotent. A thread copies the output to the real standard output until
    the process exits (the filter is undone, and the rest flushed, at exit).
    """
    if _FILTERING or os.environ.get("AXONN_SHOW_GLOO") == "1":
        return
    sys.stdout.flush()
    real, restore = os.dup(1), os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)

    def pump() -> None:
        held = b""
        while True:
            data = os.read(read, 1 << 16)
            if not data:
                break
            ready, held = strip_gloo(held + data)
            if ready:
                os.write(real, ready)
        if held:
            os.write(real, held)
        os.close(read)
        os.close(real)

    thread = threading.Thread(target=pump, name="gloo-filter", daemon=True)
    thread.start()
    _FILTERING.append(thread)

    def finish() -> None:  # closing the pipe's last writer ends the pump
        sys.stdout.flush()
        os.dup2(restore, 1)
        os.close(restore)
        thread.join(timeout=10)

    atexit.register(finish)


def silence_stdout() -> None:
    """Drop everything this process writes to its standard output (errors still reach stderr)."""
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)

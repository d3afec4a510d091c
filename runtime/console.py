"""What a process of a job writes to its standard output.

Gloo, JAX's CPU collectives across processes, prints one line per process
and collective group from C++ ("[Gloo] Rank 1 is connected to 1 peer ranks.
Expected number of connected peer ranks is : 1"), often in the middle of a
line of the program's own output, and its threads interleave the pieces of
their reports. :func:`drop_gloo_lines` gives Python's ``sys.stdout`` a file
descriptor of its own (the real standard output) and routes file descriptor 1
— what C and C++ code writes, Gloo included — through a filter that removes
the reports, so the program's lines never mix with Gloo's pieces;
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
#: the pieces of a report, as they appear when Gloo's threads interleave their writes
GLOO_PIECES = re.compile(rb"\[Gloo\] Rank ?\d*|\s?is connected to ?\d*|\d* ?peer ranks\.\s?|"
                         rb"Expected number of connected peer ranks is : ?\d*")  # fmt: skip
#: what a line that held only reports is left with once its pieces are gone
_LEFTOVER = re.compile(rb"[\d\s.]*")
_FILTERING: list[threading.Thread] = []


def strip_gloo(chunk: bytes) -> tuple[bytes, bytes]:
    """``chunk`` without Gloo's reports: ``(ready to write, held back)``.

    Complete lines are cleaned; a line that held only reports (whole or in the
    interleaved pieces of Gloo's threads) is dropped with its line end. A line
    not yet complete is held back (prefixed to the next chunk): file descriptor
    1 carries only C/C++ output once :func:`drop_gloo_lines` ran, Python's own
    progress lines go straight out.

    >>> strip_gloo(b"compiling... [Gloo] Rank 0 is connected to 1 peer ranks. Expected "
    ...            b"number of connected peer ranks is : 1\\ndone\\n")
    (b'compiling... done\\n', b'')
    >>> strip_gloo(b"[Gloo] Rank 1\\n is connected to 1 peer ranks. Expected number of connected peer "
    ...            b"ranks is : 1\\nlog line\\n[Glo")
    (b'log line\\n', b'[Glo')
    """
    *lines, partial = chunk.split(b"\n")
    return b"".join(_clean_line(line + b"\n") for line in lines), partial


def _clean_line(line: bytes) -> bytes:
    """One line (with its line end) without Gloo's reports; ``b""`` if it held nothing else.

    Once a report was seen, a line of digits alone is a piece of one (the numbers
    of interleaved reports): file descriptor 1 carries only C/C++ output here.
    """
    global _SEEN_REPORT
    if b"Gloo" in line or b"peer ranks" in line or b"is connected to" in line:
        _SEEN_REPORT = True
        kept = GLOO_PIECES.sub(b"", GLOO_LINE.sub(b"", line))
        return b"" if _LEFTOVER.fullmatch(kept) else kept
    return b"" if _SEEN_REPORT and _LEFTOVER.fullmatch(line) else line


_SEEN_REPORT = False


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
    # Python's own output goes straight out, line by line: never mixed with Gloo's pieces
    sys.stdout = open(os.dup(restore), "w", buffering=1, encoding=sys.stdout.encoding,  # noqa: SIM115
                      errors=sys.stdout.errors)  # fmt: skip

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
            os.write(real, _clean_line(held))
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
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python's stdout may have its own descriptor

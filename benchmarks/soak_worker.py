"""Run ``examples/train_gpt.py`` unchanged, logging this process's memory after every step.

Used by ``benchmarks/soak.py`` (one copy per MPI rank). The example is imported
and its ``main`` called; the only hook is a wrapper around the object that
``Partitioned.train_step`` returns, which after each call records

* ``rss_kib``: the process's resident set size (``/proc/self/status`` VmRSS),
* ``live_arrays`` / ``live_bytes``: ``jax.live_arrays()`` and the bytes of their
  shards on this process's devices,

and at exit writes ``<memory-dir>/rank<R>.csv``.

    mpiexec -n 4 python benchmarks/soak_worker.py --memory-dir DIR -- --grid ...
"""

from __future__ import annotations

import csv
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("step", "seconds", "rss_kib", "live_arrays", "live_bytes")


def rss_kib() -> int:
    """Resident set size of this process in KiB (Linux /proc; psutil elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss // 1024


def live_buffers() -> tuple[int, int]:
    """(number of live jax arrays, bytes of their shards on this process's devices)."""
    import jax

    arrays = jax.live_arrays()
    total = 0
    for a in arrays:
        try:
            total += sum(s.data.nbytes for s in a.addressable_shards)
        except Exception:  # noqa: BLE001 - deleted while we looked
            continue
    return len(arrays), total


class LoggedStep:
    """A train step that records memory after each call; everything else is delegated."""

    def __init__(self, step, rows: list[dict]):
        self._step, self._rows, self._t0 = step, rows, time.perf_counter()

    def __call__(self, *args, **kwargs):
        out = self._step(*args, **kwargs)
        import jax

        jax.block_until_ready(out)
        count, nbytes = live_buffers()
        self._rows.append(dict(step=len(self._rows), seconds=round(time.perf_counter() - self._t0, 3),
                               rss_kib=rss_kib(), live_arrays=count, live_bytes=nbytes))  # fmt: skip
        return out

    def __getattr__(self, name):
        return getattr(self._step, name)


def main(argv: list[str]) -> int:
    usage = "usage: soak_worker.py --memory-dir DIR -- <train_gpt.py arguments>"
    if "--" not in argv or argv[:1] != ["--memory-dir"] or len(argv) < 3:
        raise SystemExit(usage)
    memory_dir = Path(argv[1])
    own, example_args = argv[2 : argv.index("--")], argv[argv.index("--") + 1 :]
    if own:
        raise SystemExit(usage)
    from axonn_jax.partitioned import Partitioned

    rows: list[dict] = []
    original = Partitioned.train_step

    def train_step(self, *args, **kwargs):
        return LoggedStep(original(self, *args, **kwargs), rows)

    Partitioned.train_step = train_step
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    status = example.main(example_args)

    import jax

    memory_dir.mkdir(parents=True, exist_ok=True)
    with (memory_dir / f"rank{jax.process_index()}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

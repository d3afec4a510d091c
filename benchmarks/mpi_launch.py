"""Benchmarks that run under ``mpiexec``: relaunch a script on ``n`` ranks and read back
what rank 0 printed on its ``RESULTS <json>`` line.

Example:
    >>> results = relaunch(__file__, 4, argv, "AXONN_BUBBLE_WORKER")   # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "RESULTS "


def rotated(configs: Sequence, rounds: int) -> Iterator:
    """``configs`` ``rounds`` times, each round in an order rotated by one, so that each
    configuration runs in each position (first, after a given other, …) as often.

    >>> list(rotated("abc", 2))
    ['a', 'b', 'c', 'b', 'c', 'a']
    """
    for r in range(rounds):
        for k in range(len(configs)):
            yield configs[(k + r) % len(configs)]


def is_worker(flag: str) -> bool:
    """This process is one of the ranks :func:`relaunch` started (``flag`` set)."""
    return bool(os.environ.get(flag))


def relaunch(script: str, ranks: int, argv: list[str], flag: str, timeout: float, *,
             devices_per_process: int = 1) -> object:
    """Runs ``script argv`` on ``ranks`` processes (``devices_per_process`` simulated CPU
    devices each, ``flag`` set in their environment; ``ranks=1``: one plain process, no
    ``mpiexec``) and returns the JSON rank 0 printed after ``RESULTS``; exits naming the
    output on a failure."""
    sys.path.insert(0, str(ROOT / "tests"))
    from mpi_util import mpiexec

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")  # fmt: skip
    env[flag] = "1"
    command = [sys.executable, script, *argv]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    line = next((l for l in done.stdout.splitlines() if l.startswith(PREFIX)), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"benchmark failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(line[len(PREFIX):])

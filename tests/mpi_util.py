"""Launch a test script under a real ``mpiexec`` from pytest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from xla_flags import xla_flags

TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS / "mpi_scripts"


def mpiexec() -> str:
    """The mpiexec next to this Python (venv's MPICH wheel) or the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found; run `make setup` (installs the MPICH wheel)")
    return found


def run_mpi(
    n: int,
    script: str,
    *args: str,
    devices_per_process: int = 1,
    timeout: float = 300,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run ``mpi_scripts/<script>`` on ``n`` ranks; returns the finished process."""
    full_env = dict(os.environ)
    full_env.update(
        XLA_FLAGS=xla_flags(devices_per_process),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(TESTS), full_env.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
    )
    full_env.update(env or {})
    command = [mpiexec(), "-n", str(n)]
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True)
    if "Open MPI" in version.stdout + version.stderr:
        command += ["--allow-run-as-root", "--oversubscribe"]
    command += [sys.executable, str(SCRIPTS / script), *args]
    return subprocess.run(
        command, env=full_env, capture_output=True, text=True, timeout=timeout, check=False
    )

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
# pytest's timeout of the test now running (set by conftest.py); None outside pytest
PYTEST_TIMEOUT: float | None = None
# what a subprocess must leave to pytest-timeout so that its own timeout fires first
MARGIN_S = 30.0


def subprocess_timeout(requested: float | None, *, default: float = 300) -> float:
    """The timeout of a child process started by the test now running.

    It must end before pytest-timeout kills the test (which loses the child's
    output and names no cause), so a request that does not fit is refused. In a
    test under the default 600 s pytest timeout::

        subprocess_timeout(None)   # 300
        subprocess_timeout(900)    # ValueError: ... Remedy: @pytest.mark.timeout(930) ...

    ``None`` gives ``default``, capped to the test's budget.
    """
    budget = None if not PYTEST_TIMEOUT else PYTEST_TIMEOUT - MARGIN_S
    if requested is None:
        return default if budget is None else min(default, budget)
    if budget is not None and requested > budget:
        raise ValueError(
            f"a subprocess timeout of {requested:g} s does not fit in this test's pytest timeout of "
            f"{PYTEST_TIMEOUT:g} s: pytest-timeout would kill the test first, without the child's "
            f"output. Remedy: @pytest.mark.timeout({int(requested + MARGIN_S)}) on the test, or a "
            f"subprocess timeout of at most {budget:g} s"
        )
    return requested


def mpiexec() -> str:
    """The mpiexec next to this Python (venv's MPICH wheel) or the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found; run `make setup` (installs the MPICH wheel)")
    return found


def mpi_command(n: int, script: str, *args: str, devices_per_process: int = 1,
                env: dict | None = None) -> tuple[list[str], dict]:
    """``(command, environment)`` that runs ``mpi_scripts/<script>`` on ``n`` ranks (what
    :func:`run_mpi` runs; for a test that must signal or watch the job itself)."""
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
    return command, full_env


def run_mpi(
    n: int,
    script: str,
    *args: str,
    devices_per_process: int = 1,
    timeout: float | None = None,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run ``mpi_scripts/<script>`` on ``n`` ranks; returns the finished process.

    ``timeout`` (default 300 s, capped by the test's pytest timeout) must fit in the
    test's pytest timeout (see ``subprocess_timeout``); a job that runs past it fails
    the test with its own message and the tail of what the ranks printed.
    """
    timeout = subprocess_timeout(timeout)
    command, full_env = mpi_command(n, script, *args, devices_per_process=devices_per_process, env=env)
    try:
        return subprocess.run(
            command, env=full_env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        printed = "".join(_text(part) for part in (exc.stdout, exc.stderr))
        raise AssertionError(
            f"mpiexec -n {n} {script} {' '.join(args)} ran past its timeout of {timeout:g} s "
            f"(killed); the last output:\n{printed[-3000:]}"
        ) from None


def _text(part: bytes | str | None) -> str:
    if isinstance(part, bytes):
        return part.decode(errors="replace")
    return part or ""

"""Real multi-process launches: ``mpiexec -n 2`` (2×4 devices) and ``-n 4`` (4×2)."""

import re

import pytest
from conftest import grid_id
from mpi_util import run_mpi

pytestmark = pytest.mark.mpi


def _grid_args(grids):
    return [grid_id(g) for g in grids]


def _check(result, grids, cases=("block", "mlp")):
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    ok = re.findall(r"^OK (\w+) (\S+) ", result.stdout, flags=re.M)
    assert sorted(ok) == sorted((c, g) for c in cases for g in grids), output[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(660)  # the job's own 600 s timeout fires first
def test_kernels_two_processes_every_axis_across_processes():
    """Each axis alone over all 8 devices (so across the 2 processes), then the mixed grids."""
    grids = _grid_args([dict(x=8), dict(y=8), dict(z=8), dict(data=8)]) + [
        "x=2,y=2,z=2", "x=4,z=2", "y=2,z=2,data=2", "x=2,z=2,data=2"]
    result = run_mpi(2, "kernel_equivalence.py", *grids, devices_per_process=4, timeout=600)
    _check(result, grids)


@pytest.mark.timeout(660)
def test_kernels_four_processes():
    grids = ["x=2,y=2,z=2", "x=4,z=2", "y=2,z=2,data=2", "z=8", "data=8"]
    result = run_mpi(4, "kernel_equivalence.py", *grids, devices_per_process=2, timeout=600)
    _check(result, grids)


@pytest.mark.parametrize("n", [2, 4])
def test_failing_rank_aborts_the_whole_job(n):
    """One rank raises while the others wait in a collective: the job ends, no hang."""
    result = run_mpi(n, "fail_on_rank.py", str(n - 1), timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"[axonn_jax rank {n - 1}] uncaught exception" in output
    assert f"deliberate failure on rank {n - 1}" in output
    assert "unexpectedly finished" not in output


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_killed_rank_ends_the_whole_job(n):
    """One rank is SIGKILLed while the others wait in a collective: the job ends, no hang."""
    import time

    start = time.monotonic()
    result = run_mpi(n, "fail_on_rank.py", str(n - 1), "kill", timeout=150)
    assert result.returncode != 0
    assert time.monotonic() - start < 120
    assert "unexpectedly finished" not in result.stdout + result.stderr


@pytest.mark.mpi
def test_sigterm_ends_the_job_as_the_batch_system_means_it():
    """``scancel``, a job past its time limit and ``timeout`` send SIGTERM first: after
    ``axonn_jax.init()`` the job ends at once. JAX's preemption service (started by
    ``jax.distributed``, for checkpoints at a sync point this framework does not take) used to
    catch it, so a stuck job ran on until SIGKILL."""
    import os
    import signal
    import subprocess
    import time

    from mpi_util import mpi_command

    command, env = mpi_command(2, "init_then_sleep.py", "120")
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)  # fmt: skip
    try:
        ready = 0
        for line in job.stdout:  # both ranks joined the job and started their backends
            ready += line.startswith("ready")
            if ready == 2:
                break
        assert ready == 2
        start = time.monotonic()
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=30)
        assert time.monotonic() - start < 30
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


@pytest.mark.timeout(960)  # the job's own 900 s timeout fires first
def test_dropout_and_forward_only_pipelines_across_two_processes():
    """pipeline=2 under mpiexec -n 2, one launch: GPT-2 with dropout 0.1 gives the plain model's
    grads and steps (dropout_equivalence.py), and pm.apply / pm.forward the plain model's outputs
    on both ranks (pipeline_forward.py)."""
    result = run_mpi(2, "run_scripts.py", "dropout_equivalence.py", "pipeline_forward.py", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the ranks' lines may interleave in mpiexec's merged stdout: count, do not split
    assert result.stdout.count("OK rank") == 4, result.stdout
    assert [result.stdout.count(f" {what} Grid(") for what in ("dropout", "forward")] == [2, 2], result.stdout

"""The CPU collectives of an MPI job follow its grid (runtime/launch.py, issue 29 item 6).

XLA:CPU runs every collective of a process through one implementation; with gloo,
even a process-local ``psum`` crosses gloo's TCP pairs (measured 4.0 ms against
0.3 ms in-process; a pipelined step 5x slower, benchmarks/mpi_step.py). A grid
whose pipeline stages each fit in one process needs no XLA collective across
processes, so ``axonn_jax.init(grid=...)`` picks XLA's in-process collectives for it.
"""

from __future__ import annotations

import pytest
from mpi_util import run_mpi

from axonn_jax import Grid
from axonn_jax.runtime import launch
from axonn_jax.runtime.mesh import stages_stay_in_processes


@pytest.mark.parametrize("grid,per_process,processes,expected", [
    (Grid(pipeline=2, x=2, z=2), 4, 2, True),  # one stage per process
    (Grid(pipeline=2, x=2, z=2), 2, 4, False),  # each stage spans two processes
    (Grid(pipeline=4), 2, 2, True),  # two stages per process
    (Grid(pipeline=2, data=2), 1, 4, False),  # data parallel across processes in a stage
    (Grid(x=2, z=2, data=2), 4, 2, False),  # no pipeline: the one stage spans both
    (Grid(pipeline=3, x=2), 3, 2, False),  # stage 1 straddles the two processes
    (Grid(pipeline=2, x=2), 4, 2, False),  # 4 devices for 8 in the job: not this grid's job
])  # fmt: skip
def test_stages_stay_in_processes(grid, per_process, processes, expected):
    assert stages_stay_in_processes(grid, per_process, processes) is expected


def test_unknown_cpu_collectives_are_refused():
    with pytest.raises(ValueError, match=r"cpu_collectives='nccl': expected one of \('auto', 'gloo'"):
        launch.init(cpu_collectives="nccl")


@pytest.mark.mpi
@pytest.mark.parametrize("mode,expected", [("auto", "local"), ("late", "gloo"), ("gloo", "gloo")])
def test_collectives_follow_the_grid_under_mpiexec(mode, expected, tmp_path):
    """``auto``: in-process collectives; a pipelined step and a checkpoint round trip run
    (no XLA program across processes), a later grid that needs one is refused on every
    rank naming the remedy. ``late``: the backend started before the grid: gloo, and a
    warning naming ``axonn_jax.init(grid=grid)``. ``gloo``: as asked, silently. The
    losses agree to the printed digits in all three, with plain Flax + optax's from
    ``model.init(key)`` (which ``pm.init(key)`` makes)."""
    result = run_mpi(2, "cpu_collectives.py", mode, str(tmp_path / "ckpt"), devices_per_process=4,
                     timeout=300)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert out.count(f"COLLECTIVES 0 {expected}") == out.count(f"COLLECTIVES 1 {expected}") == 1, out
    losses = {line.split()[2] for line in result.stdout.splitlines() if line.startswith("LOSS ")}
    assert losses == {"0.7684271"}, out  # plain Flax + optax from model.init(key), 4 microbatches
    warned = [line for line in result.stdout.splitlines() if line.startswith("WARNED: ")]
    if mode == "late":
        assert len(warned) == 1 and "Remedy: axonn_jax.init(grid=grid)" in warned[0], out
    else:
        assert not warned, out
    if mode == "auto":
        assert out.count("RESTORED 0 True") == out.count("RESTORED 1 True") == 1, out
        for rank in (0, 1):
            assert f"REFUSED {rank}: Grid(x=2, y=2, z=2, data=1, pipeline=1) puts the devices of a " \
                   "pipeline stage on several processes" in out, out
        assert "Remedy: axonn_jax.init(cpu_collectives='gloo')" in out, out

"""Ranks that partition different grids or models fail together, before any collective."""

import numpy as np
import pytest
from mpi_util import run_mpi

import axonn_jax
from axonn_jax import Grid
from axonn_jax.runtime.consistency import check_consistent
from axonn_jax.models import MLP

X = np.zeros((8, 16), np.float32)


class FakeComm:
    """``allgather`` returning what the other ranks would have sent (this one is rank 0)."""

    def __init__(self, others):
        self.others, self.calls = others, 0

    def allgather(self, obj):
        self.calls += 1
        theirs = [pm.fingerprint() for pm in self.others]
        if self.calls == 1:
            from axonn_jax.runtime.consistency import digests

            theirs = [digests(p) for p in theirs]
        return [obj, *theirs]

    def Get_rank(self):
        return 0


def test_same_everywhere_passes_with_one_allgather():
    pm = axonn_jax.partition(MLP((32, 16)), Grid(x=2, y=2, z=2), X)
    comm = FakeComm([axonn_jax.partition(MLP((32, 16)), Grid(x=2, y=2, z=2), X)])
    check_consistent(pm.fingerprint(), comm)
    assert comm.calls == 1


def test_differences_are_named_by_rank():
    pm = axonn_jax.partition(MLP((32, 16)), Grid(x=2, y=2, z=2), X)
    others = [
        axonn_jax.partition(MLP((32, 16)), Grid(x=2, y=2, z=2), X),  # rank 1: same
        axonn_jax.partition(MLP((32, 16)), Grid(x=2, z=2, pipeline=2), X),  # rank 2: grid
        axonn_jax.partition(MLP((64, 16)), Grid(x=2, y=2, z=2), X),  # rank 3: hidden size
        axonn_jax.partition(MLP((32, 16)), Grid(x=2, y=2, z=2), np.zeros((16, 16), np.float32)),
    ]
    with pytest.raises(ValueError) as err:
        check_consistent(pm.fingerprint(), FakeComm(others))
    text = str(err.value)
    assert "rank 1 " not in text
    assert "rank 2 has grid Grid(x=2, y=1, z=2, data=1, pipeline=2) but rank 0 has Grid(x=2, y=2" in text
    assert "rank 3 has parameter 'dense_0/bias' float32[64] but rank 0 has float32[32]" in text
    assert "parameter 'dense_0/kernel' float32[16, 64] but rank 0 has float32[16, 32]" in text
    assert "rank 4 has example inputs float32[16, 16] but rank 0 has float32[8, 16]" in text
    assert "computed a different plan" not in text and "Remedy" in text


@pytest.mark.mpi
def test_every_rank_raises_under_mpiexec():
    """Rank 1 has another grid, hidden size, then learning rate: both ranks raise, no hang."""
    result = run_mpi(2, "inconsistent_ranks.py", "caught", devices_per_process=4, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    for rank in (0, 1):
        assert f"RAISED {rank} grid: the ranks of this job partition different things: rank 1 " \
               "has grid Grid(x=2, y=1, z=2, data=1, pipeline=2) but rank 0 has Grid(x=2, y=2" in output
        assert f"RAISED {rank} model: the ranks of this job partition different things: rank 1 " \
               "has parameter 'dense_0/bias' float32[64] but rank 0 has float32[32]" in output
        assert f"RAISED {rank} optimizer: the ranks of this job run different train steps: rank 1 " \
               "has optimizer update" in output
    assert "-0.002" in output and "-0.001" in output  # the learning rates, named
    assert "unexpectedly finished" not in output


@pytest.mark.mpi
def test_uncaught_mismatch_ends_the_job():
    result = run_mpi(2, "inconsistent_ranks.py", "uncaught", devices_per_process=4, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "uncaught exception" in output and "rank 1 has grid Grid(" in output
    assert "unexpectedly finished" not in output

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


def test_a_source_tree_that_is_not_installed_still_has_a_fingerprint(monkeypatch):
    """Run from a copy of the source tree (no package metadata), every rank reports the same
    version text and the check goes on."""
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    pm = axonn_jax.partition(MLP((32, 16)), Grid(x=2, y=2, z=2), X)
    assert pm.fingerprint()["versions"].startswith("axonn_jax (source tree), jax ")
    check_consistent(pm.fingerprint(), FakeComm([axonn_jax.partition(MLP((32, 16)), Grid(x=2, y=2, z=2), X)]))


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


SMALL = ["--grid", "data=2", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16",
         "--batch", "4", "--sample-tokens", "1", "--eval-every", "0"]  # fmt: skip


@pytest.mark.mpi
@pytest.mark.parametrize("flag,first,last", [("--steps", "3", "4"), ("--seed", "0", "1")])
def test_example_ranks_with_other_arguments_fail_before_the_first_step(tmp_path, flag, first, last):
    """A different --steps per rank used to end only in Gloo's "collective mismatch"; the
    example compares its run configuration on every rank first and names both values."""
    result = run_mpi(2, "example_rank_args.py", str(tmp_path), flag, first, last, *SMALL, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    for rank in (0, 1):
        assert f"RAISED {rank}: the ranks of this job run different configurations: rank 1 has " \
               f"{flag} {last} but rank 0 has {first}. Remedy: launch every rank with the same " \
               "arguments" in output, output[-3000:]  # fmt: skip
    assert "mismatch" not in output and "compiling the train step" not in output


@pytest.mark.mpi
def test_replicas_that_drift_are_named_on_every_rank():
    """data=2 over two processes: equal replicas pass (after a step too); rank 1's bias moved
    by 1e-6 in one entry: both ranks raise naming the parameter, the shard and the ranks."""
    result = run_mpi(2, "replica_drift.py", timeout=240)
    output = result.stdout + result.stderr
    assert "EQUAL 0" in output and "EQUAL 1" in output, output[-3000:]
    for rank in (0, 1):
        assert f"RAISED {rank}: data-parallel replicas differ after step 1: 'dense_1/bias' shard " \
               "[0:16] is 0x" in output, output[-3000:]  # fmt: skip
    assert "on rank 0 (" in output and "on rank 1 (" in output and "Remedy:" in output
    assert "NOT RAISED" not in output and result.returncode != 0


def test_replica_check_in_one_process_compares_the_copies_on_every_device(devices):
    """x=2,z=2,data=2 on 8 devices: each shard has copies on several devices; one copy moved."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import axonn_jax
    from axonn_jax.health import check_replicas
    from axonn_jax.models import MLP

    x = np.zeros((8, 16), np.float32)
    pm = axonn_jax.partition(MLP((32, 16)), axonn_jax.Grid(x=2, z=2, data=2), x)
    params = pm.init(jax.random.key(0))
    check_replicas(params, step=7)
    bias = params["dense_0"]["bias"]
    shards = [jnp.asarray(s.data) for s in bias.addressable_shards]
    devices_ = [s.device for s in bias.addressable_shards]
    shards[-1] = shards[-1].at[0].add(1.0)
    params["dense_0"]["bias"] = jax.make_array_from_single_device_arrays(
        bias.shape, bias.sharding, [jax.device_put(a, d) for a, d in zip(shards, devices_)])
    with pytest.raises(ValueError, match=r"replicas differ after step 7: 'dense_0/bias' shard \[\d+:\d+\] "
                                         r"is 0x[0-9a-f]+ on rank 0 \(.*\) but 0x[0-9a-f]+ on rank 0"):  # fmt: skip
        check_replicas(params, step=7)

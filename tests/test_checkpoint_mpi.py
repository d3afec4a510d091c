"""Checkpoints under a real ``mpiexec -n 2`` (4 devices each): per-process stage shards."""

import re

import numpy as np
import pytest
from checkpoint_cases import read_with_plain_orbax
from mpi_util import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.slow
def test_stage_shards_written_per_process_restore_onto_other_grids(tmp_path):
    """Each process holds (and writes) only its pipeline stage; the checkpoint restores
    bitwise onto z=4·data=2 and data=8 (both spanning the processes) and back onto
    the stages, also in the layout of pm.init / TrainStep.init with pipeline=2;
    the loader gives each process exactly its rows. Plain orbax, in a process
    without axonn_jax, reads the stage shards both processes wrote."""
    expected_file = tmp_path / "expected.npz"
    result = run_mpi(2, "checkpoint_stages.py", str(tmp_path / "ckpt"), str(expected_file),
                     devices_per_process=4, timeout=300)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    ok = re.findall(r"^OK (.+)$", result.stdout, flags=re.M)
    expected = ["save stages", "restore z=4,data=2", "restore data=8", "restore stages",
                "per-stage optimizer states", "pipeline layout", "loader"]  # fmt: skip
    assert ok == expected, output[-4000:]
    plain = read_with_plain_orbax(tmp_path / "ckpt" / "1", tmp_path)
    with np.load(expected_file) as saved:
        assert sorted(plain) == sorted(saved.files)
        for path in saved.files:
            assert plain[path].dtype == saved[path].dtype, path
            np.testing.assert_array_equal(plain[path], saved[path], err_msg=path)

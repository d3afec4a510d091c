"""The main example runs in one process and unchanged under mpiexec, with equal losses."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_util import mpiexec

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "6", "--layers", "1", "--hidden", "64", "--sample-bytes", "8"]


def _run(prefix, out, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [*prefix, sys.executable, str(ROOT / "examples" / "train_gpt.py"), *ARGS, "--out", str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert (out / "loss.png").stat().st_size > 0
    return result.stdout, np.array([float(r["loss"]) for r in rows])


@pytest.mark.slow
@pytest.mark.mpi
def test_example_single_process_and_mpiexec_agree(tmp_path):
    stdout, single = _run([], tmp_path / "one")
    assert "Plan for Grid(x=2, y=1, z=2, data=1, pipeline=2)" in stdout and "sample:" in stdout
    assert (tmp_path / "one" / "timeline.png").stat().st_size > 0  # the default grid pipelines
    assert len(single) == 6 and single[-1] < single[0]
    stdout_two, two = _run([mpiexec(), "-n", "2"], tmp_path / "two")
    np.testing.assert_allclose(two, single, rtol=1e-5)
    # validation and sampling run forward-only through the stages, across the two processes too
    sample = [line for line in stdout.splitlines() if line.startswith("sample:")]
    assert sample and sample == [line for line in stdout_two.splitlines() if line.startswith("sample:")]


def test_bad_cli_arguments():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "--steps must be >= 1" in result.stderr
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--grid", "w=2", "--steps", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and "expected AXIS=SIZE" in result.stderr

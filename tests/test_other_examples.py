"""The examples besides the main one run, learn, and run unchanged under mpiexec.

* ``examples/finetune_hf.py`` writes a small random GPT-2 with ``save_pretrained``
  (nothing is downloaded), trains it, exports it, reads the export back with
  ``transformers`` and prints how far the reloaded model's logits are from the
  trained weights';
* ``examples/train_resnet_nnx.py`` trains an nnx ResNet (BatchNorm, Dropout) and
  evaluates it with its evaluation program (``model.eval()``) on held-out images.

Bounds: the exported model's logits within 1e-5 of the trained weights' (fp32); a run
under mpiexec equal to the one-process run to rtol 1e-5 (losses) or to the printed
digits (2e-3 on three decimals).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_util import mpiexec, subprocess_timeout

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "4", "--log-every", "1", "--batch", "8", "--seq", "32"]


def _example(prefix: list[str], script: str, *args: str) -> str:
    """The example's stdout (it sets its own devices, as a user runs it)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [*prefix, sys.executable, str(ROOT / "examples" / script), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=subprocess_timeout(None))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout


def _run(prefix: list[str], out: Path, *extra: str) -> tuple[str, np.ndarray, float]:
    """finetune_hf's stdout, its per-step losses and the reloaded model's logit difference."""
    pytest.importorskip("transformers")
    stdout = _example(prefix, "finetune_hf.py", *ARGS, *extra, "--out", str(out))
    losses = np.array([float(m) for m in re.findall(r"^step \d+/\d+  loss ([\d.]+)", stdout, re.M)])
    [difference] = re.findall(r"^reloaded: max \|logits - trained\| = (\S+)", stdout, re.M)
    return stdout, losses, float(difference)


def test_a_saved_model_is_tuned_on_a_grid_and_reloaded_by_transformers(tmp_path):
    stdout, losses, difference = _run([], tmp_path / "run")
    assert "model: FlaxGPT2LMHeadModule" in stdout and "Plan for Grid(x=2, y=1, z=2, data=2" in stdout
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert difference <= 1e-5, stdout  # the export holds the trained weights
    assert (tmp_path / "run" / "tuned" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.mpi
def test_a_pipeline_across_two_processes_tunes_as_one_process_does(tmp_path):
    grid = ["--grid", "pipeline=2,x=2,z=2"]
    _, one, difference_one = _run([], tmp_path / "one", *grid)
    stdout, two, difference_two = _run([mpiexec(), "-n", "2"], tmp_path / "two", *grid)
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert difference_one <= 1e-5 and difference_two <= 1e-5, stdout
    assert stdout.count("Plan for Grid(") == 1  # rank 0 speaks for the job


def _resnet(prefix: list[str], grid: str) -> tuple[str, np.ndarray]:
    """train_resnet_nnx's stdout and, per reported step, (loss, train accuracy, held-out accuracy)."""
    stdout = _example(prefix, "train_resnet_nnx.py", "--steps", "20", "--eval-every", "10", "--grid", grid)
    rows = re.findall(r"^step \d+/20  loss ([\d.]+)  train accuracy ([\d.]+)  held-out accuracy ([\d.]+)",
                      stdout, re.M)  # fmt: skip
    return stdout, np.array(rows, dtype=float)


def test_the_nnx_resnet_learns_and_evaluates_with_its_evaluation_program():
    stdout, rows = _resnet([], "z=2,data=4")
    [before] = re.findall(r"^step 0/20  held-out accuracy ([\d.]+)", stdout, re.M)
    assert rows.shape == (2, 3) and rows[-1, 0] < rows[0, 0]
    assert rows[-1, 2] > float(before) + 0.1, stdout  # held-out images, running averages


@pytest.mark.slow
@pytest.mark.mpi
def test_the_nnx_resnet_on_a_pipeline_across_two_processes_learns_as_on_one_mesh():
    """Its evaluation program runs on the training variables although each process holds only
    its stages' leaves (the dropout stream's counter, which evaluation never reads, included)."""
    _, one_mesh = _resnet([], "z=2,data=4")
    _, piped = _resnet([mpiexec(), "-n", "2"], "pipeline=2,data=4")
    np.testing.assert_allclose(piped, one_mesh, atol=2e-3)  # printed with 3 decimals

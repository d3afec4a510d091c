"""examples/finetune_hf.py: a HuggingFace model's weights in, trained on a grid, out again.

The example writes a small random GPT-2 with ``save_pretrained`` (nothing is
downloaded), trains it, exports it, reads the export back with ``transformers``
and prints how far the reloaded model's logits are from the trained weights'.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_util import mpiexec, subprocess_timeout

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "4", "--log-every", "1", "--batch", "8", "--seq", "32"]


def _run(prefix: list[str], out: Path, *extra: str) -> tuple[str, np.ndarray, float]:
    """The example's stdout, its per-step losses and the reloaded model's logit difference."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example sets its devices
    command = [*prefix, sys.executable, str(ROOT / "examples" / "finetune_hf.py"), *ARGS, *extra,
               "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=subprocess_timeout(None))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    losses = np.array([float(m) for m in re.findall(r"^step \d+/\d+  loss ([\d.]+)", result.stdout, re.M)])
    [difference] = re.findall(r"^reloaded: max \|logits - trained\| = (\S+)", result.stdout, re.M)
    return result.stdout, losses, float(difference)


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

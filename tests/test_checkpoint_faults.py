"""Checkpoint faults end cleanly: nothing lost silently, no hang, messages that name the step.

Each case runs in its own process (tests/scripts/checkpoint_fault.py) with a
timeout: a failed save used to leave orbax's threads waiting forever at exit.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axonn_jax import checkpoint
from axonn_jax.checkpoint import Checkpointer
from axonn_jax.runtime.checkpoint import writer_lock

SCRIPT = Path(__file__).resolve().parent / "scripts" / "checkpoint_fault.py"


def _run(mode: str, directory: Path, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = [mode] if mode else []
    return subprocess.run([sys.executable, str(script), *args, str(directory)], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip


def _latest_w(directory: Path) -> tuple[int, float]:
    target = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32,
                                        sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}  # fmt: skip
    restored = checkpoint.restore(directory, params=target)
    return restored.step, float(np.asarray(restored.params["w"]).mean())


def test_a_script_ending_with_a_save_pending_commits_it_and_says_so(tmp_path):
    result = _run("no-close", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the script ended with the save of step 2" in result.stderr and "close the Checkpointer" in result.stderr
    assert _latest_w(tmp_path) == (2, 2.0)


def test_a_save_through_a_checkpointer_dropped_at_once_is_committed(tmp_path):
    """``Checkpointer(d).save(7, params)`` as the last line: the object is gone, the save is not."""
    result = _run("", tmp_path, SCRIPT.parent / "dropped_checkpointer.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "the script ended with the save of step 7" in result.stderr
    assert _latest_w(tmp_path) == (7, 7.0)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["7"]


@pytest.mark.parametrize("mode,cause", [("disk-full", "No space left on device"),
                                        ("read-only", "Read-only file system")])  # fmt: skip
def test_a_failed_save_exits_1_naming_the_step_and_the_previous_step_restores(tmp_path, mode, cause):
    result = _run(mode, tmp_path)
    assert "end of script" in result.stdout
    assert result.returncode == 1, result.stderr[-3000:]
    assert "caught: saving step 2 to" in result.stdout and cause in result.stdout
    assert "the latest complete step is 1 (untouched)" in result.stdout
    assert "exiting with status 1 because a save failed" in result.stderr
    assert _latest_w(tmp_path) == (1, 1.0)


def test_a_failed_save_made_good_by_a_later_step_exits_0(tmp_path):
    result = _run("full-then-ok", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "caught: saving step 2" in result.stdout
    assert _latest_w(tmp_path) == (3, 3.0)


def test_saving_donated_arrays_is_refused_before_anything_starts(tmp_path):
    result = _run("donated", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "caught: checkpoint leaf 'params/w' was donated to a jitted step" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["1"]


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    first = Checkpointer(tmp_path)
    with pytest.raises(writer_lock.WriterLockError, match="already has an open writing Checkpointer in this process"):
        Checkpointer(tmp_path)
    lock = tmp_path / writer_lock.NAME
    lock.write_text('{"host": "node-7", "pid": 4242, "started": 0}')  # another job, elsewhere
    first.close()  # releases only its own lock: node-7's stays
    assert lock.exists()
    with pytest.raises(writer_lock.WriterLockError, match=r"another writer saves into .* \(process 4242 on host node-7.*takeover=True"):  # fmt: skip
        Checkpointer(tmp_path)
    Checkpointer(tmp_path, takeover=True).close()
    assert not lock.exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(f'{{"host": "{socket.gethostname()}", "pid": {int(dead.stdout)}, "started": 0}}')
    with Checkpointer(tmp_path) as ckpt:  # a writer of this host that died: taken over
        ckpt.save(1, {"w": jnp.ones(2)})
    assert checkpoint.latest_step(tmp_path) == 1 and not lock.exists()

"""Processes that make different pipelined calls fail together within the timeout, naming why.

Bounds: the MPI tests run 2 ranks with timeout=10 s; every rank must have raised within
timeout + 10 s of entering the call (rank 1 of ``rank0_only`` enters 15 s late by design).
"""

import re
import struct
import time

import numpy as np
import pytest
from mpi_util import run_mpi

from axonn_jax.runtime.collectives import SingleProcess
from axonn_jax.runtime import agreement
from axonn_jax.runtime.agreement import CallMismatch, CallNotJoined, agree_on_call, describe_call

TIMEOUT = 10


class FakeHost:
    """A 2-process host whose other process sent ``other`` (a function of this one's record)."""

    rank, comm = 0, object()

    def __init__(self, other):
        self.other = other

    def allgather_within(self, record, timeout):
        return None if self.other is None else [record, self.other(record)]


def _record(kind, description, entered, timeout=60.0):
    import hashlib

    text = "\n".join([f"{agreement.NAMES[kind]} at other.py:1", *description])
    digest = hashlib.blake2b("\n".join([kind, *description]).encode(), digest_size=16).digest()
    return struct.pack("<ddI16s", entered, timeout, len(text), digest) + text.encode()


def test_one_process_agrees_with_itself():
    agree_on_call(SingleProcess(), "pm.apply", lambda: 1 / 0, 1.0)  # describe is not even called


def test_describe_call_names_shapes_dtypes_and_static_values():
    lines = describe_call(args=(np.zeros((4, 8), np.int32),), kwargs={"deterministic": True}, microbatches=2)
    assert lines == ["args[0]: int32[4, 8]", "kwargs['deterministic']: True", "microbatches: 2"]


def test_other_shapes_are_named_with_the_remedy():
    mine = describe_call(batch=(np.zeros((16, 4), np.float32),))
    host = FakeHost(lambda r: _record("train step", describe_call(batch=(np.zeros((8, 4), np.float32),)), time.time()))
    with pytest.raises(CallMismatch, match=re.escape(
            "other shapes, dtypes or static arguments to the train step: process 1 has batch[0]: "
            "float32[8, 4] but process 0 has batch[0]: float32[16, 4]. Remedy: a train step over several "
            "processes")):
        agree_on_call(host, "train step", lambda: mine, 60.0)


def test_different_calls_at_once_are_named():
    host = FakeHost(lambda r: _record("train step", ["batch: x"], time.time()))
    with pytest.raises(CallMismatch, match="different pipelined calls.*process 1 calls the train step"):
        agree_on_call(host, "pm.apply", lambda: ["args: x"], 60.0)


def test_a_call_nobody_joins_and_a_stale_partner_are_named():
    with pytest.raises(CallNotJoined, match="not every process entered this call within timeout=5 s.*collective"):
        agree_on_call(FakeHost(None), "pm.apply", lambda: ["args: x"], 5.0)
    stale = FakeHost(lambda r: _record("pm.apply", ["args: x"], time.time() - 20, timeout=10.0))
    with pytest.raises(CallNotJoined, match="out of step: process 1 entered .* beyond process 1's timeout=10 s"):
        agree_on_call(stale, "pm.apply", lambda: ["args: x"], 10.0)


def _raised(output: str) -> dict[int, tuple[float, str]]:
    found = {}
    for line in output.splitlines():
        m = re.match(r"RAISED (\d) ([\d.]+): (.*)", line)
        if m:
            found[int(m[1])] = (float(m[2]), m[3])
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("grid", ["pipeline=2,x=2,z=2", "x=2,data=2"])
def test_pm_apply_on_one_rank_only_fails_on_every_rank_within_the_timeout(grid):
    """Rank 0 alone calls pm.forward (pm.apply with a timeout): on a pipeline it used to block
    forever in the outputs' broadcast, on one mesh over both processes (x=2,data=2) to fail
    after 30 s with Gloo's read timeout, naming no cause. Rank 0 now raises after the timeout;
    rank 1, whose next collective call meets the call rank 0 gave up on, raises at once that
    the processes are out of step."""
    result = run_mpi(2, "call_agreement.py", "rank0_only", str(TIMEOUT), grid,
                     devices_per_process=4 if "pipeline" in grid else 2, timeout=240)  # fmt: skip
    output = result.stdout + result.stderr
    raised = _raised(output)
    assert set(raised) == {0, 1}, output[-4000:]
    t0, m0 = raised[0]
    assert TIMEOUT - 0.5 <= t0 <= TIMEOUT + 10, output[-4000:]
    assert m0.startswith("CallNotJoined: pm.apply / pm.forward at call_agreement.py:")
    assert f"not every process entered this call within timeout={TIMEOUT} s" in m0
    assert "Remedy: pm.apply / pm.forward over several processes is collective: call it on every process" in m0
    t1, m1 = raised[1]
    assert t1 <= TIMEOUT + 5 + 10, output[-4000:]
    assert m1.startswith("CallNotJoined: the processes are out of step: process 0 entered pm.apply")
    assert "process 0 gave up waiting" in m1 and "call it on every process" in m1


@pytest.mark.mpi
@pytest.mark.parametrize("mode,env", [("sizes", {}), ("values", {"AXONN_JAX_CHECK_BATCH": "1"})])
def test_train_step_with_other_batches_per_rank_fails_on_every_rank(mode, env):
    """At step 1 rank 1 passes 8 rows, rank 0 16: rank 1 (a new shape) used to block forever in
    the compile's collective and rank 0 to time out blaming a failed peer. Both now raise at once,
    naming the shapes (``values``: other values, checked with AXONN_JAX_CHECK_BATCH=1)."""
    result = run_mpi(2, "call_agreement.py", mode, str(TIMEOUT), devices_per_process=4, timeout=240, env=env)
    output = result.stdout + result.stderr
    raised = _raised(output)
    assert set(raised) == {0, 1}, output[-4000:]
    for rank in (0, 1):
        seconds, message = raised[rank]
        assert seconds < TIMEOUT, output[-4000:]
        assert message.startswith("CallMismatch: the processes passed inputs of other shapes, dtypes"), message
        if mode == "sizes":
            assert "process 1 has batch[0]: float32[8, 16] but process 0 has batch[0]: float32[16, 16]" in message
        else:
            assert re.search(r"process 1 has batch\[0\] values: \w+ but process 0 has batch\[0\] values: ", message)
        assert "every process, with the same global batch" in message


@pytest.mark.mpi
@pytest.mark.parametrize("mode,env", [("sizes", {}), ("values", {"AXONN_JAX_CHECK_BATCH": "1"}),
                                      ("step_rank0_only", {})])  # fmt: skip
def test_a_flat_train_step_over_two_processes_fails_together(mode, env):
    """``x=2,data=2``, one mesh over both processes: one SPMD program, each process keeping its
    part of the batch it is given. Other batch sizes per process used to train silently on each
    process's own reading (the losses differed, nothing said so); with AXONN_JAX_CHECK_BATCH=1,
    other values (each process passing its own shard) are named too; a process that leaves the
    loop left the other waiting in the step's collectives for minutes. Now both raise: at once
    for a mismatch, within the timeout for a step one process does not make."""
    result = run_mpi(2, "call_agreement.py", mode, str(TIMEOUT), "x=2,data=2", devices_per_process=2,
                     timeout=240, env=env)  # fmt: skip
    output = result.stdout + result.stderr
    raised = _raised(output)
    assert set(raised) == {0, 1}, output[-4000:]
    if mode == "step_rank0_only":
        t0, m0 = raised[0]
        assert TIMEOUT - 0.5 <= t0 <= TIMEOUT + 10 and m0.startswith("CallNotJoined: the train step at"), m0
        assert "Remedy: a train step over several processes (pm.train_step" in m0
        assert raised[1][1].startswith("CallNotJoined: the processes are out of step: process 0 entered the train step")
        return
    for rank in (0, 1):
        seconds, message = raised[rank]
        assert seconds < TIMEOUT and message.startswith("CallMismatch: the processes passed inputs of other"), message
        assert ("process 1 has batch[0]: float32[8, 16] but process 0 has batch[0]: float32[16, 16]" in message
                if mode == "sizes" else re.search(r"process 1 has batch\[0\] values: \w+ but process 0 has", message))


@pytest.mark.mpi
def test_a_checkpoint_on_one_rank_only_fails_on_every_rank_within_the_timeout(tmp_path):
    """``if rank == 0:`` create a Checkpointer and save (the common habit): rank 0 used to block
    forever in the Checkpointer's first collective (a blocking allgather), rank 1 in its next
    step. Rank 0 now raises after the timeout, naming the remedy; rank 1, whose next collective
    call meets the one rank 0 gave up on, raises that the processes are out of step."""
    result = run_mpi(2, "call_agreement.py", "checkpoint_rank0_only", str(TIMEOUT), "data=2",
                     str(tmp_path / "ckpt"), devices_per_process=1, timeout=240)  # fmt: skip
    output = result.stdout + result.stderr
    raised = _raised(output)
    assert set(raised) == {0, 1}, output[-4000:]
    t0, m0 = raised[0]
    assert TIMEOUT - 0.5 <= t0 <= TIMEOUT + 10, output[-4000:]
    assert m0.startswith("CallNotJoined: a Checkpointer call at call_agreement.py:"), m0
    assert "Remedy: a Checkpointer and its save / restore are collective" in m0
    assert raised[1][1].startswith("CallNotJoined: the processes are out of step: process 0 entered a Checkpointer call")

"""Under mpiexec: a rank that raises or dies mid-step ends the whole pipelined job.

Usage: mpiexec -n P python pipeline_failure.py GRID raise|kill
Rank 1 fails during the backward/forward of microbatch 2 of the second step
(the dispatch queue's ``delay`` hook is the injection point); the other ranks
are then waiting for its messages and must not hang.
"""

import os
import signal
import sys

import axonn_jax
from pipeline_cases import build

info = axonn_jax.init()
grid, how = axonn_jax.Grid.parse(sys.argv[1]), sys.argv[2]
case = build("gpt")
pm = axonn_jax.partition(case.model, grid, *case.inputs(case.batch(1)))
import jax  # noqa: E402

steps_done = 0


def delay(stage, kind, mb):
    if info.process_index == 1 and steps_done == 1 and mb == 2:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("injected failure on rank 1")
    return 0.0


step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=4, delay=delay, timeout=30)
params = pm.init(jax.random.key(0))
for steps_done in range(3):
    step(params, case.batch(4))
print(f"rank {info.process_index}: unexpectedly finished", flush=True)

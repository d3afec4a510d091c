"""Under mpiexec -n 2: the last rank partitions something different; every rank must raise.

Usage: mpiexec -n P python inconsistent_ranks.py caught|uncaught

``caught``: three cases in one job — the last rank uses a different grid, then
a different hidden size, then a different learning rate in its train step. Each rank prints ``RAISED <rank> <case>: <message>``
for each and exits 3 (so every rank is seen to raise, without a hang).
``uncaught``: the different grid, not caught: the abort hook must end the job.
"""

import sys

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from axonn_jax import Grid  # noqa: E402
from axonn_jax.models import MLP  # noqa: E402

last = info.process_index == info.process_count - 1
x = np.zeros((8, 16), np.float32)
CASES = {
    "grid": (MLP((32, 16)), Grid(x=2, z=2, pipeline=2) if last else Grid(x=2, y=2, z=2)),
    "model": (MLP((64 if last else 32, 16)), Grid(x=2, y=2, z=2)),
    "optimizer": (MLP((32, 16)), Grid(x=2, y=2, z=2)),  # another learning rate on the last rank
}


def attempt(name: str) -> None:
    model, grid = CASES[name]
    pm = axonn_jax.partition(model, grid, x)
    params = pm.init(jax.random.key(0))  # first use of the devices: checked here
    if name == "optimizer":
        step = pm.train_step(lambda out, batch: (out**2).mean(), optax.adamw(2e-3 if last else 1e-3))
        params, _ = step.init(params)  # the train step is checked here
    jax.block_until_ready(params)
    print(f"rank {info.process_index}: unexpectedly finished {name}", flush=True)


if sys.argv[1] == "uncaught":
    attempt("grid")
    sys.exit(0)
raised = 0
for name in CASES:
    try:
        attempt(name)
    except ValueError as err:
        raised += 1
        print(f"RAISED {info.process_index} {name}: {err}", flush=True)
sys.exit(3 if raised == len(CASES) else 0)

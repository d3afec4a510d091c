"""Under mpiexec -n 2, pipeline=2,x=2,z=2 (or GRID): processes that make different collective
calls fail together, within the timeout, naming the cause (runtime/agreement.py).

Usage: mpiexec -n 2 python call_agreement.py rank0_only|sizes|values|step_rank0_only|checkpoint_rank0_only TIMEOUT [GRID]

``rank0_only``: only rank 0 calls ``pm.forward`` (``pm.apply`` with a timeout) ("generate on the main rank"); rank 1 sleeps
past the timeout, then makes its next pipelined call. ``sizes``: at step 1 rank 1 passes a
batch of 8 rows, rank 0 one of 16 (an epoch remainder read per rank). ``values``: the same
shapes, other values on rank 1 (checked with ``AXONN_JAX_CHECK_BATCH=1``). ``step_rank0_only``:
rank 1 leaves the training loop after step 1 (it sleeps past the timeout, then makes one more
step, its next collective call); ``checkpoint_rank0_only``: only rank 0 creates a Checkpointer
(in DIRECTORY, the fourth argument) and saves; rank 1 sleeps past the timeout, then makes its
next step. GRID (default pipeline=2,x=2,z=2) may be one mesh over both
processes (x=2,data=2: a flat train step). Each rank prints
``RAISED <rank> <seconds>: <type>: <message>`` (or ``FINISHED <rank>``) and exits 3.
"""

import sys
import time

import axonn_jax

info = axonn_jax.init()
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

mode, timeout = sys.argv[1], float(sys.argv[2])
grid = axonn_jax.Grid.parse(sys.argv[3] if len(sys.argv) > 3 else "pipeline=2,x=2,z=2")
rank = info.process_index


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(32, name="d0")(x))
        x = nn.gelu(nn.Dense(32, name="d1")(x))
        return nn.Dense(8, name="d2")(x)


def batch(n, seed):
    r = np.random.default_rng(seed)
    return r.standard_normal((n, 16)).astype(np.float32), r.standard_normal((n, 8)).astype(np.float32)


def mse(out, b):
    return jnp.mean((out - b[1]) ** 2)


pm = axonn_jax.partition(Net(), grid, batch(8, 0)[0])
params = pm.init(jax.random.key(0))
x = batch(8, 0)[0]
pm.forward(params, x, timeout=timeout)  # collective: fine
start = time.monotonic()
try:
    if mode == "checkpoint_rank0_only":
        step = pm.train_step(mse, optax.sgd(0.1), inputs=lambda b: b[:1], timeout=timeout)
        params, state = step.init(params)
        params, state, _ = step(params, state, batch(16, 1))
        start = time.monotonic()
        if rank == 0:  # "save on the main rank"
            from axonn_jax.checkpoint import Checkpointer

            with Checkpointer(sys.argv[4], timeout=timeout) as ckpt:
                ckpt.save_train_state(1, step, params, state)
        else:
            time.sleep(timeout + 5)
            params, state, _ = step(params, state, batch(16, 2))  # its next collective call
    elif mode == "rank0_only":
        if rank == 0:
            pm.forward(params, x, timeout=timeout)
        else:
            time.sleep(timeout + 5)
            pm.forward(params, x, timeout=timeout)  # its next pipelined call
    else:
        step = pm.train_step(mse, optax.sgd(0.1), microbatches=2, inputs=lambda b: b[:1], timeout=timeout)
        params, state = step.init(params)
        params, state, _ = step(params, state, batch(16, 1))  # both ranks: fine
        if mode == "step_rank0_only" and rank == 1:
            time.sleep(timeout + 5)  # left the loop; its next collective call comes too late
        b = batch(8 if (mode == "sizes" and rank == 1) else 16, 99 if rank == 1 and mode == "values" else 2)
        params, state, _ = step(params, state, b)
    print(f"FINISHED {rank} {time.monotonic() - start:.1f}", flush=True)
except Exception as err:  # noqa: BLE001 - printed for the test to read
    print(f"RAISED {rank} {time.monotonic() - start:.1f}: {type(err).__name__}: {err}", flush=True)
sys.exit(3)

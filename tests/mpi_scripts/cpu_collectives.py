"""Under mpiexec -n 2 (4 devices each): which CPU collectives a job gets, and what it refuses.

Usage: mpiexec -n 2 python cpu_collectives.py auto|late|gloo CHECKPOINT_DIR

* ``auto``: ``axonn_jax.init(grid=pipeline=2,x=2,z=2)`` picks in-process collectives
  ("local") and starts the backends (rank 0 then runs JAX alone); a pipelined step and a checkpoint save + restore run; a later grid whose
  stage spans both processes is refused on every rank (``REFUSED <rank>: <message>``);
* ``late``: an array is created before any grid, so the backend starts with gloo; the
  process-local grid then warns on rank 0 (``WARNED: <message>``) and still trains;
* ``gloo``: ``cpu_collectives="gloo"`` is kept for the process-local grid, silently.

Each rank prints ``COLLECTIVES <rank> <choice>`` and ``LOSS <rank> <loss>``.
"""

import sys
import warnings

import axonn_jax
from axonn_jax import Grid

mode, directory = sys.argv[1], sys.argv[2]
GRID = Grid(pipeline=2, x=2, z=2)
if mode == "auto":
    info = axonn_jax.init(grid=GRID)
elif mode == "gloo":
    info = axonn_jax.init(grid=GRID, cpu_collectives="gloo")
else:
    info = axonn_jax.init()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from axonn_jax.checkpoint import Checkpointer  # noqa: E402
from axonn_jax.models import MLP  # noqa: E402
from axonn_jax.runtime import launch  # noqa: E402

rank = info.process_index
if mode == "late":
    jnp.zeros(3).block_until_ready()  # the backends start before axonn_jax sees a grid
else:  # init(grid=...) started every process's backends: one may run JAX alone, the
    if rank == 0:  # other waiting in MPI (before, each waited for the other until a timeout)
        jnp.arange(3).sum().block_until_ready()
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
model = MLP((32, 32, 16))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pm = axonn_jax.partition(model, GRID, x[:2])
for w in caught:
    if "gloo" in str(w.message):
        print(f"WARNED: {w.message}", flush=True)
print(f"COLLECTIVES {rank} {launch.cpu_collectives()}", flush=True)
step = pm.train_step(lambda out, batch: jnp.mean((out - batch) ** 2), optax.adam(1e-2),
                     inputs=lambda b: (b,), microbatches=4)  # fmt: skip
params, opt_state = step.init(pm.init(jax.random.key(0)))
for _ in range(2):
    params, opt_state, loss = step(params, opt_state, x)
print(f"LOSS {rank} {float(loss):.7f}", flush=True)

if mode == "auto":  # checkpoints need no XLA program across processes
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, params)
    with Checkpointer(directory, read_only=True) as ckpt:
        restored = ckpt.restore(params=params)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        pm.gather(restored.params), pm.gather(params))  # fmt: skip
    print(f"RESTORED {rank} {all(jax.tree.leaves(same))}", flush=True)
    try:
        axonn_jax.partition(model, Grid(x=2, y=2, z=2), x[:2])
    except RuntimeError as err:
        print(f"REFUSED {rank}: {err}", flush=True)

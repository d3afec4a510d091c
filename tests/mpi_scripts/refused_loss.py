"""Under mpiexec: a loss refused on the last stage's process raises on every process.

Usage: mpiexec -n 2 python refused_loss.py (1 device per process, pipeline=2: the last
stage on rank 1). Each refusal is caught, as a script or test that retries would; the other
rank used to wait forever for rank 1 (in the compile barrier, or the loss's broadcast).
A parameter its stage reads, missing on one process, is refused on every process too.
Prints "REFUSED rank R <case>: <message>" per case, then "TRAINED rank R <loss>" from a
step that runs after them.
"""

import jax.numpy as jnp
import numpy as np

import axonn_jax

GRID = axonn_jax.Grid(pipeline=2)
info = axonn_jax.init(grid=GRID)
import jax  # noqa: E402

from axonn_jax.models import MLP  # noqa: E402

rng = np.random.default_rng(0)
x, y = rng.standard_normal((8, 8)).astype(np.float32), rng.standard_normal((8, 10)).astype(np.float32)
pm = axonn_jax.partition(MLP(features=(16, 16, 16, 10)), GRID, x[:4])
params = pm.init(jax.random.key(0))


def mse(out, b):
    return jnp.mean((out - b[1]) ** 2)


def refused(name: str, step, params, error: type[Exception]) -> None:
    """Run ``step`` and print whether (and how) it was refused on this rank."""
    try:
        step(params, (x, y))
    except error as err:
        print(f"REFUSED rank {info.process_index} {name}: {str(err).splitlines()[0]}", flush=True)
    else:
        print(f"NOT REFUSED rank {info.process_index} {name}", flush=True)


cases = {
    # refused where the last stage is traced (compiling the stages)
    "scalar-with-has_aux": (lambda out, b: mse(out, b), 1),
    # refused after the run, where the microbatches' aux is averaged
    "int-aux": (lambda out, b: (mse(out, b), {"hits": jnp.sum(out > 0)}), 2),
}
for name, (loss_fn, m) in cases.items():
    step = pm.value_and_grad(loss_fn, inputs=lambda b: (b[0],), microbatches=m, has_aux=True, timeout=60)
    refused(name, step, params, TypeError)
# a leaf the last stage reads is missing on its process (rank 1): refused there while the
# stage inputs are built, and on rank 0 too (it used to wait forever in the compile barrier)
holes = {**params, "dense_3": {**params["dense_3"], "kernel": None}} if info.process_index == 1 else params
refused("missing-leaf", pm.value_and_grad(mse, inputs=lambda b: (b[0],), timeout=60), holes, ValueError)
step = pm.value_and_grad(lambda out, b: (mse(out, b), {"mse": mse(out, b)}), inputs=lambda b: (b[0],),
                         microbatches=2, has_aux=True)  # fmt: skip
(loss, aux), _ = step(params, (x, y))
print(f"TRAINED rank {info.process_index} {float(loss):.6f} {float(aux['mse']):.6f}", flush=True)

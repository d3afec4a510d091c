"""fp16 train steps of a pipeline, one stage per process (or all in one process).

Usage: mpiexec -n 2 python fp16_pipeline.py (4 devices per process), or python
fp16_pipeline.py in one process of 8 devices. Prints "LOSSES rank R: l1 l2 l3" per rank.
Rank 0 holds no device of the last stage's mesh, where the dynamic loss scale is placed:
that placement failed there ("If the Array has no addressable shards, `dtype` must be
provided ...").
"""

import numpy as np

import axonn_jax

GRID = axonn_jax.Grid(pipeline=2, x=2, z=2)
info = axonn_jax.init(grid=GRID)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from axonn_jax.models import MLP  # noqa: E402

rng = np.random.default_rng(0)
x, y = rng.standard_normal((8, 8)).astype(np.float32), rng.standard_normal((8, 10)).astype(np.float32)
pm = axonn_jax.partition(MLP(features=(32, 32, 32, 10)), GRID, x[:4])
step = pm.train_step(lambda out, b: jnp.mean((out - b[1]) ** 2), optax.adam(1e-2), precision="fp16",
                     microbatches=2, inputs=lambda b: (b[0],))  # fmt: skip
params, opt_state = step.init(pm.init(jax.random.key(0)))
losses = []
for _ in range(3):
    params, opt_state, loss = step(params, opt_state, (x, y))
    losses.append(float(loss))
print(f"LOSSES rank {info.process_index}: " + " ".join(repr(v) for v in losses), flush=True)

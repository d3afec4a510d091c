"""Under mpiexec -n 2 (data=2, one device per rank): one rank's params perturbed, every rank raises.

Usage: mpiexec -n 2 python replica_drift.py

First the untouched parameters pass :func:`check_replicas` (after a train step too);
then rank 1 adds 1e-6 to one entry of 'dense_1/bias'. Each rank prints
``RAISED <rank>: <message>`` and the job exits 3, or ``NOT RAISED <rank>``.
"""

import sys

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from axonn_jax import Grid  # noqa: E402
from axonn_jax.health import check_replicas  # noqa: E402
from axonn_jax.models import MLP  # noqa: E402

x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
pm = axonn_jax.partition(MLP((32, 16)), Grid(data=2), x)
step = pm.train_step(lambda out, batch: (out**2).mean(), optax.adamw(1e-3))
params, opt_state = step.init(pm.init(jax.random.key(0)))
params, opt_state, _ = step(params, opt_state, x)
check_replicas(params, step=1)  # identical replicas: nothing to say
print(f"EQUAL {info.process_index}", flush=True)
if info.process_index == 1:
    bias = params["dense_1"]["bias"]
    local = np.asarray(bias.addressable_shards[0].data).copy()
    local[3] += 1e-6
    params["dense_1"]["bias"] = jax.make_array_from_single_device_arrays(
        bias.shape, bias.sharding, [jax.device_put(jnp.asarray(local), bias.addressable_shards[0].device)])
try:
    check_replicas(params, step=1)
except ValueError as err:
    print(f"RAISED {info.process_index}: {err}", flush=True)
    sys.exit(3)
print(f"NOT RAISED {info.process_index}", flush=True)

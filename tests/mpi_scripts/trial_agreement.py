"""Under mpiexec -n 2: a trial run of two checked configurations (8 devices over the ranks).

Each rank prints ``TRIAL <rank> <measured seconds of each> <first after rerank>``; the
measured times must be the same on every rank, or the ranks could pick different
configurations.
"""

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from axonn_jax.compiled_check import check_compiled, rerank  # noqa: E402
from axonn_jax.models import MLP  # noqa: E402
from axonn_jax.partitioner.grid import Grid  # noqa: E402
from axonn_jax.perf import machines  # noqa: E402
from axonn_jax.perf.step import predict  # noqa: E402
from axonn_jax.perf.traced import spec_from_model  # noqa: E402

model, inputs = MLP((64, 64, 16)), jax.ShapeDtypeStruct((16, 32), jnp.float32)
machine = machines.get("frontier")
spec = spec_from_model(model, inputs)
predictions = [predict(spec, grid, machine) for grid in (Grid(x=2, y=2, z=2), Grid(data=8))]
checks = check_compiled(model, (inputs,), predictions, limit_bytes=2**30, machine=machine, trial_steps=3)
first = rerank(checks)[0].prediction.grid
print("TRIAL", info.process_index, *(repr(c.measured) for c in checks), f"x={first.x},data={first.data}",
      flush=True)

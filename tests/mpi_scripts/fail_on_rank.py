"""Under mpiexec: one rank raises (or is killed) while the others wait in a collective.

Usage: fail_on_rank.py RANK [raise|kill]. The abort hook (or the launcher, for
a killed process) must end the whole job non-zero, never hang.
"""

import os
import signal
import sys

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

failing = int(sys.argv[1])
how = sys.argv[2] if len(sys.argv) > 2 else "raise"
mesh = jax.make_mesh((jax.device_count(),), ("d",))
ones = jax.make_array_from_callback(
    (jax.device_count(),), NamedSharding(mesh, P("d")), lambda i: jnp.ones(1)
)
if info.process_index == failing and how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if info.process_index == failing:
    raise RuntimeError(f"deliberate failure on rank {failing}")
# the other ranks block here in a cross-process collective forever without the hook
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(ones)
print("unexpectedly finished", total, flush=True)

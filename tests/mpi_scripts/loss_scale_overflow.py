"""Under mpiexec -n 2: an fp16 overflow on rank 1 only skips the step on both ranks.

Two ways the skip decision becomes global, each printed per rank as
``RANK r PATH injected=… finite=… unchanged=… scale=A->B then=C,D``:

* ``global``: one jit over global arrays (GPT on x=2, z=2, data=2 across the two
  processes, fp16 parameters, masters and AdamW state in host memory). Only
  rank 1 fills its shards of the per-example loss weights with a huge value, so
  only its fp16 gradient contributions overflow; the gradient reduction makes
  the flag global. Then two normal steps: the scale grows after the window.
* ``local``: process-local gradients (as pipeline stages on different ranks
  hold), the flags combined with :func:`axonn_jax.runtime.precision.mpi_all_finite`.
"""

import sys

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from axonn_jax.models import GPT, GPTConfig  # noqa: E402
from axonn_jax.runtime.master_optimizer import MasterOptimizer  # noqa: E402
from axonn_jax.runtime.precision import LossScale, all_finite, mpi_all_finite  # noqa: E402
from precision_cases import loss_scaled_step  # noqa: E402

assert info.distributed and jax.process_count() == 2, "run with mpiexec -n 2"
rank = info.process_index
INJECT = rank == 1


def local_copy(tree):
    return [np.asarray(s.data) for x in jax.tree.leaves(tree) for s in x.addressable_shards]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def report(path, finite, unchanged, first, then):
    line = (f"RANK {rank} {path} injected={'yes' if INJECT else 'no'} finite={finite} "
            f"unchanged={unchanged} scale={first} then={then}\n")  # fmt: skip
    sys.stdout.write(line)  # one write: lines of the two ranks do not interleave
    sys.stdout.flush()


# --- one jit over global arrays -------------------------------------------------
config = GPTConfig(vocab_size=64, num_layers=1, hidden=32, num_heads=4, max_seq_len=16)
tokens_np = ((np.arange(8)[:, None] * 3 + np.arange(16)) % 64).astype(np.int32)
pm = axonn_jax.partition(GPT(config), axonn_jax.Grid(x=2, z=2, data=2), tokens_np)
opt = MasterOptimizer(optax.adamw(1e-2), pm.param_shardings, precision="fp16", offload=True)
params, state = opt.init(pm.init(jax.random.key(0)))
batch = NamedSharding(pm.mesh, P(("data", "z")))
tokens = jax.make_array_from_callback(tokens_np.shape, batch, lambda i: tokens_np[i])


def weights(blow_up: bool):
    """Per-example loss weights; each process fills only its own shards."""
    value = 1e4 if blow_up else 1.0  # x 2**15: fp16 gradients overflow (max 65504)
    return jax.make_array_from_callback((8,), batch, lambda i: np.full(len(range(8)[i[0]]), value, np.float32))


step = loss_scaled_step(pm, opt)


scale = LossScale.create(2.0**14, growth_interval=2)
before = local_copy((params, state))
params, state, scale, finite = step(params, state, scale, tokens, weights(INJECT))
unchanged = same(local_copy((params, state)), before)
history = [2.0**14, float(scale.scale)]
for _ in range(2):
    params, state, scale, ok = step(params, state, scale, tokens, weights(False))
    assert bool(ok), "a step without injection overflowed"
    history.append(float(scale.scale))
report("global", bool(finite), unchanged, f"{history[0]}->{history[1]}", f"{history[2]},{history[3]}")

# --- process-local gradients, flags combined over MPI ---------------------------
here = jax.local_devices()[0]
local_params = jax.device_put(jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float16), here)
local_opt = optax.sgd(0.1)
local_state = local_opt.init(local_params.astype(jnp.float32))
scale = LossScale.create(2.0**14, growth_interval=2)
master = local_params.astype(jnp.float32)


def local_grads(p, scale, blow_up):
    factor = 1e4 if blow_up else 1.0
    return jax.grad(lambda q: scale.scale_loss(factor * jnp.sum(q.astype(jnp.float32) ** 2)))(p)


history = [float(scale.scale)]
for i, blow_up in enumerate([INJECT, False, False]):
    grads = local_grads(local_params, scale, blow_up)
    finite = mpi_all_finite(all_finite(grads))  # every rank gets the AND of both
    if finite:
        updates, local_state = local_opt.update(scale.unscale(grads), local_state)
        master = optax.apply_updates(master, updates)
    if i == 0:
        first_finite = finite
        unchanged = bool(jnp.array_equal(master, local_params.astype(jnp.float32)))
    scale = scale.update(finite)
    history.append(float(scale.scale))
report("local", first_finite, unchanged, f"{history[0]}->{history[1]}", f"{history[2]},{history[3]}")

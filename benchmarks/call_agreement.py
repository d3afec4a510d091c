"""The cost of the call agreement (runtime/pipeline/agreement.py) on a pipelined train step.

A/B in one run: blocks of steps with the agreement on and patched out, alternating (the
order flips every block), median step time of each. pipeline=2,x=2,z=2, a 4x128 MLP,
batch 32, 4 microbatches. Usage (BLOCKS STEPS_PER_BLOCK)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python benchmarks/call_agreement.py 10 20
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu mpiexec -n 2 python benchmarks/call_agreement.py 10 20
"""

import sys, time
import axonn_jax
info = axonn_jax.init()
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
from axonn_jax.runtime.pipeline import training

class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = nn.gelu(nn.Dense(128, name=f"d{i}")(x))
        return nn.Dense(8, name="out")(x)

r = np.random.default_rng(0)
b = (r.standard_normal((32, 64)).astype(np.float32), r.standard_normal((32, 8)).astype(np.float32))
pm = axonn_jax.partition(Net(), axonn_jax.Grid(pipeline=2, x=2, z=2), b[0])
step = pm.train_step(lambda o, bb: jnp.mean((o - bb[1]) ** 2), optax.sgd(0.01), microbatches=4, inputs=lambda bb: bb[:1])
params, st = step.init(pm.init(jax.random.key(0)))
real = training.agree_on_call
for _ in range(5):
    params, st, l = step(params, st, b)
times = {"on": [], "off": []}
blocks, per = int(sys.argv[1]), int(sys.argv[2])
for k in range(blocks):
    for mode in ("on", "off") if k % 2 == 0 else ("off", "on"):
        training.agree_on_call = real if mode == "on" else (lambda *a: None)
        t = time.perf_counter()
        for _ in range(per):
            params, st, l = step(params, st, b)
        float(l)
        times[mode].append((time.perf_counter() - t) / per)
if info.process_index == 0:
    on, off = np.median(times["on"]) * 1e3, np.median(times["off"]) * 1e3
    print(f"procs={info.process_count} step ms: with agreement {on:.2f}, without {off:.2f}, ratio {on/off:.4f} "
          f"(median of {blocks} blocks of {per} steps)", flush=True)

"""A user's own model computing in bf16, trained on a grid vs the plain single-device bf16 run.

Run as a script (``python bf16_compute_case.py GRID``, 8 simulated devices) it prints one
``RESULT <json>`` line; tests/test_bf16_compute.py runs it in a subprocess, because
the failure it guards against is an abort of the whole process inside XLA (exit 134),
which would take a pytest worker down with it.

The model: 4 ``nn.Dense(64, dtype=bfloat16)`` layers (fp32 parameters, bf16 compute),
a regression loss in fp32. The partitioned run is ``pm.train_step(..., precision="bf16",
offload=True)`` (bf16 parameters and gradients on the devices, fp32 masters and Adam
state in host memory). The reference does the same arithmetic on one device: bf16
parameters from fp32 masters, bf16 gradients, Adam on the fp32 masters.
"""

from __future__ import annotations

import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

BATCH, WIDTH, LAYERS, STEPS, LR = 32, 64, 4, 5, 1e-2
LEAVES = [(f"Dense_{i}", name) for i in range(LAYERS) for name in ("kernel", "bias")]


class BF16MLP(nn.Module):
    """The issue's model: ``nn.Dense(64, dtype=jnp.bfloat16)`` layers with ReLU between them."""

    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = nn.Dense(WIDTH, dtype=self.dtype)(x)
            if i < LAYERS - 1:
                x = nn.relu(x)
        return x


def batches() -> tuple[np.ndarray, np.ndarray]:
    """``STEPS`` batches of a smooth regression target."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS, BATCH, WIDTH)).astype(np.float32)
    w = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 8
    return x, np.tanh(x @ w)


def loss(out, batch):
    return jnp.mean((out.astype(jnp.float32) - batch[1]) ** 2)


def _bf16(tree):
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def reference(init, x, y, dtype=jnp.bfloat16) -> tuple[np.ndarray, dict]:
    """Plain Flax/optax on one device: the step losses and the first step's gradients."""
    model = BF16MLP(dtype)
    masters = jax.device_put(init, jax.devices()[0])
    opt = optax.adam(LR)
    state = opt.init(masters)

    def value_and_grad(params_bf16, xb, yb):
        return jax.value_and_grad(lambda p: loss(model.apply({"params": _f32(p)}, xb), (xb, yb)))(params_bf16)

    @jax.jit
    def step(masters, state, xb, yb):
        value, grads = value_and_grad(_bf16(masters), xb, yb)
        updates, state = opt.update(_f32(grads), state, masters)
        return optax.apply_updates(masters, updates), state, value

    first_grads = jax.jit(value_and_grad)(_bf16(masters), x[0], y[0])[1]
    losses = []
    for i in range(STEPS):
        masters, state, value = step(masters, state, x[i], y[i])
        losses.append(float(value))
    return np.array(losses), first_grads


def run(grid_text: str) -> dict:
    """Partitioned training and the references, reduced to what the test bounds."""
    import axonn_jax
    from axonn_jax.runtime.precision import as_planned

    x, y = batches()
    model = BF16MLP()
    pm = axonn_jax.partition(model, axonn_jax.Grid.parse(grid_text), x[0])
    init = pm.init(jax.random.key(0))
    full = pm.gather(init)
    # the first step's gradients, from the bf16 device parameters the step computes with
    step_params = _bf16(init)  # keeps each leaf's sharding
    out = pm.apply(as_planned(step_params, pm.plan), x[0])
    grads = pm.gather(pm.value_and_grad(loss, inputs=lambda b: (b[0],))(
        as_planned(step_params, pm.plan), (x[0], y[0]))[1])  # fmt: skip
    step = pm.train_step(loss, optax.adam(LR), inputs=lambda b: (b[0],), precision="bf16", offload=True)
    params, state = step.init(init)
    losses = []
    for i in range(STEPS):
        params, state, value = step(params, state, (x[i], y[i]))
        losses.append(float(value))
    ref_losses, ref_grads = reference(full, x, y)
    _, fp32_grads = reference(full, x, y, jnp.float32)

    def scaled_diff(a, b, path):  # max |a - b| over max |b| of one leaf
        a, b = (np.asarray(t[path[0]][path[1]], np.float32) for t in (a, b))
        return float(np.abs(a - b).max() / np.abs(b).max())

    return {
        "output_dtype": str(out.dtype),
        "device_param_dtype": str(jax.tree.leaves(params)[0].dtype),
        "losses": losses, "reference_losses": ref_losses.tolist(),
        "grad_diff": {"/".join(p): scaled_diff(grads, ref_grads, p) for p in LEAVES},
        "fp32_compute_grad_diff": {"/".join(p): scaled_diff(fp32_grads, ref_grads, p) for p in LEAVES},
    }  # fmt: skip


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(sys.argv[1])), flush=True)

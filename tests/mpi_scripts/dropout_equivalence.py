"""Under mpiexec -n 2: GPT-2 with dropout, and a BatchNorm net, on Grid(pipeline=2) equal the plain model.

Every rank computes the plain references itself (small model), then checks:
``pm.value_and_grad(..., rngs=)`` with 2 microbatches (gradient accumulation,
microbatch m drawing from fold_in(key, m)) on the leaves it holds, and 5
``pm.train_step`` AdamW steps with one dropout key per step (losses, and the
final parameters it holds). Prints "OK rank R" or the failures.
"""

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from partition_cases import LR, STEPS, _leaves, adamw_param_failures  # noqa: E402
from rng_cases import (KEY, accumulated_reference,  # noqa: E402
                       batchnorm_pipeline_failures, batchnorm_reference, dropout_loss,
                       plain_dropout_run)

assert info.distributed and jax.process_count() == 2, "expected mpiexec -n 2"
model, args, params, keys, (ref_losses, ref_first_grads, ref_final) = plain_dropout_run(STEPS)
grid = axonn_jax.Grid(pipeline=2)
pm = axonn_jax.partition(model, grid, *args, deterministic=False, rngs={"dropout": KEY})
failures = []


def compare(label, got_tree, ref_tree, bound):
    got = {p: v for p, v in _leaves_or_none(got_tree).items() if v is not None}
    if not got:
        failures.append(f"{label}: this rank holds no leaves")
    ref = _leaves(ref_tree)
    for path, value in got.items():
        err = np.max(np.abs(np.asarray(value) - ref[path]))
        if err > bound(ref[path]):
            failures.append(f"{label} {path}: max |Δ| {err:.3e} > {bound(ref[path]):.3e}")


def _leaves_or_none(tree):
    flat = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: x is None)
    from axonn_jax.partitioner.trace import path_string

    return {path_string(p): v for p, v in flat}


ref_loss, ref_grads = accumulated_reference(model, params, args, keys[1], 2)
step = pm.value_and_grad(lambda out, batch: dropout_loss(out, batch[0]), microbatches=2)
loss, grads = step(pm.shard(params), args, rngs={"dropout": keys[1]})
if abs(float(loss) - ref_loss) > 1e-5 * abs(ref_loss):
    failures.append(f"value_and_grad loss {float(loss)} != {ref_loss}")
scale = max(np.max(np.abs(g)) for g in _leaves(ref_grads).values())
compare("grad", grads, ref_grads, lambda r: 1e-5 * np.max(np.abs(r)) + 1e-6 * scale)

train = pm.train_step(lambda out, batch: dropout_loss(out, batch[0]), optax.adamw(LR))
p, s = train.init(pm.shard(params))
losses = []
for key in keys:
    p, s, loss = train(p, s, args, rngs={"dropout": key})
    losses.append(float(loss))
if not np.allclose(losses, ref_losses, rtol=1e-5, atol=0):
    failures.append(f"train_step losses {losses} != {ref_losses}")
held = {path: v for path, v in _leaves_or_none(p).items() if v is not None}
failures += adamw_param_failures(held, ref_final, ref_first_grads, params)

# model state on the same pipeline: BatchNorm statistics stay with (and are updated on) their stage
x, y, variables, bn_losses, bn_final = batchnorm_reference(3, 2)
failures += [f"batchnorm: {f}" for f in batchnorm_pipeline_failures(grid, 2, x, y, variables,
                                                                    bn_losses, bn_final)]  # fmt: skip
if failures:
    print(f"FAIL rank {info.process_index}:\n  " + "\n  ".join(failures), flush=True)
    raise SystemExit(1)
print(f"OK rank {info.process_index} dropout {grid}", flush=True)

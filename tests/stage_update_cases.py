"""Optimizers that combine pipeline stages, against plain single-device optax.

Shared by ``test_stage_update.py`` (one process) and
``mpi_scripts/stage_update_equivalence.py`` (one stage per process). The bounds
are those of ``pipeline_cases``: loss |Δ| ≤ 1e-5·|ref| at every step, and after
every step ‖Δ‖₂ ≤ 1e-3·‖p_ref − p₀‖₂ per parameter (``compare_params``).
Per-stage clipping misses these by orders of magnitude (loss off by ~1e-4
relative after two steps).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from pipeline_cases import compare_params, partitioned

import axonn_jax

MICROBATCHES, STEPS, CLIP = 2, 4, 0.05


def log_grad_norm() -> optax.GradientTransformation:
    """Keeps ``optax.tree.norm`` of the incoming gradients in its state (a shared entry)."""

    def init(params):
        del params
        return {"grad_norm": np.zeros((), np.float32)}

    def update(updates, state, params=None):
        del state, params
        return updates, {"grad_norm": optax.tree.norm(updates)}

    return optax.GradientTransformation(init, update)


OPTIMIZERS = {
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(1e-2)),
    "multisteps_logged": lambda: optax.MultiSteps(
        optax.chain(log_grad_norm(), optax.clip_by_global_norm(CLIP), optax.adamw(1e-2)), every_k_schedule=2),
    # leaf-wise, but its noise is split from one key by the leaves of the whole tree
    "noisy_sgd": lambda: optax.noisy_sgd(1e-2, eta=0.1, key=0),
    # leaf-wise, its state per parameter a list of accumulators (one per dim), not a mirror
    "sm3": lambda: optax.sm3(1e-2),
    # leaf-wise; its labels read the parameters' keys (optax's placeholder has none)
    "multi_transform_by_key": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2, momentum=0.9)},
        lambda params: {k: jax.tree.map(lambda _, k=k: "sgd" if k == "embed" else "adam", v)
                        for k, v in params.items()}),
}  # fmt: skip
#: those whose update runs per stage (each stage's leaves alone are exact)
PER_STAGE = ("sm3", "multi_transform_by_key")


def logged_norm(state) -> float | None:
    """The norm :func:`log_grad_norm` kept in a ``multisteps_logged`` state (else ``None``)."""
    if not isinstance(state, optax.MultiStepsState):
        return None
    return float(np.asarray(state.inner_opt_state[0]["grad_norm"].addressable_data(0)))


def plain(case, optimizer, batch, steps: int = STEPS):
    """Plain Flax + optax on one device, as numpy.

    Returns (initial params, first gradients, losses, params after each step,
    gradient norms, logged norms).
    """
    args = case.inputs(batch)
    params = case.model.init(jax.random.key(0), *args)["params"]

    def loss_fn(p):
        return case.loss(case.model.apply({"params": p}, *args), batch)

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, grads

    state, losses, trajectory, norms, logged = optimizer.init(params), [], [], [], []
    p, first = params, None
    for _ in range(steps):
        p, state, loss, grads = step(p, state)
        first = first or jax.tree.map(np.asarray, grads)
        losses.append(float(loss))
        trajectory.append(jax.tree.map(np.asarray, p))
        norms.append(float(optax.tree.norm(grads)))
        logged.append(logged_norm(state))
    return jax.tree.map(np.asarray, params), first, losses, trajectory, norms, logged


def run(grid: axonn_jax.Grid, name: str, precision: str = "fp32") -> list[str]:
    """Failure messages of ``OPTIMIZERS[name]`` on ``grid`` against :func:`plain`."""
    case, pm = partitioned("gpt", grid)
    batch = case.batch(MICROBATCHES)
    init, first, losses, trajectory, norms, logged = plain(case, OPTIMIZERS[name](), batch)
    failures = [] if min(norms) > CLIP else [f"the clip never triggers: norms {norms}"]
    step = pm.train_step(case.loss, OPTIMIZERS[name](), inputs=case.inputs, microbatches=MICROBATCHES,
                         precision=precision)  # fmt: skip
    params, opt_state = step.init(pm.shard(init))
    if (step.across_stages is None) != (name in PER_STAGE):
        failures.append(f"{name} on {grid} ran {'per stage' if step.across_stages is None else 'in rounds'}")
    for k in range(STEPS):
        params, opt_state, loss = step(params, opt_state, batch)
        what = f"{name} {grid} step {k + 1}"
        if abs(float(loss) - losses[k]) > 1e-5 * abs(losses[k]):
            failures.append(f"{what} loss {float(loss)} != {losses[k]}")
        failures += compare_params(pm.gather(params), trajectory[k], init, first, what)
        for s, state in opt_state.optimizer.items():  # every stage's copy of the shared entry
            got = logged_norm(state.inner)
            if got is not None and abs(got - logged[k]) > 1e-5 * logged[k]:
                failures.append(f"{what} stage {s} logged grad norm {got} != {logged[k]}")
    return failures

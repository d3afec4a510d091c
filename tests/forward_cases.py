"""Forward-only pipelined passes against the plain model: shared by one process and mpiexec.

Each function returns a list of failures (empty when the partitioned forward
equals the plain model within ``test_forward``'s bounds, rtol = atol = 1e-5).
Under mpiexec every rank checks the outputs (they reach every process) and the
state leaves it holds.
"""

import jax
import numpy as np
from partition_cases import build, reference_apply, _leaves
from flax import nnx
from rng_cases import KEY, DeepBN, NNXNet, gpt2_with_dropout

import axonn_jax

RTOL = ATOL = 1e-5


def _compare(label, got_tree, ref_tree) -> list[str]:
    got, ref = jax.tree.leaves(got_tree), jax.tree.leaves(ref_tree)
    if len(got) != len(ref) or jax.tree.structure(got_tree) != jax.tree.structure(ref_tree):
        return [f"{label}: structure {jax.tree.structure(got_tree)} != {jax.tree.structure(ref_tree)}"]
    failures = []
    for k, (a, b) in enumerate(zip(got, ref)):
        b = np.asarray(b)
        if not isinstance(a, np.ndarray) or a.shape != b.shape:
            failures.append(f"{label} leaf {k}: {type(a).__name__} {np.shape(a)} != host {b.shape}")
        elif not np.allclose(a, b, rtol=RTOL, atol=ATOL):
            failures.append(f"{label} leaf {k}: max |Δ| {np.max(np.abs(a - b)):.3e}")
    return failures


def forward_failures(name: str, grid: axonn_jax.Grid, microbatches: int) -> list[str]:
    """``pm.forward`` (and ``pm.apply`` for one microbatch) of a partition case vs ``model.apply``."""
    case = build(name)
    params, plain = reference_apply(case)
    ref = plain(params, *case.args)
    batch = case.args[0].shape[0]
    example = [a[: batch // microbatches] if hasattr(a, "shape") else a for a in case.args]
    pm = axonn_jax.partition(case.model, grid, *example)
    placed = pm.shard(params)
    label = f"{name} {grid} mb={microbatches}"
    failures = _compare(label, pm.forward(placed, *case.args, microbatches=microbatches), ref)
    if microbatches == 1:
        failures += _compare(f"{label} pm.apply", pm.apply(placed, *case.args), ref)
    return failures


def dropout_forward_failures(grid: axonn_jax.Grid) -> list[str]:
    """GPT-2 with dropout on: the RNG key is one more call input; the masks are the plain model's."""
    model, args = gpt2_with_dropout()
    params = model.init(jax.random.key(0), *args)["params"]
    ref = model.apply({"params": params}, *args, deterministic=False, rngs={"dropout": KEY})
    pm = axonn_jax.partition(model, grid, *args, deterministic=False, rngs={"dropout": KEY})
    got = pm.apply(pm.shard(params), *args, deterministic=False, rngs={"dropout": KEY})
    return _compare(f"dropout {grid}", got, ref)


def batchnorm_forward_failures(grid: axonn_jax.Grid, microbatches: int) -> list[str]:
    """``mutable=['batch_stats']``: outputs on every process; new statistics (mean over the
    microbatches) as device arrays on the stage that holds them, ``None`` elsewhere."""
    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    model = DeepBN()
    variables = jax.tree.map(lambda v: v + 0.5, model.init(jax.random.key(0), x, train=False))
    size = len(x) // microbatches
    parts = [model.apply(variables, x[i * size : (i + 1) * size], mutable=["batch_stats"])
             for i in range(microbatches)]  # fmt: skip
    ref_out = np.concatenate([np.asarray(out) for out, _ in parts])
    ref_stats = jax.tree.map(lambda *s: sum(s) / microbatches, *[u for _, u in parts])
    pm = axonn_jax.partition(model, grid, x[:size], mutable=["batch_stats"])
    out, updates = pm.forward(pm.shard(variables), x, mutable=["batch_stats"],
                              microbatches=microbatches)  # fmt: skip
    label = f"batchnorm {grid} mb={microbatches}"
    failures = _compare(label, out, ref_out)
    got = {p: v for p, v in _leaves_or_none(updates).items() if v is not None}
    if not got:
        failures.append(f"{label}: this process holds no updated statistics")
    ref = _leaves(ref_stats)
    for path, value in got.items():
        if not isinstance(value, jax.Array):
            failures.append(f"{label} {path}: {type(value).__name__}, not a device array")
        elif not np.allclose(np.asarray(value), ref[path], rtol=RTOL, atol=ATOL):
            failures.append(f"{label} {path}: max |Δ| {np.max(np.abs(value - ref[path])):.3e}")
    return failures


def nnx_state_forward_failures(grid: axonn_jax.Grid) -> list[str]:
    """An nnx model with state (BatchStat, a Dropout stream) returns ``(outputs, {'state': new})``:
    the module's outputs, statistics and advanced RNG counter, as calling it does."""
    x = np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32)
    model = NNXNet(nnx.Rngs(0, dropout=7))
    pm = axonn_jax.partition(model, grid, x)
    variables = pm.init(jax.random.key(0))
    out, updates = pm.apply(variables, x)
    ref_out = model(x)  # advances the module's statistics and RNG counter
    label = f"nnx state {grid}"
    failures = _compare(label, out, ref_out)
    got = {p: v for p, v in _leaves_or_none(updates["state"]).items() if v is not None}
    ref = _leaves(jax.tree.map(_key_data, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))))
    if not got and jax.process_count() == 1:  # under mpiexec stage 0's process holds it all
        failures.append(f"{label}: no state returned")
    for path, value in got.items():
        if not np.allclose(np.asarray(value), ref[path], rtol=RTOL, atol=ATOL):
            failures.append(f"{label} {path}: {np.asarray(value).ravel()[:3]} != {ref[path].ravel()[:3]}")
    return failures


def _key_data(x):
    """A typed PRNG key as its raw bits (as the partitioned model's state holds it)."""
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _leaves_or_none(tree) -> dict:
    from axonn_jax.partitioner.trace import path_string

    flat = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: x is None)
    return {path_string(p): v for p, v in flat}

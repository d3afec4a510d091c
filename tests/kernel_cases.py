"""Hand-wired 4D versions of two Flax models, built from ``tests/kernels4d.py``.

Shared by ``test_kernels.py`` (one process, 8 devices) and
``mpi_scripts/kernel_equivalence.py`` (2 processes × 4 devices). Each case
returns the reference (plain Flax, one device) and the 4D results as NumPy
arrays: output, loss, and gradients of every parameter (and of the input).
"""

from __future__ import annotations

import functools
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax import Grid
from axonn_jax.runtime.mesh import stage_meshes
from axonn_jax.partitioner.grid import X, Y
from kernel_specs import activation_spec, embedding_spec, weight_spec
import kernels4d as K

HIDDEN, FFN, VOCAB = 32, 64, 64


class MLP(nn.Module):
    hidden: int = HIDDEN
    ffn: int = FFN

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(self.ffn, name="up")(x))
        return nn.Dense(self.hidden, name="down")(h)


class Block(nn.Module):
    """embedding → LayerNorm → MLP → projection to the vocabulary."""

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(VOCAB, HIDDEN, name="embed")(ids)
        h = nn.LayerNorm(epsilon=1e-6, name="norm")(h)
        h = MLP(name="mlp")(h)
        return nn.Dense(VOCAB, use_bias=False, name="proj")(h)


def mlp_specs():
    return {
        "up": {"kernel": weight_spec(2), "bias": P(X)},
        "down": {"kernel": weight_spec(2, transposed=True), "bias": P(Y)},
    }


def mlp_4d(p, x):
    """Input features over y → (normal) over x → (transposed) back over y."""
    h = K.add_bias(K.linear(x, p["up"]["kernel"]), p["up"]["bias"])
    h = nn.gelu(h)
    return K.add_bias(K.linear(h, p["down"]["kernel"], transposed=True), p["down"]["bias"])


def block_specs():
    return {
        "embed": {"embedding": embedding_spec()},
        "norm": {"scale": P(Y), "bias": P(Y)},
        "mlp": mlp_specs(),
        "proj": {"kernel": weight_spec(2)},
    }


def block_4d(p, ids):
    h = K.embed(ids, p["embed"]["embedding"])
    h = K.layer_norm(
        h, p["norm"]["scale"], p["norm"]["bias"], feature_axis=Y, features=HIDDEN, epsilon=1e-6
    )
    h = mlp_4d(p["mlp"], h)
    return K.linear(h, p["proj"]["kernel"])


CASES = {
    # name: (module, 4D fn, param specs, input maker, input spec, output spec, diff input)
    "mlp": (
        MLP(),
        mlp_4d,
        mlp_specs,
        lambda rng: rng.standard_normal((16, HIDDEN)).astype(np.float32),
        activation_spec(2, {-1: Y}),
        activation_spec(2, {-1: Y}),
        True,
    ),
    "block": (
        Block(),
        block_4d,
        block_specs,
        lambda rng: rng.integers(0, VOCAB, size=(8, 4)).astype(np.int32),
        activation_spec(2),
        activation_spec(3, {-1: X}),
        False,
    ),
}


def place(value: np.ndarray, mesh, spec) -> jax.Array:
    """Put a full host array into ``spec`` on ``mesh`` (works across processes)."""
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda i: value[i])


def fetch(array: jax.Array) -> np.ndarray:
    """A (possibly multi-process) array back as a full host array on every process."""
    if array.is_fully_addressable:
        return np.asarray(array)
    replicated = NamedSharding(array.sharding.mesh, P())
    return np.asarray(jax.jit(lambda a: a, out_shardings=replicated)(array).addressable_data(0))


@functools.cache
def reference_of(name: str, seed: int = 0) -> tuple[dict, np.ndarray, np.ndarray, dict]:
    """Plain Flax on one device, once per case: ``(params, inputs, probe, reference)``.

    The reference maps ``out``, ``loss``, ``loss_terms`` and ``grad…`` to NumPy
    arrays; every grid the case runs on is compared against the same one.
    """
    module, _, _, make_input, _, _, diff_input = CASES[name]
    rng = np.random.default_rng(seed)
    inputs = make_input(rng)
    params = jax.tree.map(np.asarray, module.init(jax.random.key(seed), inputs)["params"])
    out_shape = jax.eval_shape(lambda p, a: module.apply({"params": p}, a), params, inputs).shape
    probe = rng.standard_normal(out_shape).astype(np.float32)

    def ref_loss(p, a):
        out = module.apply({"params": p}, a)
        return jnp.sum(out * probe), out

    (value, out), grads = jax.value_and_grad(ref_loss, (0, 1) if diff_input else 0,
                                             has_aux=True)(params, inputs)  # fmt: skip
    reference = {
        "out": np.asarray(out),
        "loss": np.asarray(value),
        # the loss is a cancelling sum: its error is bounded relative to sum |terms|
        "loss_terms": np.asarray(np.sum(np.abs(np.asarray(out) * probe))),
        **_grad_entries(grads, diff_input, np.asarray),
    }
    return params, inputs, probe, reference


def _grad_entries(tree, diff_input: bool, to_numpy) -> dict[str, np.ndarray]:
    param_grads, input_grad = tree if diff_input else (tree, None)
    entries = {"grad" + jax.tree_util.keystr(path): to_numpy(leaf)
               for path, leaf in jax.tree_util.tree_leaves_with_path(param_grads)}  # fmt: skip
    if input_grad is not None:
        entries["grad_input"] = to_numpy(input_grad)
    return entries


def run_case(name: str, grid: Grid, devices=None, seed: int = 0):
    """Return ``(reference, sharded)``, each a dict of NumPy arrays."""
    _, fn4d, specs_fn, _, in_spec, out_spec, diff_input = CASES[name]
    params, inputs, probe, reference = reference_of(name, seed)
    mesh = stage_meshes(grid, devices)[0]
    specs = specs_fn()
    sharded_params = jax.tree.map(lambda v, s: place(v, mesh, s), params, specs)
    sharded_inputs = place(inputs, mesh, in_spec)
    sharded_probe = place(probe, mesh, out_spec)
    forward = jax.shard_map(fn4d, mesh=mesh, in_specs=(specs, in_spec), out_specs=out_spec)

    def loss(p, a, probe_):
        out = forward(p, a)
        return jnp.sum(out * probe_), out

    step = jax.jit(jax.value_and_grad(loss, (0, 1) if diff_input else 0, has_aux=True))
    (value, out), grads = step(sharded_params, sharded_inputs, sharded_probe)
    sharded = {"out": fetch(out), "loss": fetch(value), **_grad_entries(grads, diff_input, fetch)}
    return dict(reference), sharded


def max_scaled_error(reference: dict, sharded: dict) -> dict[str, float]:
    """Per entry: max |a-b| / max(|b|max, tiny) — the quantity the tests bound."""
    errors = {}
    for key, ref in reference.items():
        if key == "loss_terms":
            continue
        scale = reference["loss_terms"] if key == "loss" else np.max(np.abs(ref))
        scale = max(float(scale), 1e-30)
        errors[key] = float(np.max(np.abs(sharded[key] - ref))) / scale
    return errors

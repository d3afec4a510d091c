"""Models written as their communities write them, on the grids where each idiom is at stake.

Gemma's nnx attention with a stacked ``kv_einsum`` or fused ``qkv_einsum``
kernel, a jraph-style graph net (``segment_sum`` over senders/receivers), a
ResNet whose BatchNorms average over ``axis_name='batch'`` (data-parallel
code written for ``pmap``), in train mode. Each: no fallback and no warning,
redundancy ≤ 1.05 (``pm.report().compute``), and the loss, every gradient and
the parameters (and statistics) after AdamW steps equal the plain model's
(the bounds of ``test_partition.py``). The graph net runs through
``pm.apply`` inside the user's jitted ``jax.value_and_grad`` (its batch leaves
have different leading dims: nodes, edges, graphs).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import spread
from flax import linen as nn
from flax import nnx
from idiom_cases import (IMAGES, GemmaBlock, GraphNet, ResNetBN, SpectralDiscriminator, gemma_inputs,
                         gpt_with_dropout, graph_batch)  # fmt: skip
from partition_cases import (LR, STEPS, Case, _leaves, adamw_param_failures, adamw_trajectory,
                             assert_matches_reference, optimizer_state, reference_apply)  # fmt: skip

import axonn_jax
from axonn_jax import Grid

#: the five grids of this table (8 devices each; every axis is split in some of them)
GRIDS = ["x=2,y=2,z=2", "x=4,data=2", "z=2,data=4", "x=2,z=2,data=2", "y=2,z=2,data=2"]
#: where a batch idiom (graph batches, batch statistics) is at stake: the batch split twice
DATA_GRIDS = ["z=2,data=4", "y=2,z=2,data=2"]
#: where dropout's masks are at stake: the activations split over x (and y)
TENSOR_GRIDS = ["x=2,y=2,z=2", "x=4,data=2"]


#: plain trajectories by case name, computed once per process (they do not depend on the grid)
_PLAIN: dict = {}


def _plain_trajectory(name: str, case: Case):
    """(initial params, AdamW trajectory) of the plain model of ``case``, cached under ``name``."""
    if name not in _PLAIN:
        params, apply = reference_apply(case)
        _PLAIN[name] = params, adamw_trajectory(lambda p: case.loss(apply(p, *case.args), *case.args), params)
    return _PLAIN[name]


def _plain_and_partitioned(name: str, case: Case, grid: str):
    """(pm, result) of AdamW on the plain model and on ``pm.apply`` (``assert_matches_reference``);
    ``name`` identifies the case (model, inputs and loss) for the cache of its plain trajectory."""
    params, ref = _plain_trajectory(name, case)
    pm = axonn_jax.partition(case.model, Grid.parse(grid), *case.args)
    part = adamw_trajectory(lambda p: case.loss(pm.apply(p, *case.args), *case.args), pm.shard(params), pm=pm)
    result = {"init": params, "ref": (ref[0], jax.tree.map(np.asarray, ref[1]), jax.tree.map(np.asarray, ref[2])),
              "part": (part[0], pm.gather(part[1]), pm.gather(part[2]))}  # fmt: skip
    return pm, result


def _assert_split_without_repeats(pm, label: str) -> None:
    assert pm.plan.warnings == (), (label, pm.plan.warnings)
    report = pm.report().compute
    assert report.redundancy <= 1.05, (label, report.redundancy, report.repeated(3))


# --- Gemma: stacked k|v and fused qkv kernels -----------------------------------------


def _gemma(fused: bool) -> Case:
    args = gemma_inputs()
    model = GemmaBlock(num_kv_heads=8 if fused else 4, fused_qkv=fused, rngs=nnx.Rngs(0))
    return Case(model, args, lambda out, *_: jnp.mean(out**2))


@pytest.mark.parametrize("fused,grid", spread([False, True], GRIDS, per_name=3),
                         ids=lambda v: {False: "kv_einsum", True: "qkv_einsum"}.get(v, v))
def test_gemma_attention_splits_heads_not_the_stack(grid, fused, devices):
    pm, result = _plain_and_partitioned(f"gemma fused={fused}", _gemma(fused), grid)
    params = {p.path: p for p in pm.plan.params}
    stacked = params["attn/qkv_einsum/w" if fused else "attn/kv_einsum/w"]  # (stack, heads, D, H)
    assert stacked.storage[0] == (), stacked.storage  # k|v (q|k|v) stay together on each device
    if pm.grid.x > 1:
        assert "x" in stacked.storage[1], stacked.storage  # the heads are split
    tensor = pm.grid.x * pm.grid.y * pm.grid.z
    for path in [stacked.path, "mlp/gating_einsum", "attn/attn_vec_einsum/w"]:  # (2, D, F): [0], [1]
        p = params[path]
        assert np.prod(p.local_shape(pm.grid)) * tensor == np.prod(p.shape), (path, p.storage)
    _assert_split_without_repeats(pm, f"gemma {grid}")
    assert_matches_reference(result, f"gemma {grid}")


# --- a jraph-style graph net: segment_sum, node lookups by edge ---------------------------


@pytest.mark.parametrize("grid", DATA_GRIDS)
def test_graph_net_splits_nodes_edges_and_graphs(grid, devices):
    """Edges, nodes and graphs each split over the batch axes, features over x and y."""
    batch = graph_batch()
    target = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)
    case = Case(GraphNet(), batch, lambda out, *_: jnp.mean((out - target) ** 2))
    pm, result = _plain_and_partitioned("graph net", case, grid)
    _assert_split_without_repeats(pm, f"graph net {grid}")
    assert_matches_reference(result, f"graph net {grid}")


# --- BatchNorm(axis_name='batch'): global-batch statistics ---------------------------------

LABELS = np.arange(8) % 8


def _ce(logits):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), LABELS[:, None], axis=-1))


def _bn_trajectory(step_fn, variables, steps: int, pm=None):
    """AdamW steps of ``step_fn(params, state) -> ((loss, updates), grads)`` on a variables dict
    (``pm``: the state laid out by ``partition_cases.optimizer_state``)."""
    optimizer = optax.adamw(LR)

    @jax.jit
    def step(v, s):
        (loss, updates), grads = step_fn(v["params"], {k: x for k, x in v.items() if k != "params"})
        delta, s = optimizer.update(grads, s, v["params"])
        return {**v, "params": optax.apply_updates(v["params"], delta), **updates}, s, loss, grads

    v, s, losses, first = variables, optimizer_state(optimizer, variables["params"], pm), [], None
    for _ in range(steps):
        v, s, loss, grads = step(v, s)
        losses.append(float(loss))
        first = grads if first is None else first
    return losses, first, v


@pytest.fixture(scope="module")
def bn_reference():
    """The model as its authors run it on one device (a size-1 ``'batch'`` axis over the whole
    batch), and the same model without ``axis_name``: one and the same trajectory."""
    model = ResNetBN(num_classes=8)
    variables = jax.tree.map(np.asarray, model.init(jax.random.key(0), IMAGES, train=False))

    def one_device(p, state):
        def run(x):
            return model.apply({**state, "params": p}, x, mutable=["batch_stats"])

        out, updates = jax.vmap(run, axis_name="batch")(IMAGES[None])
        return _ce(out[0]), jax.tree.map(lambda a: a[0], updates)

    ref = _bn_trajectory(jax.value_and_grad(one_device, has_aux=True), variables, STEPS)
    plain = ResNetBN(num_classes=8, axis_name=None)

    def whole_batch(p, state):
        out, updates = plain.apply({**state, "params": p}, IMAGES, mutable=["batch_stats"])
        return _ce(out), updates

    same = _bn_trajectory(jax.value_and_grad(whole_batch, has_aux=True), variables, STEPS)
    np.testing.assert_allclose(ref[0], same[0], rtol=1e-6)
    return model, variables, ref


@pytest.mark.parametrize("grid", DATA_GRIDS)
def test_batchnorm_axis_name_gives_global_batch_statistics(grid, bn_reference, devices):
    model, variables, (ref_losses, ref_grads, ref_final) = bn_reference
    pm = axonn_jax.partition(model, Grid.parse(grid), IMAGES, mutable=["batch_stats"])
    assert pm.program.traced.axis_names == ("batch",)
    _assert_split_without_repeats(pm, f"resnet {grid}")

    def part(p, state):
        out, updates = pm.apply({**state, "params": p}, IMAGES, mutable=["batch_stats"])
        return _ce(out), updates

    placed = pm.shard(variables)
    losses, grads, final = _bn_trajectory(jax.value_and_grad(part, has_aux=True), placed, STEPS, pm=pm)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = _leaves(pm.gather({**placed, "params": grads})["params"])
    want = _leaves(ref_grads)
    scale = max(np.max(np.abs(g)) for g in want.values())
    for path, g in want.items():
        np.testing.assert_allclose(got[path], g, rtol=0, err_msg=path,
                                   atol=1e-5 * np.max(np.abs(g)) + 1e-6 * scale)  # fmt: skip
    final = _leaves(pm.gather(final))
    failures = adamw_param_failures({k: v for k, v in final.items() if k.startswith("params/")},
                                    ref_final, {"params": ref_grads}, variables)  # fmt: skip
    assert not failures, failures
    start = _leaves(variables)
    for path, ref in _leaves(ref_final).items():  # running statistics after STEPS steps
        if path.startswith("batch_stats/"):
            err = np.linalg.norm(final[path] - ref)
            assert err <= 1e-3 * np.linalg.norm(ref - start[path]) + 1e-6, (path, err)


def test_model_collectives_over_its_own_axis_are_the_identity(devices):
    """``pmean``/``pmax``/``axis_index`` over the model's axis: as on one device, on every grid."""

    class Stats(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(16)(x)
            mean = jax.lax.pmean(h.mean(axis=0), "replica")
            top = jax.lax.pmax(jnp.abs(h).max(), "replica")
            return (h - mean) / top + jax.lax.axis_index("replica")

    x = np.random.default_rng(3).standard_normal((8, 12)).astype(np.float32)
    model = Stats()
    variables = jax.vmap(lambda a: model.init(jax.random.key(0), a), axis_name="replica")(x[None])
    params = jax.tree.map(lambda a: a[0], variables)["params"]
    want = jax.vmap(lambda a: model.apply({"params": params}, a), axis_name="replica")(x[None])[0]
    for grid in ["x=2,y=2,z=2", "z=2,data=4"]:
        pm = axonn_jax.partition(model, Grid.parse(grid), x)
        assert pm.plan.fallbacks == () and pm.program.traced.axis_names == ("replica",)
        got = jax.jit(pm.apply)(pm.shard(params), x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# --- dropout: the bits split like the activation they mask ---------------------------------


@pytest.fixture(scope="module")
def gpt_dropout_reference():
    """The repo's GPT with dropout 0.1 (embeddings, attention weights, residual branches)."""
    from rng_cases import KEY, dropout_trajectory

    from axonn_jax.models import next_token_loss

    model, tokens = gpt_with_dropout()
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), tokens)["params"])
    keys = [jax.random.fold_in(KEY, t) for t in range(STEPS)]

    def plain(p, t, rngs):
        return model.apply({"params": p}, t, deterministic=False, rngs=rngs)

    ref = dropout_trajectory(plain, params, (tokens,), keys, next_token_loss)
    no_dropout = next_token_loss(model.apply({"params": params}, tokens), tokens)
    assert abs(float(no_dropout) - ref[0][0]) > 1e-3  # dropout really is on
    return model, tokens, params, keys, ref


@pytest.mark.parametrize("grid", TENSOR_GRIDS)
def test_gpt_with_dropout_splits_its_masks(grid, gpt_dropout_reference, devices):
    """The repo's GPT with dropout 0.1: the plain masks bit for bit, nothing repeated."""
    from rng_cases import KEY, dropout_trajectory

    from axonn_jax.models import next_token_loss

    model, tokens, params, keys, ref = gpt_dropout_reference
    pm = axonn_jax.partition(model, Grid.parse(grid), tokens, deterministic=False,
                             rngs={"dropout": KEY})  # fmt: skip
    _assert_split_without_repeats(pm, f"gpt+dropout {grid}")

    def part(p, t, rngs):
        return pm.apply(p, t, deterministic=False, rngs=rngs)

    losses, grads, final = dropout_trajectory(part, pm.shard(params), (tokens,), keys, next_token_loss, pm=pm)
    result = {"init": params, "ref": (ref[0], jax.tree.map(np.asarray, ref[1]), jax.tree.map(np.asarray, ref[2])),
              "part": (losses, pm.gather(grads), pm.gather(final))}  # fmt: skip
    assert_matches_reference(result, f"gpt+dropout {grid}")


class _Member(nn.Module):
    """One member of an ensemble whose members share statistics over ``'ens'``."""

    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=False, axis_name="ens")(nn.tanh(nn.Dense(16)(x)))
        energy = jax.lax.psum(jnp.mean(h**2), "ens")  # summed over the members
        peak = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(h, axis=1, keepdims=True)), "ens")  # JAX: no pmax jvp
        return nn.Dense(4)(h * peak) / energy


class _Ensemble(nn.Module):
    """``nn.vmap`` of four members with ``axis_name``, then a ``jax.vmap`` over the rows with
    one: JAX turns their collectives into ones over the mapped dims (``psum[axes=(0,)]``)."""

    @nn.compact
    def __call__(self, x):
        members = nn.vmap(_Member, variable_axes={"params": 0, "batch_stats": 0}, split_rngs={"params": True},
                          in_axes=None, axis_size=4, axis_name="ens")  # fmt: skip
        out = members(name="ens")(x).mean(0)
        return jax.vmap(lambda row: row - jax.lax.pmean(row, "rows"), axis_name="rows")(out)


@pytest.mark.parametrize("grid", ["x=2,y=2,z=2", "z=2,data=4"])
def test_collectives_over_a_vmapped_axis_sum_its_members(grid, devices):
    """A collective over an axis name that ``vmap`` maps is a sum (max) over the mapped dim,
    not the identity of the model's own axis names: loss, every gradient and the batch
    statistics equal the plain model's. Before, ``psum[axes=(0,)]`` was planned as the
    identity: the members' energies unsummed (silently, for a scalar), or a shape error."""
    x = np.random.default_rng(5).standard_normal((8, 12)).astype(np.float32)
    model = _Ensemble()
    variables = jax.tree.map(np.asarray, model.init(jax.random.key(0), x))

    def loss(apply, v):
        out, updates = apply(v, x, mutable=["batch_stats"])
        return jnp.mean(out**2), updates

    (want, want_stats), want_grads = jax.value_and_grad(loss, argnums=1, has_aux=True)(model.apply, variables)
    pm = axonn_jax.partition(model, Grid.parse(grid), x, mutable=["batch_stats"])
    assert pm.plan.fallbacks == ()
    placed = pm.shard(variables)
    (got, got_stats), got_grads = jax.jit(jax.value_and_grad(lambda v: loss(pm.apply, v), has_aux=True))(placed)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for tree_got, tree_want in ((pm.gather(got_grads)["params"], want_grads["params"]),
                                (pm.gather({**placed, **got_stats})["batch_stats"], want_stats["batch_stats"])):
        scale = max(np.max(np.abs(w)) for w in _leaves(tree_want).values())
        for path, w in _leaves(tree_want).items():  # (the last bias's gradient is 0: rows centred)
            np.testing.assert_allclose(_leaves(tree_got)[path], w, rtol=0, err_msg=path,
                                       atol=1e-5 * np.max(np.abs(w)) + 1e-6 * scale)  # fmt: skip


def test_a_collective_without_a_one_device_meaning_is_refused():
    class Scatter(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jax.lax.psum_scatter(nn.Dense(8)(x), "batch", tiled=True)

    with pytest.raises(ValueError, match=r"reduce_scatter over its own axis \('batch',\).*Remedy"):
        axonn_jax.partition(Scatter(), Grid(x=2, z=4), np.zeros((8, 4), np.float32))


@pytest.mark.parametrize("grid", ["z=2,data=4", "x=2,y=2,z=2"])
def test_a_spectrally_normalised_discriminator_trains_as_the_plain_one(grid, devices):
    """nn.SpectralNorm's power iteration reads each kernel in a product whose result only
    feeds ``stop_gradient``: its cotangent is a symbolic zero, which the backward of a
    weight product (``runtime.overlap.contraction``) used to reject on grids with z
    (``SymbolicZero is not a valid JAX type``). The loss, every gradient and the updated
    ``u``/``sigma`` statistics equal the plain model's."""
    model = SpectralDiscriminator()
    variables = model.init(jax.random.key(0), IMAGES)
    stats = {"mutable": ["batch_stats"]}

    def loss_of(apply, variables):
        def loss(params):
            logits, updates = apply({**variables, "params": params}, IMAGES, **stats)
            return jnp.mean(jax.nn.softplus(-logits)), updates  # the real-image term of the GAN loss

        return jax.value_and_grad(loss, has_aux=True)(variables["params"])

    (ref_loss, ref_updates), ref_grads = jax.jit(lambda v: loss_of(model.apply, v))(variables)
    pm = axonn_jax.partition(model, Grid.parse(grid), IMAGES, **stats)
    (loss, updates), grads = jax.jit(lambda v: loss_of(pm.apply, v))(pm.shard(variables))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = _leaves(pm.gather({**variables, "params": grads, **updates}))
    want = _leaves({**variables, "params": ref_grads, **ref_updates})
    assert set(got) == set(want)
    for path, ref in want.items():
        np.testing.assert_allclose(got[path], ref, rtol=1e-5, atol=1e-6 * float(np.abs(ref).max()) + 1e-8,
                                   err_msg=path)


class _Constrained(nn.Module):
    """pjit-era code: activations constrained to the user's own mesh axes."""

    spec: object = None

    @nn.compact
    def __call__(self, x):
        h = jax.lax.with_sharding_constraint(nn.relu(nn.Dense(32)(x)), self.spec)
        return nn.Dense(4)(nn.relu(nn.Dense(32)(h)))


def test_a_model_s_own_sharding_constraints_give_way_to_the_plan(devices):
    """``with_sharding_constraint`` to the user's mesh (a NamedSharding, or a PartitionSpec under
    ``jax.set_mesh``) is a layout request the plan replaces: dropped, the values the plain
    model's. Under a ``set_mesh`` of the grid's size ``pm.apply`` runs on its own mesh; a
    pipeline stage's smaller mesh cannot run inside it: refused with the remedy. (Before:
    JAX's errors from inside the shard_map, a manual axis or another context mesh.)"""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "mp"))
    x = np.random.default_rng(7).standard_normal((8, 6, 16)).astype(np.float32)
    for model, context in ((_Constrained(NamedSharding(mesh, P("dp", None, "mp"))), contextlib.nullcontext()),
                           (_Constrained(P("dp", None, "mp")), jax.set_mesh(mesh))):  # fmt: skip
        with context:
            params = model.init(jax.random.key(0), x)["params"]
            want = jax.jit(lambda p: model.apply({"params": p}, x))(params)
            pm = axonn_jax.partition(model, Grid(x=2, y=2, z=2), x)
            got = jax.jit(pm.apply)(pm.shard(params), x)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
            if isinstance(model.spec, P):
                piped = axonn_jax.partition(model, Grid(pipeline=2, x=2, z=2), x)
                with pytest.raises(ValueError, match=r"inside a jax.set_mesh context.*Remedy: call pm.apply"):
                    piped.apply(piped.shard(params), x)


class _SpectralConv(nn.Module):
    """A Fourier neural operator's layer: the lowest modes of the sequence's spectrum mixed."""

    width: int = 16
    modes: int = 4

    @nn.compact
    def __call__(self, x):
        shape = (self.modes, self.width, self.width)
        w = self.param("w_real", nn.initializers.normal(0.1), shape) + 1j * self.param(
            "w_imag", nn.initializers.normal(0.1), shape)
        spectrum = jnp.fft.rfft(x, axis=1)
        mixed = jnp.einsum("bmi,mio->bmo", spectrum[:, : self.modes], w)
        return jnp.fft.irfft(jnp.zeros_like(spectrum).at[:, : self.modes].set(mixed), n=x.shape[1], axis=1)


class _RoutedFNO(nn.Module):
    """Two Fourier layers, then a top-2 router over four experts (one-hot dispatch)."""

    @nn.compact
    def __call__(self, a):
        h = nn.Dense(16)(a)
        for _ in range(2):
            h = nn.gelu(_SpectralConv()(h) + nn.Dense(16)(h))
        gates, experts = jax.lax.top_k(jax.nn.softmax(nn.Dense(4)(h)), 2)
        weights = jnp.sum(jax.nn.one_hot(experts, 4) * gates[..., None], axis=-2)
        kernels = self.param("experts", nn.initializers.normal(0.1), (4, 16, 8))
        return jnp.einsum("bse,bsd,edo->bso", weights, h, kernels)


@pytest.mark.parametrize("grid", ["x=2,y=2,z=2", "z=2,data=4"])
def test_fft_and_top_k_keep_their_other_dims_split(grid, devices):
    """``fft`` (a Fourier neural operator) and ``top_k`` (an MoE router) need only their own
    dims whole: the batch's and the channels' keep their split (both used to run replicated,
    listed in ``plan.warnings``); the gradients are the plain model's."""
    a = np.random.default_rng(8).standard_normal((8, 16, 3)).astype(np.float32)
    model = _RoutedFNO()
    params = model.init(jax.random.key(0), a)["params"]
    loss = lambda apply, p: jnp.mean(apply(p, a) ** 2)  # noqa: E731
    want = jax.grad(lambda p: loss(lambda q, x: model.apply({"params": q}, x), p))(params)
    pm = axonn_jax.partition(model, Grid.parse(grid), a)
    assert not [w for w in pm.plan.warnings if "fft" in w or "top_k" in w], pm.plan.warnings
    got = _leaves(pm.gather(jax.jit(jax.grad(lambda p: loss(pm.apply, p)))(pm.shard(params))))
    scale = max(np.max(np.abs(w)) for w in _leaves(want).values())
    for path, w in _leaves(want).items():
        np.testing.assert_allclose(got[path], w, rtol=0, atol=1e-5 * np.max(np.abs(w)) + 1e-6 * scale, err_msg=path)


class _Boxed(nn.Module):
    """MaxText-style parameters: kernels boxed with their logical axis names."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.relu(nn.Dense(32, kernel_init=nn.with_partitioning(init, ("embed", "mlp")))(x))
        h = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h)
        return h @ self.param("head", nn.with_partitioning(init, (None, "vocab")), (32, 8))


def test_boxed_parameters_are_planned_as_their_values(devices):
    """Parameters boxed by ``nn.with_partitioning`` / ``nn.with_logical_partitioning`` (what
    ``model.init`` returns) and the same unboxed (``nn.meta.unbox``, as training code keeps
    them) are one params tree to ``pm.shard``, ``pm.apply`` and ``pm.train_step``; ``pm.init``
    makes the unboxed values. (The plan used to hold the boxes: their leaves were
    ``.../value``, and unboxed params were refused as not matching the plan.)"""
    import optax

    x = np.random.default_rng(9).standard_normal((8, 16)).astype(np.float32)
    model = _Boxed()
    boxed = model.init(jax.random.key(0), x)["params"]
    assert isinstance(boxed["head"], nn.Partitioned)
    params = nn.meta.unbox(boxed)
    want = model.apply({"params": params}, x)
    pm = axonn_jax.partition(model, Grid(x=2, y=2, z=2), x)
    assert all(not p.path.endswith("/value") for p in pm.plan.params)
    for given in (boxed, params, {"params": boxed}):
        got = jax.jit(pm.apply)(pm.shard(given), x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    made = pm.gather(pm.init(jax.random.key(0)))
    for path, w in _leaves(params).items():
        np.testing.assert_array_equal(_leaves(made)[path], np.asarray(w), err_msg=path)
    loss_fn = lambda out, batch: jnp.mean(out**2)  # noqa: E731
    optimizer = optax.adamw(1e-2)
    ref, state = params, optimizer.init(params)
    step = pm.train_step(loss_fn, optimizer)
    p, s = step.init(pm.shard(boxed))
    for _ in range(2):
        grads = jax.grad(lambda q: loss_fn(model.apply({"params": q}, x), x))(ref)
        updates, state = optimizer.update(grads, state, ref)
        ref = optax.apply_updates(ref, updates)
        p, s, _ = step(p, s, x)
    for path, w in _leaves(ref).items():
        np.testing.assert_allclose(_leaves(pm.gather(p))[path], np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=path)

"""RNG streams (dropout) and model state (BatchNorm) equal the plain Flax model.

With JAX's partitionable threefry a dropout mask depends on the key and the
element's global index only, so a partitioned model draws the very mask of the
plain one: the same loss, gradients and AdamW trajectory with the same keys
(bounds of ``test_partition.py``). BatchNorm statistics are computed over the
global batch (train mode) and used as given (eval mode).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import grid_id, spread
from flax import linen as nn
from flax import nnx
from partition_cases import (BATCH, GRIDS, LR, STEPS, _leaves, adamw_param_failures,
                             assert_matches_reference)  # fmt: skip
from rng_cases import (KEY, NNXNet, _bn_loss, accumulated_reference, clipped_adamw,
                       batchnorm_pipeline_failures, batchnorm_reference,
                       dropout_loss, dropout_trajectory, plain_dropout_run)  # fmt: skip

import axonn_jax

@pytest.fixture(scope="module")
def gpt2_reference():
    model, args, params, keys, ref = plain_dropout_run(STEPS)
    no_dropout = model.apply({"params": params}, *args, deterministic=True)
    assert abs(float(dropout_loss(no_dropout, args[0])) - ref[0][0]) > 1e-3  # dropout really is on
    return model, args, params, keys, ref


@pytest.mark.parametrize("grid", [GRIDS[0], GRIDS[2]], ids=grid_id)  # every tensor axis; data with z
def test_gpt2_dropout_trajectory_matches_plain(grid, gpt2_reference, devices):
    model, args, params, keys, ref = gpt2_reference
    pm = axonn_jax.partition(model, axonn_jax.Grid(**grid), *args, deterministic=False,
                             rngs={"dropout": KEY})  # fmt: skip
    assert not pm.plan.warnings, pm.plan.warnings

    def part(p, *a_rngs):
        *a, rngs = a_rngs
        return pm.apply(p, *a, deterministic=False, rngs=rngs)

    losses, grads, final = dropout_trajectory(part, pm.shard(params), args, keys, pm=pm)
    result = {"init": params, "ref": ref, "part": (losses, pm.gather(grads), pm.gather(final))}
    assert_matches_reference(result, f"gpt2+dropout {grid}")


@pytest.mark.parametrize("grid,microbatches", [
    (dict(x=2, z=2, data=2), 2),
    (dict(pipeline=2, x=2, z=2), 1),
    (dict(pipeline=2, x=2, z=2), 2),
    (dict(pipeline=2, data=2, y=2), 2),
], ids=lambda v: grid_id(v) if isinstance(v, dict) else f"mb{v}")  # fmt: skip
def test_value_and_grad_with_dropout_key(grid, microbatches, gpt2_reference, devices):
    """pm.value_and_grad(rngs=...), pipelined included: loss and grads of the plain model."""
    model, args, params, keys, _ = gpt2_reference
    ref_loss, ref_grads = accumulated_reference(model, params, args, keys[1], microbatches)
    pm = axonn_jax.partition(model, axonn_jax.Grid(**grid), *args, deterministic=False,
                             rngs={"dropout": KEY})  # fmt: skip
    step = pm.value_and_grad(lambda out, batch: dropout_loss(out, batch[0]), microbatches=microbatches)
    if grid.get("pipeline", 1) == 1:
        step = jax.jit(step)
    loss, grads = step(pm.shard(params), args, rngs={"dropout": keys[1]})
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    got, ref = _leaves(pm.gather(grads)), _leaves(ref_grads)
    scale = max(np.max(np.abs(g)) for g in ref.values())
    for path, g in ref.items():
        np.testing.assert_allclose(got[path], g, atol=1e-5 * np.max(np.abs(g)) + 1e-6 * scale,
                                   rtol=0, err_msg=path)  # fmt: skip


@pytest.mark.parametrize("grid", [dict(x=2, y=2, z=2), dict(pipeline=2, x=2, z=2)], ids=grid_id)
def test_train_step_with_per_step_keys(grid, gpt2_reference, devices):
    """pm.train_step(..., rngs=) follows the plain AdamW trajectory with the same keys (5 steps)."""
    model, args, params, keys, ref = gpt2_reference
    pm = axonn_jax.partition(model, axonn_jax.Grid(**grid), *args, deterministic=False,
                             rngs={"dropout": KEY})  # fmt: skip
    step = pm.train_step(lambda out, batch: dropout_loss(out, batch[0]), optax.adamw(LR))
    p, s = step.init(pm.shard(params))
    losses = []
    for key in keys:
        p, s, loss = step(p, s, args, rngs={"dropout": key})
        losses.append(float(loss))
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    failures = adamw_param_failures(_leaves(pm.gather(p)), ref[2], ref[1], params)
    assert not failures, failures


def test_raw_keys_and_unsplit_key_inputs(devices):
    """A raw uint32[2] key is an RNG input (replicated), not a batch to split."""

    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(nn.Dense(16)(x))

    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    raw = jax.random.PRNGKey(3)
    model = Drop()
    params = model.init(jax.random.key(0), x)["params"]
    pm = axonn_jax.partition(model, axonn_jax.Grid(data=2, x=2, z=2), x, rngs={"dropout": raw})
    assert not pm.plan.warnings, pm.plan.warnings
    out = jax.jit(lambda p, k: pm.apply(p, x, rngs={"dropout": k}))(pm.shard(params), raw)
    ref = model.apply({"params": params}, x, rngs={"dropout": raw})
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_one_bare_rng_key_is_refused_with_the_remedy(devices):
    """Flax reads ``rngs=key`` as ``{'params': key}``; here every stream is an input of its
    own, so a bare key is refused by name (it failed with "len() of unsized object")."""
    model, args, params, keys, _ = plain_dropout_run(1)
    with pytest.raises(TypeError, match=r"rngs must be a dict of named RNG streams, got one key.*"
                                        r"Remedy: .*rngs=\{'dropout': key\}"):
        axonn_jax.partition(model, axonn_jax.Grid(x=2, z=2, data=2), *args, deterministic=False, rngs=KEY)
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, z=2, data=2), *args, deterministic=False,
                             rngs={"dropout": KEY})  # fmt: skip
    with pytest.raises(TypeError, match="got one key"):
        pm.apply(pm.shard(params), *args, deterministic=False, rngs=KEY)
    with pytest.raises(TypeError, match="got one key"):
        pm.value_and_grad(dropout_loss)(pm.shard(params), args[0], rngs=KEY)


def test_missing_rng_stream_names_the_remedy(devices):
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(x)

    with pytest.raises(ValueError, match=r"rngs=\{'dropout': key\}"):
        axonn_jax.partition(Drop(), axonn_jax.Grid(data=2), np.zeros((4, 8), np.float32))


# --- model state: BatchNorm ------------------------------------------------------


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(32, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
        return nn.Dense(16)(x)


@pytest.fixture(scope="module")
def bn_plain():
    """BNNet's plain AdamW trajectory (per-step dropout keys), computed once for every grid."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * 2, 16)).astype(np.float32)
    y = rng.standard_normal((BATCH * 2, 16)).astype(np.float32)
    model, optimizer = BNNet(), optax.adamw(LR)
    variables = model.init(jax.random.key(0), x, train=False)
    loss_fn = _bn_loss

    @jax.jit
    def plain_step(v, s, key):
        def loss_of(p):
            out, updates = model.apply({**v, "params": p}, x, rngs={"dropout": key},
                                       mutable=["batch_stats"])  # fmt: skip
            return loss_fn(out, (x, y)), updates

        (loss, updates), grads = jax.value_and_grad(loss_of, has_aux=True)(v["params"])
        delta, s = optimizer.update(grads, s, v["params"])
        return {"params": optax.apply_updates(v["params"], delta), **updates}, s, loss

    keys = [jax.random.fold_in(KEY, t) for t in range(STEPS)]
    v, s, ref_losses = variables, optimizer.init(variables["params"]), []
    for key in keys:
        v, s, loss = plain_step(v, s, key)
        ref_losses.append(float(loss))
    return x, y, variables, keys, ref_losses, v


@pytest.mark.parametrize("grid", GRIDS, ids=grid_id)
def test_batchnorm_train_steps_match_plain(grid, bn_plain, devices):
    """Variables dict in, (params, batch_stats) out of train_step: the plain trajectory."""
    x, y, variables, keys, ref_losses, v = bn_plain
    model, optimizer, loss_fn = BNNet(), optax.adamw(LR), _bn_loss
    pm = axonn_jax.partition(model, axonn_jax.Grid(**grid), x, rngs={"dropout": KEY},
                             mutable=["batch_stats"])  # fmt: skip
    assert [p.path for p in pm.plan.params if not p.trainable] == [
        "batch_stats/BatchNorm_0/mean", "batch_stats/BatchNorm_0/var"]  # fmt: skip
    step = pm.train_step(loss_fn, optimizer, inputs=lambda batch: (batch[0],))
    pv, ps = step.init(pm.shard(variables))
    losses = []
    for key in keys:
        pv, ps, loss = step(pv, ps, (x, y), rngs={"dropout": key})
        losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got, want, init = _leaves(pm.gather(pv)), _leaves(v), _leaves(variables)
    for path, ref in want.items():
        err = np.linalg.norm(got[path] - ref)
        assert err <= 1e-3 * np.linalg.norm(ref - init[path]) + 1e-6, (path, err)
    # eval mode: the running statistics are used as given
    eval_out = jax.jit(lambda v: pm.apply(v, x, train=False))(pv)
    np.testing.assert_allclose(np.asarray(eval_out), np.asarray(model.apply(v, x, train=False)),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


class _DenseBN(nn.Module):
    """Dense, ``BatchNorm(axis_name="batch")`` written for pmap, Dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False, axis_name="batch")(nn.Dense(16)(x))
        return nn.Dense(4)(x)


def test_batchnorm_statistics_leave_a_data_parallel_step_without_a_gather(devices):
    """State is not differentiated, so it is not marked varying over the batch as a parameter
    is: the updated running statistics, reduced over the batch already, leave the step as they
    are. They used to be typed varying over data and all-gathered there (one call per statistic)."""
    from compiled_steps import compile_apply_step

    from axonn_jax.runtime.hlo import collectives

    x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    compiled = compile_apply_step(_DenseBN(), (x,), axonn_jax.Grid(data=8), kwargs={"mutable": ["batch_stats"]})
    found = [c for c in collectives(compiled.as_text(), num_devices=8) if not c.trivial]
    assert not [c for c in found if c.kind == "all-gather"], [(c.kind, c.op_name) for c in found]
    assert {c.kind for c in found} == {"all-reduce"}  # the statistics, their backward, the gradients


def test_variables_dict_and_params_tree_are_the_same(devices):
    """pm.shard / apply / gather take the linen variables dict as well as the params tree."""
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    model = nn.Dense(8)
    variables = model.init(jax.random.key(0), x)
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, z=2, data=2), x)
    apply = jax.jit(pm.apply)
    by_tree = apply(pm.shard(variables["params"]), x)
    wrapped = pm.shard(variables)
    assert set(wrapped) == {"params"}
    np.testing.assert_array_equal(np.asarray(apply(wrapped, x)), np.asarray(by_tree))
    back = pm.gather(wrapped)
    np.testing.assert_array_equal(back["params"]["kernel"], np.asarray(variables["params"]["kernel"]))
    np.testing.assert_allclose(np.asarray(by_tree), np.asarray(model.apply(variables, x)),
                               rtol=1e-5, atol=1e-6)


class _FourDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4)(x)


@pytest.mark.parametrize("grid", [dict(x=2, z=2, data=2), dict(pipeline=2, x=2, z=2)], ids=grid_id)
def test_training_takes_the_variables_dict_as_well_as_the_params_tree(grid, devices):
    """pm.value_and_grad and pm.train_step (init, step, checkpoint_state) take a stateless
    linen model's ``{'params': tree}`` as pm.shard returns it, and give back that form with
    the values the params tree gives. The pipeline's gradient and both engines' train steps
    used to refuse it, naming ``model.init(...)['params']`` as the remedy."""
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    model = _FourDense()
    variables = model.init(jax.random.key(0), x)
    pm = axonn_jax.partition(model, axonn_jax.Grid(**grid), x)
    loss_fn = lambda out, batch: jnp.mean(out**2)  # noqa: E731
    by_tree = pm.value_and_grad(loss_fn)(pm.shard(variables["params"]), x)
    loss, grads = pm.value_and_grad(loss_fn)(pm.shard(variables), x)
    assert float(loss) == float(by_tree[0]) and set(grads) == {"params"}
    jax.tree.map(np.testing.assert_array_equal, pm.gather(grads)["params"], pm.gather(by_tree[1]))
    runs = {}
    for form, given in (("tree", variables["params"]), ("dict", variables)):
        step = pm.train_step(loss_fn, optax.adam(1e-2))
        params, opt_state = step.init(pm.shard(given))
        params, opt_state, loss = step(params, opt_state, x)
        saved, _ = step.checkpoint_state(params, opt_state)
        runs[form] = (float(loss), pm.gather(params), pm.gather(saved))
    assert set(runs["dict"][1]) == set(runs["dict"][2]) == {"params"}
    assert runs["dict"][0] == runs["tree"][0]
    jax.tree.map(np.testing.assert_array_equal, runs["dict"][1]["params"], runs["tree"][1])
    # an empty collection beside them, which model.apply ignores, was refused as a mismatch
    with_empty = {**pm.shard(variables), "batch_stats": {}, "intermediates": {}}
    loss, grads = pm.value_and_grad(loss_fn)(with_empty, x)
    assert float(loss) == float(by_tree[0])
    jax.tree.map(np.testing.assert_array_equal, pm.gather(grads["params"]), pm.gather(by_tree[1]))
    np.testing.assert_array_equal(pm.forward(with_empty, x), pm.forward(variables, x))


def _hf_vision(name):
    import transformers as hf
    from transformers.models.regnet import modeling_flax_regnet as regnet
    from transformers.models.resnet import modeling_flax_resnet as resnet

    if name == "resnet":
        config = hf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                 layer_type="basic")  # fmt: skip
        return resnet.FlaxResNetModule(config)
    config = hf.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8)
    return regnet.FlaxRegNetModule(config)


@pytest.mark.parametrize("name,grid", spread(["resnet", "regnet"], GRIDS, per_name=3),
                         ids=lambda v: grid_id(v) if isinstance(v, dict) else v)  # fmt: skip
def test_hf_batchnorm_models_train_and_eval(name, grid, devices):
    """HF FlaxResNetModel / FlaxRegNetModel: outputs, grads and batch_stats of train mode; eval mode."""
    module = _hf_vision(name)
    images = np.random.default_rng(0).standard_normal((BATCH, 32, 32, 3)).astype(np.float32)
    variables = module.init(jax.random.key(0), images)

    def loss(out):
        return jnp.mean(out.pooler_output**2)

    def plain(p):  # (pixel_values, deterministic=False): BatchNorm on batch statistics
        out, updates = module.apply({**variables, "params": p}, images, False, mutable=["batch_stats"])
        return loss(out), updates

    (ref_loss, ref_updates), ref_grads = jax.value_and_grad(plain, has_aux=True)(variables["params"])
    pm = axonn_jax.partition(module, axonn_jax.Grid(**grid), images, False, mutable=["batch_stats"])
    placed = pm.shard(variables)

    def part(p, state):
        out, updates = pm.apply({**state, "params": p}, images, False, mutable=["batch_stats"])
        return loss(out), updates

    state = {k: v for k, v in placed.items() if k != "params"}
    (got_loss, updates), grads = jax.jit(jax.value_and_grad(part, has_aux=True))(placed["params"], state)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    got = pm.gather({**placed, "params": grads, **updates})
    for tree, ref in ((got["params"], ref_grads), (got["batch_stats"], ref_updates["batch_stats"])):
        ref_l, got_l = _leaves(ref), _leaves(tree)
        scale = max(np.max(np.abs(v)) for v in ref_l.values())
        for path, r in ref_l.items():
            np.testing.assert_allclose(got_l[path], r, rtol=0, err_msg=path,
                                       atol=1e-5 * np.max(np.abs(r)) + 1e-6 * scale)  # fmt: skip
    evaluated = jax.jit(lambda v: pm.apply(v, images, True))(placed)
    expected = module.apply(variables, images, True)
    np.testing.assert_allclose(np.asarray(evaluated.pooler_output), np.asarray(expected.pooler_output),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("grid", [dict(x=2, z=2, data=2), dict(y=2, z=2, data=2)], ids=grid_id)
def test_nnx_dropout_and_batchnorm_match_plain(grid, devices):
    """nnx state (BatchStat, the Dropout stream's key and counter) in and out, as the module does."""
    x = np.random.default_rng(2).standard_normal((BATCH, 16)).astype(np.float32)
    model = NNXNet(nnx.Rngs(0, dropout=7))
    pm = axonn_jax.partition(model, axonn_jax.Grid(**grid), x)
    variables = pm.init(jax.random.key(0))
    assert set(variables) == {"params", "state"}
    assert all(not p.trainable for p in pm.plan.params if p.path.startswith("state/"))

    def loss(out):
        return jnp.mean(out**2)

    @jax.jit
    def part(v):
        def of(p):
            out, updates = pm.apply({**v, "params": p}, x)
            return loss(out), (out, updates)

        return jax.value_and_grad(of, has_aux=True)(v["params"])

    for call in range(2):  # the second call draws from the advanced RNG counter
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def plain(p):
            fresh = nnx.clone(params)
            nnx.replace_by_pure_dict(fresh, p)
            module = nnx.merge(graphdef, fresh, nnx.clone(rest))
            out = module(x)
            return loss(out), (out, nnx.state(module, nnx.BatchStat))

        (ref_loss, (ref_out, ref_stats)), ref_grads = jax.value_and_grad(plain, has_aux=True)(
            nnx.to_pure_dict(params))  # fmt: skip
        (got_loss, (out, updates)), grads = part(variables)
        np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-6)
        got_grads = pm.gather({**variables, "params": grads})["params"]
        for path, r in _leaves(ref_grads).items():
            np.testing.assert_allclose(_leaves(got_grads)[path], r, rtol=1e-5, atol=1e-6, err_msg=path)
        new_state = pm.gather({**variables, **updates})["state"]
        for path, r in _leaves(nnx.to_pure_dict(ref_stats)).items():
            np.testing.assert_allclose(_leaves(new_state)[path], r, rtol=1e-5, atol=1e-6, err_msg=path)
        assert int(_leaves(new_state)["drop/rngs/count"]) == call + 1
        model(x)  # advance the plain module (statistics and RNG counter) the same way
        variables = {**variables, **updates}


class _SowingNet(nnx.Module):
    """Stores its hidden layer with ``sow`` (nnx's intermediates pattern); BatchNorm optional."""

    def __init__(self, norm: bool, rngs: nnx.Rngs):
        self.inner = nnx.Linear(16, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs) if norm else None
        self.outer = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.inner(x))
        h = self.norm(h) if self.norm is not None else h
        self.sow(nnx.Intermediate, "hidden", h)
        return self.outer(h)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")
@pytest.mark.parametrize("norm", [False, True], ids=["stateless", "batchnorm"])
def test_nnx_values_stored_with_sow_are_not_state_and_the_plan_says_so(norm, devices):
    """Values a call stores with ``sow`` (nnx.Intermediate) are neither state nor outputs: the
    plan warns that pm.apply does not return them, the state it returns feeds the next call,
    and values an earlier plain call left on the module are not planned as state. They used
    to be dropped silently (no state), or returned as state the next call refused."""
    x = np.random.default_rng(3).standard_normal((BATCH, 16)).astype(np.float32)
    model = _SowingNet(norm, nnx.Rngs(0))
    model(x)  # a plain call first: the module now holds a stored value
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, data=4), x)
    assert any("stores hidden with sow" in w for w in pm.plan.warnings), pm.plan.warnings
    assert not [p.path for p in pm.plan.params if "hidden" in p.path]
    variables = pm.init(jax.random.key(0))
    first = pm.apply(variables, x)
    if not norm:
        assert not isinstance(first, tuple)
        np.testing.assert_allclose(np.asarray(first), np.asarray(model(x)), rtol=1e-5, atol=1e-6)
        return
    out, updates = first
    assert set(_leaves(updates["state"])) == {"norm/mean", "norm/var"}
    again, _ = pm.apply({**variables, **updates}, x)  # the returned state feeds the next call
    np.testing.assert_allclose(np.asarray(again), np.asarray(out), rtol=1e-5, atol=1e-6)


class _LinenSowingNet(nn.Module):
    """Stores its hidden layer with ``sow`` (linen's intermediates); BatchNorm optional."""

    norm: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(32, name="hidden")(x))
        h = nn.BatchNorm(use_running_average=False)(h) if self.norm else h
        self.sow("intermediates", "h", h)
        return nn.Dense(4)(h)


@pytest.mark.parametrize("norm", [False, True], ids=["stateless", "batchnorm"])
@pytest.mark.parametrize("capture", [False, True], ids=["sow", "capture_intermediates"])
def test_linen_intermediates_are_returned_as_model_apply_returns_them(norm, capture, devices):
    """``mutable=['intermediates']`` with ``sow`` or ``capture_intermediates=True``: ``pm.apply``
    takes what ``model.apply`` takes (the params alone without other state) and returns the
    plain call's intermediates, and a loss on one has the plain gradient. ``intermediates`` is
    output only, as ``model.init`` leaves it; ``capture_intermediates`` is ``model.apply``'s
    (it used to reach ``model.init``, whose captured values were then planned as state, fed
    back and appended to: the first entry stale, its gradient 0). A collection filter
    (``mutable=nn.DenyList(...)``) is a static argument, as a list is."""
    x = np.random.default_rng(4).standard_normal((BATCH, 16)).astype(np.float32)
    model = _LinenSowingNet(norm)
    variables = model.init(jax.random.key(0), x)
    given = variables if norm else variables["params"]
    mutable = ["intermediates", "batch_stats"] if norm else ["intermediates"]

    def run(apply, v):
        return apply(v, x, capture_intermediates=capture, mutable=mutable)

    def loss(apply, v):  # on the first value the call stored: the hidden layer
        return jnp.mean(run(apply, v)[1]["intermediates"]["h"][0] ** 2)

    plain = lambda v, *a, **k: model.apply(v if norm else {"params": v}, *a, **k)  # noqa: E731
    (want, stored), want_grads = run(plain, given), jax.grad(lambda v: loss(plain, v))(given)
    for grid in ("x=2,y=2,z=2", "z=2,data=4"):
        pm = axonn_jax.partition(model, axonn_jax.Grid.parse(grid), x, capture_intermediates=capture,
                                 mutable=mutable)  # fmt: skip
        placed = pm.shard(given)
        got, updates = jax.jit(lambda v: run(pm.apply, v))(placed)
        assert jax.tree.structure(updates["intermediates"]) == jax.tree.structure(stored["intermediates"])
        for a, b in zip(jax.tree.leaves((got, updates["intermediates"])), jax.tree.leaves((want, stored["intermediates"]))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        grads = pm.gather(jax.jit(jax.grad(lambda v: loss(pm.apply, v)))(placed))
        for path, g in _leaves(want_grads).items():
            np.testing.assert_allclose(_leaves(grads)[path], g, rtol=1e-5, atol=1e-7, err_msg=path)
    out, updates = pm.apply(placed, x, mutable=nn.DenyList("intermediates"))
    assert "intermediates" not in updates


def test_training_calls_say_the_loss_does_not_see_stored_intermediates(devices):
    """A model partitioned with ``mutable=['intermediates']`` (a sown auxiliary loss): its
    training calls run without them, so ``pm.value_and_grad`` and ``pm.train_step`` warn, with
    the remedy, instead of dropping them silently."""
    x = np.random.default_rng(4).standard_normal((BATCH, 16)).astype(np.float32)
    model = _LinenSowingNet()
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, data=4), x, mutable=["intermediates"])
    loss_fn = lambda out, batch: jnp.mean(out**2)  # noqa: E731
    with pytest.warns(UserWarning, match=r"without mutable=\['intermediates'\].*Remedy: return what the loss"):
        pm.value_and_grad(loss_fn)
    with pytest.warns(UserWarning, match="neither given to the loss nor returned"):
        pm.train_step(loss_fn, optax.sgd(0.1))
    quiet = axonn_jax.partition(model, axonn_jax.Grid(x=2, data=4), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.value_and_grad(loss_fn)


def test_init_takes_linen_key_dicts_and_nnx_rng_state_refuses_microbatches(devices):
    x = np.zeros((BATCH, 16), np.float32)
    model = BNNet()
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, data=4), x, rngs={"dropout": KEY},
                             mutable=["batch_stats"])  # fmt: skip
    keys = {"params": jax.random.key(3), "dropout": jax.random.key(4)}
    got = pm.gather(pm.init(keys))
    want = model.init(keys, x)
    for path, ref in _leaves(want).items():
        np.testing.assert_array_equal(_leaves(got)[path], np.asarray(ref), err_msg=path)
    # one bare key, as model.init(key) takes it: the params stream's (it was a key split from it)
    bare = _leaves(pm.gather(pm.init(jax.random.key(3))))
    for path, ref in _leaves(model.init(jax.random.key(3), x)).items():
        np.testing.assert_array_equal(bare[path], np.asarray(ref), err_msg=path)
    nnx_model = NNXNet(nnx.Rngs(0, dropout=1))
    piped = axonn_jax.partition(nnx_model, axonn_jax.Grid(pipeline=2, x=4), x)
    with pytest.raises(ValueError, match=r"its 2 microbatches would all use the same dropout masks"):
        piped.value_and_grad(lambda out, b: jnp.mean(out[0]), microbatches=2)


@pytest.mark.parametrize("microbatches,optimizer", [(1, None), (2, None), (2, clipped_adamw)],
                         ids=["mb1", "mb2", "mb2-global-norm-clip"])  # fmt: skip
def test_batchnorm_on_a_pipeline_matches_plain_accumulation(microbatches, optimizer, devices):
    """pipeline=2,x=2,z=2: each stage updates its own statistics (mean over microbatches); with
    global-norm clipping the update mixes the stages (rounds) and the statistics are carried."""
    optimizer = optimizer and optimizer()
    x, y, variables, ref_losses, ref_final = batchnorm_reference(STEPS, microbatches, optimizer)
    failures = batchnorm_pipeline_failures(axonn_jax.Grid(pipeline=2, x=2, z=2), microbatches, x, y,
                                           variables, ref_losses, ref_final, optimizer)  # fmt: skip
    assert not failures, failures


def test_nnx_state_on_a_pipeline(devices):
    """nnx BatchStat and the Dropout stream's counter come back from the stage that updates them."""
    x = np.random.default_rng(2).standard_normal((BATCH, 16)).astype(np.float32)
    model = NNXNet(nnx.Rngs(0, dropout=7))
    pm = axonn_jax.partition(model, axonn_jax.Grid(pipeline=2, x=2, z=2), x)
    variables = pm.init(jax.random.key(0))
    (loss, updates), grads = pm.value_and_grad(lambda out, _: jnp.mean(out**2))(variables, x)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def plain(p):
        fresh = nnx.clone(params)
        nnx.replace_by_pure_dict(fresh, p)
        module = nnx.merge(graphdef, fresh, nnx.clone(rest))
        return jnp.mean(module(x) ** 2), nnx.to_pure_dict(nnx.state(module, nnx.BatchStat))

    (ref_loss, ref_stats), ref_grads = jax.value_and_grad(plain, has_aux=True)(nnx.to_pure_dict(params))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = _leaves(pm.gather({**variables, "params": grads})["params"])
    for path, r in _leaves(ref_grads).items():
        np.testing.assert_allclose(got[path], r, rtol=1e-5, atol=1e-6, err_msg=path)
    state = _leaves(pm.gather({**variables, **updates})["state"])
    for path, r in _leaves(ref_stats).items():
        np.testing.assert_allclose(state[path], r, rtol=1e-5, atol=1e-6, err_msg=path)
    assert int(state["drop/rngs/count"]) == 1


def test_an_nnx_evaluation_program_runs_on_a_pipeline_s_training_variables(devices):
    """``model.eval()`` then ``partition(..., stages=pm.plan.stage_cuts)``: the evaluation
    program's stages hold the training program's parameters (cut by its own costs, its first
    stage would end before ``norm/bias``), and it runs on variables in which the dropout
    stream's counter, which only training reads, is ``None``, as on a process whose stages
    do not hold it (it used to be refused: "is None but this process runs a stage that uses
    it"). Its outputs are the plain nnx model's in evaluation mode."""
    x = np.random.default_rng(5).standard_normal((BATCH, 16)).astype(np.float32)
    model = NNXNet(nnx.Rngs(0, dropout=7))
    grid = axonn_jax.Grid(pipeline=2, x=2, z=2)
    pm = axonn_jax.partition(model, grid, x)
    variables = pm.init(jax.random.key(0))
    model.eval()

    def trained(plan):
        return [{p for p in st.params if p.startswith("params/")} for st in plan.stages]

    assert trained(axonn_jax.partition(model, grid, x).plan) != trained(pm.plan)
    evaluate = axonn_jax.partition(model, grid, x, stages=pm.plan.stage_cuts)
    assert trained(evaluate.plan) == trained(pm.plan)
    counter = "state/drop/rngs/count"
    assert any(counter in st.params for st in pm.plan.stages)
    assert not any(counter in st.params for st in evaluate.plan.stages)
    holes = jax.tree_util.tree_map_with_path(
        lambda path, leaf: None if jax.tree_util.keystr(path) == "['state']['drop']['rngs']['count']" else leaf,
        variables)  # fmt: skip
    assert sum(leaf is None for leaf in jax.tree.leaves(holes, is_leaf=lambda v: v is None)) == 1
    out, _ = evaluate.apply(holes, x)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    nnx.replace_by_pure_dict(params, pm.gather(variables)["params"])
    plain = nnx.merge(graphdef, params, rest)  # evaluation mode: running averages, no dropout
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain(x)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"'state/drop/rngs/count' is None but this process keeps it \(no stage "
                                         r"reads it"):  # outside a forward pass: refused, truthfully
        evaluate.gather(holes)
    with pytest.raises(ValueError, match=r"'params/out/kernel' is None .* stages=that_pm.plan.stage_cuts"):
        evaluate.apply({**variables, "params": {**variables["params"], "out": {**variables["params"]["out"],
                                                                                 "kernel": None}}}, x)  # fmt: skip


def test_a_linen_evaluation_call_on_a_pipeline_is_refused_with_the_pm_that_runs_it(devices):
    """On a pipeline, ``train=False`` on the training pm runs other operations than the stages
    were cut for: refused, naming ``stages=pm.plan.stage_cuts`` (the message used to blame the
    input shapes alone); the pm it names runs on the training variables, as the plain model."""
    from rng_cases import DeepBN

    x = np.random.default_rng(6).standard_normal((16, 16)).astype(np.float32)
    model, grid = DeepBN(), axonn_jax.Grid(pipeline=2, x=2, z=2)
    pm = axonn_jax.partition(model, grid, x, train=True, mutable=["batch_stats"])
    variables = pm.init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"another mode, e.g. train=False.*stages=pm.plan.stage_cuts"):
        pm.apply(variables, x, train=False)
    evaluate = axonn_jax.partition(model, grid, x, train=False, stages=pm.plan.stage_cuts)
    np.testing.assert_allclose(np.asarray(evaluate.apply(variables, x, train=False)),
                               np.asarray(model.apply(pm.gather(variables), x, train=False)),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_optimizer_helpers_see_the_params_of_a_model_with_state(devices, tmp_path):
    """DeepBN (variables = params + batch_stats), an own jitted AdamW step: init_optimizer from the
    params or the whole variables, gather of the params alone, ckpt.restore(optimizer=) and the
    report all see params only, as plain Flax/optax does (optimizer.init(variables['params']))."""
    from axonn_jax.checkpoint import Checkpointer
    from rng_cases import DeepBN

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 16)).astype(np.float32)
    y = rng.standard_normal((16, 16)).astype(np.float32)
    model, optimizer = DeepBN(), optax.adamw(LR)
    variables = model.init(jax.random.key(0), x, train=False)
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, z=2, data=2), x, mutable=["batch_stats"])

    def make_step(apply):
        @jax.jit
        def step(v, s):
            def loss_of(p):
                out, updates = apply({**v, "params": p}, x, mutable=["batch_stats"])
                return _bn_loss(out, (x, y)), updates

            (loss, updates), grads = jax.value_and_grad(loss_of, has_aux=True)(v["params"])
            delta, s = optimizer.update(grads, s, v["params"])
            return {**v, **updates, "params": optax.apply_updates(v["params"], delta)}, s, loss

        return step

    plain_step, own_step = make_step(model.apply), make_step(pm.apply)
    v, s = variables, optimizer.init(variables["params"])
    pv = pm.shard(variables)
    from_params, from_variables = pm.init_optimizer(optimizer, pv["params"]), pm.init_optimizer(optimizer, pv)
    for got in (from_params, from_variables):
        assert jax.tree.structure(got) == jax.tree.structure(s)  # no Adam moments for batch_stats
    ps = from_variables
    for _ in range(3):
        v, s, ref_loss = plain_step(v, s)
        pv, ps, loss = own_step(pv, ps)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got, want, init = _leaves(pm.gather(pv)), _leaves(v), _leaves(variables)
    for path, ref in want.items():
        assert np.linalg.norm(got[path] - ref) <= 1e-3 * np.linalg.norm(ref - init[path]) + 1e-6, path
    alone = pm.gather(pv["params"])  # the params subtree is accepted and comes back alone
    assert jax.tree.structure(alone) == jax.tree.structure(v["params"])
    for path, value in _leaves(alone).items():
        np.testing.assert_array_equal(value, got[f"params/{path}"])
    # the README's own-step checkpoint: whole variables as params, the optimizer over params only
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, pv, ps)
    restored = Checkpointer(tmp_path, read_only=True).restore(params=pm.param_structs, optimizer=optimizer)
    for a, b in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(ps), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    pv2, ps2, loss = own_step(restored.params, restored.opt_state)
    v, s, ref_loss = plain_step(v, s)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    # the params alone where the model needs its state: the remedy that works
    with pytest.raises(ValueError, match=r"pass the whole variables dict \(params and batch_stats\)"):
        pm.apply(pv2["params"], x, mutable=["batch_stats"])
    # the report counts gradients and Adam moments for the trainable parameters only
    mem = pm.report().memory
    trainable = [p for p in pm.plan.params if p.trainable]
    assert len(trainable) == len(jax.tree.leaves(variables["params"])) < len(pm.plan.params)
    assert mem.gradients == sum(p.bytes_per_device(pm.grid) for p in trainable)
    local = sum(int(np.prod(p.local_shape(pm.grid))) for p in trainable)
    assert mem.optimizer == 2 * 4 * local
    assert mem.parameters > mem.gradients

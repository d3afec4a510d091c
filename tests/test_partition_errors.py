"""What cannot be partitioned still computes exactly (with a warning), or raises."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axonn_jax
from axonn_jax import Grid


class ScaleSome(nn.Module):
    """Dense → ``.at[cols].multiply`` (scatter-mul: no sharding rule, a replicated fallback) → Dense."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="up")(x)
        return nn.Dense(4, name="down")(h.at[:, jnp.array([0, 2, 4])].multiply(0.5))


class Narrow(nn.Module):
    """A 6-wide layer: not divisible by x=4."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="out")(nn.gelu(nn.Dense(6, name="narrow")(x)))


def _grads_match(model, x, grid):
    params = model.init(jax.random.key(0), x)["params"]
    pm = axonn_jax.partition(model, grid, x)
    ref_loss, ref = jax.value_and_grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(params)
    loss, got = jax.jit(jax.value_and_grad(lambda p: jnp.sum(pm.apply(p, x) ** 2)))(pm.shard(params))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(pm.gather(got))):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(a))))
    return pm


X = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)


def test_unsupported_op_falls_back_exactly_with_warning(devices):
    pm = _grads_match(ScaleSome(), X, Grid(x=2, y=2, z=2))
    assert any("scatter-mul" in w and "no sharding rule" in w for w in pm.plan.warnings)
    assert "warnings:" in str(pm.plan) and "scatter-mul" in str(pm.plan)


def test_unsupported_op_raises_in_strict_mode(devices):
    with pytest.raises(ValueError, match=r"cannot partition 'scatter-mul'.*Grid\(x=2.*strict=False"):
        axonn_jax.partition(ScaleSome(), Grid(x=2, y=2, z=2), X, strict=True)


def test_indivisible_dim_is_replicated_with_warning(devices):
    pm = _grads_match(Narrow(), X, Grid(x=4, z=2))
    text = " ".join(pm.plan.warnings)
    assert "narrow/kernel" in text and "(12, 6)" in text and "x=4" in text


class _TokenMixing(nn.Module):
    """MLP-Mixer's block: a token-mixing MLP between two transposes, then a channel MLP."""

    @nn.compact
    def __call__(self, x):  # [batch, tokens, channels]
        y = jnp.swapaxes(nn.LayerNorm()(x), 1, 2)
        x = x + jnp.swapaxes(nn.Dense(16)(nn.gelu(nn.Dense(16)(y))), 1, 2)
        return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))


def test_an_unsplit_layer_is_named_with_its_cause():
    """A layer left whole says why: a dim that does not divide the axis (make them multiples),
    or, where every dim divides, a transpose that left its activation split otherwise (the
    warning used to name divisibility there too, with the multiples remedy that cannot help)."""
    narrow = axonn_jax.partition(Narrow(), Grid(x=4, z=2), X).plan.warnings
    assert any("not divisible by 4" in w and "multiples of 4" in w for w in narrow), narrow
    mixer = axonn_jax.partition(_TokenMixing(), Grid(y=2, data=4), np.zeros((8, 16, 32), np.float32)).plan.warnings
    assert mixer and all("its dims divide by 2, but the activation it multiplies is not split over y" in w
                         and "multiples" not in w for w in mixer), mixer


def test_indivisible_dim_raises_in_strict_mode(devices):
    with pytest.raises(ValueError, match=r"'narrow/kernel' \(12, 6\).*x=4.*Remedy"):
        axonn_jax.partition(Narrow(), Grid(x=4, z=2), X, strict=True)


def test_batch_not_divisible(devices):
    x = np.zeros((6, 12), np.float32)
    with pytest.raises(ValueError, match=r"batch.*6.*not divisible by data·z = 2·2 = 4.*Remedy"):
        axonn_jax.partition(Narrow(), Grid(z=2, data=2, x=2), x, strict=True)
    pm = _grads_match(Narrow(), x, Grid(z=2, data=2, x=2))  # replicated batch, still exact
    assert any("batch dim 6" in w for w in pm.plan.warnings)


def test_params_that_do_not_match_the_plan(devices):
    model = Narrow()
    pm = axonn_jax.partition(model, Grid(x=2, y=2, z=2), X)
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), X)["params"])
    missing = {"out": params["out"]}
    with pytest.raises(ValueError, match=r"missing \['narrow/bias', 'narrow/kernel'\]"):
        pm.shard(missing)
    wrong_shape = jax.tree.map(lambda a: a, params)
    wrong_shape["narrow"]["kernel"] = np.zeros((12, 7), np.float32)
    with pytest.raises(ValueError, match=r"'narrow/kernel' has shape \(12, 7\).*expects \(12, 6\)"):
        pm.shard(wrong_shape)
    wrong_dtype = jax.tree.map(lambda a: a, params)
    wrong_dtype["out"]["bias"] = params["out"]["bias"].astype(np.float16)
    with pytest.raises(ValueError, match=r"'out/bias' has dtype float16.*expects float32"):
        pm.shard(wrong_dtype)


def test_not_a_flax_module():
    with pytest.raises(TypeError, match="flax.linen.Module or flax.nnx.Module"):
        axonn_jax.partition(lambda x: x, Grid(), X)


def test_partitioning_is_pure_and_needs_no_devices():
    """Planning from ShapeDtypeStructs only; the model is not mutated."""
    from axonn_jax.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=512, num_layers=4, hidden=256, num_heads=8, max_seq_len=128))
    tokens = jax.ShapeDtypeStruct((1024, 128), jnp.int32)
    pm = axonn_jax.partition(model, Grid(x=8, y=8, z=4, data=4), tokens)
    assert pm.engine._placed is None  # no device touched
    assert pm.plan.param("block_0/attn/query/kernel").role == "normal"
    assert pm.plan.param("block_0/attn/out/kernel").role == "transposed"
    assert pm.plan.param("block_0/mlp/fc_in/kernel").role == "normal"
    assert pm.plan.param("block_0/mlp/fc_out/kernel").role == "transposed"


def test_grid_not_matching_the_device_count(devices):
    """Caught when the partitioned model first needs its devices, before any collective."""
    pm = axonn_jax.partition(Narrow(), Grid(x=2, y=2), X)  # planning needs no devices
    with pytest.raises(ValueError, match=r"Grid\(x=2, y=2.*needs 4 devices.*but 8 are available.*Remedy"):
        pm.init(jax.random.key(0))


def test_bad_planner_cli_arguments(capsys):
    from axonn_jax import cli

    for argv, message in [
        (["plan", "--gpus", "0", "--machine", "perlmutter"], "--gpus must be >= 1, got 0"),
        (["plan", "--gpus", "8", "--machine", "perlmutter", "--layers", "2"], "missing --hidden"),
        (["plan", "--gpus", "8", "--machine", "no-such-machine", "--layers", "2"], "no-such-machine"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_incomplete_machine_profile_is_named(tmp_path, capsys):
    """A profile JSON without some keys (or with bad table entries) exits 2 naming the file and keys."""
    import json

    from axonn_jax import cli
    from axonn_jax.perf import machines

    whole = machines.BUILTIN["perlmutter"].to_json()
    incomplete = {k: v for k, v in whole.items() if k not in ("peak_tflops", "memory_gib")}
    bad_table = dict(whole, intra_node=[{"inner": 1, "value": 7.0}])
    for name, profile, message in [
        ("incomplete.json", incomplete, "misses the keys ['memory_gib', 'peak_tflops']"),
        ("bad_table.json", bad_table, "'intra_node' must be a list of"),
        ("list.json", [whole], "a machine profile is a JSON object, got list"),
    ]:
        path = tmp_path / name
        path.write_text(json.dumps(profile))
        with pytest.raises(SystemExit) as exit_:
            cli.main(["plan", "--gpus", "8", "--machine", str(path), "--layers", "2", "--hidden", "64"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2, err
        assert f"machine profile {str(path)!r}" in err and message in err and "Remedy:" in err
        assert "Traceback" not in err


def test_apply_refuses_a_tree_with_other_names_shapes_or_dtypes(devices):
    """Same leaf count is not enough: names, shapes and dtypes are checked on every call."""
    model = Narrow()
    pm = axonn_jax.partition(model, Grid(x=2, y=2, z=2), X)
    params = pm.shard(jax.tree.map(np.asarray, model.init(jax.random.key(0), X)["params"]))
    renamed = {"renamed": params["narrow"], "out": params["out"]}
    with pytest.raises(ValueError, match=r"missing \['narrow/bias', 'narrow/kernel'\], unexpected "
                                         r"\['renamed/bias', 'renamed/kernel'\]"):  # fmt: skip
        jax.jit(pm.apply)(renamed, X)
    swapped = {"narrow": params["out"], "out": params["narrow"]}
    with pytest.raises(ValueError, match=r"'narrow/bias' has shape"):
        pm.apply(swapped, X)
    ints = jax.tree.map(lambda a: a.astype(jnp.int32), params)
    with pytest.raises(ValueError, match=r"has dtype int32, the plan expects float32"):
        pm.apply(ints, X)
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)  # a bf16 step's: cast as planned
    cast = jax.tree.map(lambda a: a.astype(jnp.float32), half)
    np.testing.assert_array_equal(np.asarray(pm.apply(half, X)), np.asarray(pm.apply(cast, X)))


def test_apply_takes_params_laid_out_for_another_grid(devices):
    """Params another grid's plan laid out (pm_other.init) used to fail inside JAX with an
    IndivisibleError; pm.apply moves them into its own layout and gives its own result."""
    mine = axonn_jax.partition(Narrow(), Grid(x=2, z=2, data=2), X)
    params = mine.init(jax.random.key(0))
    want = np.asarray(mine.apply(params, X))
    for grid in (Grid(x=2, y=2, z=2), Grid(data=8)):
        other = axonn_jax.partition(Narrow(), grid, X).shard(mine.gather(params))
        np.testing.assert_allclose(np.asarray(mine.apply(other, X)), want, rtol=1e-6, atol=1e-7)


def test_nnx_weights_loaded_after_partition_are_used(devices):
    """pm.init of an nnx module reads the module's values when it is called, not at partition()."""
    from flax import nnx

    model = nnx.Linear(12, 8, rngs=nnx.Rngs(0))
    pm = axonn_jax.partition(model, Grid(x=2, y=2, z=2), X)
    model.kernel.value = jnp.full((12, 8), 0.5)  # e.g. pretrained weights loaded afterwards
    params = pm.init(jax.random.key(0))
    np.testing.assert_array_equal(pm.gather(params)["kernel"], np.full((12, 8), 0.5, np.float32))
    np.testing.assert_allclose(np.asarray(jax.jit(pm.apply)(params, X)), np.asarray(model(X)),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_rules_and_replicate_patterns_that_match_nothing(devices):
    pm = axonn_jax.partition(Narrow(), Grid(x=2, y=2, z=2), X, replicate=["narow"],
                             rules={"head/kernel": ("y", None)})  # fmt: skip
    text = "\n".join(pm.plan.warnings)
    assert "replicate= pattern 'narow' matches no parameter" in text and "narrow/bias" in text
    assert "rules= pattern 'head/kernel' matches no parameter" in text
    with pytest.raises(ValueError, match=r"replicate= pattern 'narow' matches no parameter.*strict=True"):
        axonn_jax.partition(Narrow(), Grid(x=2, y=2, z=2), X, replicate=["narow"], strict=True)


def test_train_step_inputs_that_cannot_work_are_named(devices):
    import optax

    pm = axonn_jax.partition(Narrow(), Grid(x=2, y=2, z=2), X)
    target = np.ones((8, 8), np.float32)

    def loss(out, batch):
        return jnp.mean((out - target) ** 2)

    for bad in (0, 2.0, -1, True):
        with pytest.raises(ValueError, match=rf"microbatches must be a positive integer, got {bad!r}"):
            pm.value_and_grad(loss, microbatches=bad)
    with pytest.raises(TypeError, match=r"the batch is a dict \(keys \['x'\]\).*inputs="):
        pm.value_and_grad(loss)(pm.init(jax.random.key(0)), {"x": X})
    with pytest.raises(TypeError, match=r"inputs must be a function of the batch.*got a tuple.*Remedy"):
        pm.train_step(loss, optax.sgd(0.1), inputs=(X,))  # at construction, not at the first step
    step = pm.train_step(loss, optax.sgd(0.1))
    params, opt_state = step.init(pm.init(jax.random.key(0)))
    # an (inputs, targets) batch without inputs=: Flax's "takes 2 positional arguments", and the remedy
    with pytest.raises(TypeError, match=r"takes 2 positional arguments.*called with 2 positional inputs where "
                                        r"the example call.*had 1.*inputs=lambda batch: batch\[:1\]"):
        step(params, opt_state, (X, target))
    with pytest.raises(TypeError, match=r"opt_state must be what step.init\(params\) returned"):
        step(params, optax.sgd(0.1).init(params), X)
    new_params, opt_state, _ = step(params, opt_state, X)
    with pytest.raises(ValueError, match=r"parameter '\['narrow'\]\['bias'\]' has been deleted.*donated"):
        step(params, opt_state, X)  # the first step donated these


@pytest.mark.parametrize("grid", ["x=2,y=2,z=2", "pipeline=2,x=2,data=2"])
def test_a_loss_that_is_not_one_float_scalar_is_named_with_the_remedy(devices, grid):
    """A loss returning ``(loss, metrics)``, a per-example vector or an integer count failed
    inside JAX ("Gradient only defined for scalar-output functions", or an integer's zero
    gradient) on both engines; each is refused by what it returned, with the remedy, and a
    scalar loss still trains (as plain ``jax.value_and_grad``)."""
    import optax

    pm = axonn_jax.partition(Narrow(), Grid.parse(grid), X)
    params = pm.init(jax.random.key(0))
    cases = [
        (lambda out, batch: (jnp.mean(out**2), jnp.max(out)), r"loss_fn returned a tuple of 2 items.*pass has_aux=True"),
        (lambda out, batch: jnp.mean(out**2, axis=-1), r"loss_fn returned an array of shape \(8,\).*loss\.mean\(\)"),
        (lambda out, batch: jnp.sum(out > 0), r"loss_fn returned a int32 scalar.*astype\(jnp\.float32\)"),
        (lambda out, batch: 1.0, r"loss_fn returned a float, not an array"),
    ]  # fmt: skip
    for loss_fn, message in cases:
        with pytest.raises(TypeError, match=message):
            pm.value_and_grad(loss_fn)(params, X)
    loss_fn, message = cases[0]
    step = pm.train_step(loss_fn, optax.sgd(0.1))
    with pytest.raises(TypeError, match=message):
        step(*step.init(params), X)
    loss, _ = pm.value_and_grad(lambda out, batch: jnp.mean(out**2))(params, X)
    expected = jnp.mean(Narrow().apply({"params": pm.gather(params)}, X) ** 2)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_inputs_with_other_feature_dims_are_named_with_the_parameter_they_change(devices):
    """An input with another feature dim than the example's failed deep in the executor
    with "dot_general requires contracting dimensions to have the same shape" (linen, on
    both engines). Now the call is refused naming the parameter whose shape it changes; an
    nnx model (whose layers hold their parameters, so tracing itself fails) gets the shapes
    compared with the example's. Another batch size still runs."""
    from flax import nnx

    from axonn_jax.models import MLP

    x = np.ones((8, 12), np.float32)
    for grid in (Grid(x=2, data=4), Grid(pipeline=2, x=2, data=2)):
        pm = axonn_jax.partition(MLP(features=(16, 16, 4)), grid, x)
        params = pm.init(jax.random.key(0), x)
        with pytest.raises(ValueError, match=r"inputs of shapes \[\(8, 10\)\] make parameter 'dense_0/kernel' of "
                                             r"shape \(10, 16\), but it was planned .* as \(12, 16\).*Remedy"):
            pm.value_and_grad(lambda out, batch: jnp.mean(out**2))(params, np.ones((8, 10), np.float32))
        assert pm.forward(params, np.ones((16, 12), np.float32)).shape == (16, 4)

    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(12, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    pm = axonn_jax.partition(Two(nnx.Rngs(0)), Grid(x=2, data=4), x)
    with pytest.raises(TypeError, match=r"called with inputs of shapes \[\(8, 10\)\] where the example inputs .* had "
                                        r"\[\(8, 12\)\].*Remedy"):
        pm.apply(pm.init(jax.random.key(0), x), np.ones((8, 10), np.float32))


def test_an_opt_state_made_for_another_step_is_refused_with_the_remedy(devices):
    """Another optimizer's state, or state offloaded where the step keeps it on the device (and
    back), used to fail inside optax ("the number of updates and states has to be the same in
    chain") or JAX (memory kinds); refused before anything runs, and the remedy runs."""
    import optax

    pm = axonn_jax.partition(Narrow(), Grid(x=2, z=2, data=2), X)

    def loss(out, batch):
        return jnp.mean(out**2)

    adamw = pm.train_step(loss, optax.adamw(1e-3), precision="bf16")
    offloaded = pm.train_step(loss, optax.adamw(1e-3), precision="bf16", offload=True)
    sgd = pm.train_step(loss, optax.sgd(0.1), precision="bf16")
    params, state = adamw.init(pm.init(jax.random.key(0)))
    with pytest.raises(ValueError, match=r"opt_state was made for another step.*Remedy: params, opt_state = step.init"):
        sgd(params, state, X)
    for step, other in ((offloaded, adamw), (adamw, offloaded)):
        params, state = other.init(pm.init(jax.random.key(0)))
        with pytest.raises(ValueError, match=r"is in (pinned_host|device) memory, but this step keeps it in .*Remedy"):
            step(params, state, X)
        params, state = step.init(pm.init(jax.random.key(0)))  # the remedy
        step(params, state, X)


def test_a_pipeline_refuses_inputs_that_make_the_model_run_other_operations(devices):
    """A GPT planned on pipeline=2 for 16 tokens, called with 15 (its position embeddings are
    sliced: one more operation), used to fail deep inside with a KeyError, and a second call
    with an AttributeError. Refused with the remedy, every time; another batch size runs."""
    from axonn_jax.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=4, max_seq_len=16))
    pm = axonn_jax.partition(model, Grid(pipeline=2, x=2, z=2), np.zeros((4, 16), np.int32))
    params = pm.init(jax.random.key(0))
    tokens = np.random.default_rng(1).integers(0, 64, (8, 16)).astype(np.int32)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"inputs \[int32\(4, 15\)\] make the model run other operations.*"
                                             r"pipeline stages.*Remedy: call with inputs of the example's shapes"):
            pm.apply(params, tokens[:4, :15])
    out = pm.apply(params, tokens)  # 8 rows where the example had 4: the same operations
    np.testing.assert_allclose(np.asarray(out), np.asarray(model.apply({"params": pm.gather(params)}, tokens)),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


class _Masked(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        h = nn.Dense(16, name="a")(x)
        return nn.Dense(4, name="b")(jnp.where(mask[:, None], h, 0.0))


def test_a_pipeline_names_an_input_dtype_other_than_the_example_s(devices):
    """Partitioned with a bool mask, called with an int32 one of the same shape: the
    conversion is one more operation, so the stages cut for the example do not fit. The
    refusal used to speak of shapes only (the shapes are the example's); it names the
    dtypes of both calls and the cast that helps."""
    x, mask = np.ones((8, 12), np.float32), np.ones((8,), bool)
    pm = axonn_jax.partition(_Masked(), Grid(pipeline=2, x=2, z=2), x, mask)
    params = pm.init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"inputs \[float32\(8, 12\), int32\(8,\)\] \(the example's: "
                                         r"\[float32\(8, 12\), bool\(8,\)\]; a dtype other than the example's.*"
                                         r"cast the inputs to the example's dtypes\)"):  # fmt: skip
        pm.apply(params, x, mask.astype(np.int32))


@pytest.mark.parametrize("grid", [dict(x=2, z=2, data=2), dict(pipeline=2, x=2, z=2)],
                         ids=["x2z2data2", "pipeline2"])  # fmt: skip
def test_weights_loaded_into_params_beside_float32_masters_are_refused(grid, devices):
    """With bf16 parameters the step keeps float32 masters in opt_state and updates those:
    weights loaded into params afterwards used to be used for one loss and then silently
    replaced by the old masters. Refused, naming the remedy, which works; with fp32 (no
    masters) the params given are the weights, as before, and the step takes them."""
    import optax

    pm = axonn_jax.partition(Narrow(), Grid(**grid), X)
    target = np.ones((8, 8), np.float32)

    def loss(out, batch):
        return jnp.mean((out - target) ** 2)

    loaded = Narrow().init(jax.random.key(123), X)["params"]
    step = pm.train_step(loss, optax.sgd(0.0), precision="bf16")
    params, opt_state = step.init(pm.init(jax.random.key(0)))
    params, opt_state, _ = step(params, opt_state, X)  # what a step returned: accepted
    with pytest.raises(ValueError, match=r"params are not the ones.*float32 master.*step\.init\(new_params\)"):
        step(pm.shard(loaded), opt_state, X)
    params, opt_state = step.init(pm.shard(loaded))  # the remedy
    params, opt_state, _ = step(params, opt_state, X)
    after = jax.tree.leaves(pm.gather(params, opt_state))  # lr 0: the loaded weights stay
    for got, want in zip(after, jax.tree.leaves(loaded)):
        np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=0)
    fp32 = pm.train_step(loss, optax.sgd(0.0))
    _, state32 = fp32.init(pm.init(jax.random.key(0)))
    new, _, _ = fp32(pm.shard(loaded), state32, X)
    for got, want in zip(jax.tree.leaves(pm.gather(new)), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(got, np.asarray(want))


@pytest.mark.parametrize("grid", [dict(x=2, y=2, z=2), dict(pipeline=2, x=2, z=2)],
                         ids=["x2y2z2", "pipeline2"])  # fmt: skip
def test_train_step_misuse_is_named_with_the_remedy(grid, devices):
    """Another model's params at step.init, the optimizer factory, params and state a step
    donated, and jax.jit around the step: each refused at once, naming what to do."""
    import optax

    pm = axonn_jax.partition(Narrow(), Grid(**grid), X)
    target = np.ones((8, 8), np.float32)

    def loss(out, batch):
        return jnp.mean((out - target) ** 2)

    with pytest.raises(TypeError, match=r"optax\.adam, not a GradientTransformation.*optax\.adam\(1e-3\)"):
        pm.train_step(loss, optax.adam)
    step = pm.train_step(loss, optax.adam(1e-3))
    params = pm.init(jax.random.key(0))
    bigger = jax.tree.map(lambda a: np.zeros(tuple(2 * d for d in a.shape), np.float32), pm.gather(params))
    with pytest.raises(ValueError, match=r"'narrow/bias' has shape \(12,\), the plan expects \(6,\)"):
        step.init(bigger)
    params, opt_state = step.init(params)
    with pytest.raises(TypeError, match=r"compiles itself.*without jax\.jit"):
        jax.jit(step)(params, opt_state, X)
    new_params, new_state, _ = step(params, opt_state, X)
    donated = r"has been deleted: it was donated to a step.*Remedy: use what the step returned"
    with pytest.raises(ValueError, match="parameter .*" + donated):
        pm.apply(params, X)
    with pytest.raises(ValueError, match="parameter .*" + donated):
        pm.gather(params)
    with pytest.raises(ValueError, match="optimizer state leaf .*" + donated):
        step(new_params, opt_state, X)
    step(new_params, new_state, X)  # what the step returned works


def test_fallback_warnings_name_the_model_line_once(devices):
    """A rule-less op inside a jitted library call is reported at the model's own line, merged."""

    class Inverses(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(16)(x)
            for _ in range(3):  # jnp.linalg.inv is a jit: its body (lu: no rule) is inlined
                h = jnp.linalg.inv(h.reshape(-1, 4, 4) + 4 * jnp.eye(4)).reshape(h.shape)
            return nn.Dense(8)(h)

    pm = axonn_jax.partition(Inverses(), Grid(x=2, y=2, z=2), X)
    (warning,) = [w for w in pm.plan.warnings if "replicated lu " in w]
    line = next(n for n, text in enumerate(open(__file__), 1) if "h = jnp.linalg.inv(h.reshape(" in text)
    assert f"test_partition_errors.py:{line}" in warning and warning.endswith("(3 times)"), warning


class IntegerParam(nn.Module):
    """A counter declared with ``self.param``: an int32 leaf in the trainable tree."""

    @nn.compact
    def __call__(self, x):
        count = self.param("count", lambda key: jnp.zeros((), jnp.int32))
        return nn.Dense(8, name="out")(x) * (count + 1).astype(jnp.float32)


class IntegerState(nn.Module):
    """The remedy: the counter as model state (carried and updated, not trained)."""

    @nn.compact
    def __call__(self, x):
        count = self.variable("state", "count", lambda: jnp.zeros((), jnp.int32))
        count.value = count.value + 1
        return nn.Dense(8, name="out")(x) * (1.0 + count.value.astype(jnp.float32) / 10)


def test_integer_parameter_is_named_with_the_remedy_that_works(devices):
    """jax.grad refuses an int32 leaf deep in the step ("grad requires real-valued inputs"):
    value_and_grad and train_step name it when built; the remedy trains like plain optax."""
    import optax

    grid = Grid(x=2, z=2, data=2)
    loss = lambda out, batch: jnp.mean(out**2)  # noqa: E731
    pm = axonn_jax.partition(IntegerParam(), grid, X)
    plain_params = IntegerParam().init(jax.random.key(0), X)["params"]
    np.testing.assert_allclose(np.asarray(jax.jit(pm.apply)(pm.shard(plain_params), X)),
                               IntegerParam().apply({"params": plain_params}, X), rtol=1e-6)  # fmt: skip
    for build in (lambda: pm.value_and_grad(loss), lambda: pm.train_step(loss, optax.adam(1e-2))):
        with pytest.raises(TypeError, match=r"parameter 'count' int32\[\] is not floating-point.*"
                                            r"Remedy: .*self.variable\('state'"):  # fmt: skip
            build()
    # the remedy: 3 Adam steps equal plain Flax + optax on one device, the counter included
    model = IntegerState()
    variables = model.init(jax.random.key(0), X)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def plain(params, state, opt_state):
        def f(p):
            out, updates = model.apply({"params": p, **state}, X, mutable=["state"])
            return loss(out, X), updates

        (value, updates), grads = jax.value_and_grad(f, has_aux=True)(params)
        changes, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, changes), updates, opt_state, value

    params, state, opt_state = variables["params"], {"state": variables["state"]}, optimizer.init(variables["params"])
    pm = axonn_jax.partition(model, grid, X, mutable=["state"])
    step = pm.train_step(loss, optimizer)
    got, got_opt = step.init(pm.shard(variables))
    for _ in range(3):
        params, state, opt_state, want_loss = plain(params, state, opt_state)
        got, got_opt, got_loss = step(got, got_opt, X)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    final = pm.gather(got)
    assert final["state"]["count"].dtype == np.int32 and int(final["state"]["count"]) == 4
    assert int(state["state"]["count"]) == 4
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(final["params"])):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_an_optimizer_whose_update_needs_the_loss_is_refused_with_the_remedy(devices):
    """``optax.contrib.reduce_on_plateau`` needs ``update(..., value=loss)``; pm.train_step calls
    ``update(grads, state, params)``, and ``step.init`` failed inside optax ("missing 1
    required keyword-only argument: 'value'"). It is refused when the step is built."""
    import optax

    pm = axonn_jax.partition(Narrow(), Grid(x=2, y=2, z=2), X)
    optimizer = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1))
    with pytest.raises(TypeError, match=r"needs value= in optimizer\.update .*pm\.train_step does not pass .*"
                                        r"Remedy: write the step with pm\.value_and_grad"):
        pm.train_step(lambda out, batch: jnp.mean(out**2), optimizer)
    # optax.lbfgs needs three ("missing 3 required keyword-only arguments: ..."): all named
    with pytest.raises(TypeError, match=r"needs value=, grad=, value_fn= in optimizer\.update .*"
                                        r"update\(grads, state, params, value=\.\.\., grad=\.\.\., value_fn=\.\.\.\)"):
        pm.train_step(lambda out, batch: jnp.mean(out**2), optax.lbfgs())


def test_an_optimizer_that_wants_another_params_structure_is_refused_with_the_remedy(devices):
    """``optax.lookahead`` takes ``LookaheadParams`` (fast and slow weights); pm.train_step hands
    the optimizer the model's params tree, and building the step failed with optax's
    ``AttributeError: 'dict' object has no attribute 'fast'``."""
    import optax

    pm = axonn_jax.partition(Narrow(), Grid(x=2, y=2, z=2), X)
    with pytest.raises(TypeError, match=r"cannot take the model's parameters as they are .*'fast'.*"
                                        r"optax\.lookahead: LookaheadParams.*Remedy: write the step"):
        pm.train_step(lambda out, batch: jnp.mean(out**2), optax.lookahead(optax.adam(1e-2), 2, 0.5))


def test_the_optimizer_fingerprint_lists_nan_constants_in_one_order():
    """schedule-free AdamW's update holds a NaN; sorted with the other constants, its place
    depended on the set's order, so two steps built alike could differ and a restore warned
    that the checkpoint was saved by another optimizer update."""
    import optax

    from axonn_jax.runtime.consistency import step_fingerprint

    params = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    prints = {step_fingerprint(optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2), params, {})["optimizer"]
              for _ in range(8)}  # fmt: skip
    assert len(prints) == 1 and "nan" in next(iter(prints)), prints

"""Calls with other inputs than partition()'s example run as the example was traced.

A call with new shapes (another batch, a shorter sequence, a one-token decode step)
is traced again from the example's trace (``partitioner.trace.retrace``): with the
variables' shapes of then, and for nnx with the module's graph of then. A batch the
caller put on other devices is moved onto the mesh; a NumPy int64 batch is the
signature of its int32 form. Each case is checked against the plain single-device
Flax call; each failed before (bounds: 8 simulated CPU devices, grids of 8).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import axonn_jax
from axonn_jax import Grid
from axonn_jax.partitioner.program import call_signature

GRIDS = [Grid(x=2, z=2, data=2), Grid(x=2, y=2, z=2)]
IDS = ["x2z2d2", "x2y2z2"]


class _Net(nnx.Module):
    """Linear → BatchNorm → Dropout → Linear: both depend on the train/eval mode."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1, self.bn = nnx.Linear(16, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs)
        self.drop, self.l2 = nnx.Dropout(0.5, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


@pytest.mark.parametrize("grid", GRIDS, ids=IDS)
def test_an_nnx_model_s_programs_keep_the_mode_it_was_partitioned_in(devices, grid):
    """``model.eval()``, an evaluation pm, then ``model.train()`` to train on (the
    documented evaluation recipe): the evaluation pm's program for a new batch size
    runs in eval mode too. It used to be traced from the module as it was at the call,
    in train mode: dropout and batch statistics, off by 2.7, silently."""
    model = _Net(nnx.Rngs(0))
    x8 = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32) * 3 + 1
    plain = nnx.clone(model)
    plain.eval()
    model.eval()
    evaluate = axonn_jax.partition(model, grid, x8)
    variables = evaluate.init(jax.random.key(0))  # an nnx module's own values
    model.train()  # back to training, as the recipe goes on
    for x in (x8, x8[:4]):  # the example's batch, then a new one
        out, _ = evaluate.apply(variables, x)
        np.testing.assert_allclose(np.asarray(out), np.asarray(plain(x)), rtol=1e-5, atol=1e-5)


class _Cached(nn.Module):
    """A cache sized by ``init``'s input (HF's ``init_cache`` on the maximum length):
    each call writes its tokens at the cache's index and reads the whole cache."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="proj")(x)
        k = self.variable("cache", "k", jnp.zeros, h.shape, h.dtype)
        i = self.variable("cache", "i", lambda: jnp.array(0, jnp.int32))
        if not self.is_initializing():
            k.value = jax.lax.dynamic_update_slice(k.value, h, (0, i.value, 0))
            i.value = i.value + x.shape[1]
        return nn.Dense(8, name="out")(k.value)


@pytest.mark.parametrize("grid", GRIDS, ids=IDS)
def test_a_linen_cache_planned_at_its_full_length_serves_shorter_calls(devices, grid):
    """Partitioned on a maximum-length call, the cache has that length; a prefill of 3
    tokens and one-token decode steps then write into it, as ``model.apply`` does with
    the same variables. The calls' programs used to initialise the model again on their
    own inputs, which made a cache of their length and refused it."""
    model, length = _Cached(), 8
    x = np.random.default_rng(1).normal(size=(4, length, 12)).astype(np.float32)
    variables = model.init(jax.random.key(0), x)
    pm = axonn_jax.partition(model, grid, x, mutable=["cache"])
    ours, theirs = pm.shard(variables), variables
    for start, stop in ((0, 3), (3, 4), (4, 5)):  # prefill, then two decode steps
        part = x[:, start:stop]
        out, updates = pm.apply(ours, part, mutable=["cache"])
        ref, ref_updates = model.apply(theirs, part, mutable=["cache"])
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
        ours, theirs = {**ours, **updates}, {**theirs, **ref_updates}
    np.testing.assert_allclose(np.asarray(pm.gather(ours)["cache"]["k"]), np.asarray(theirs["cache"]["k"]),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    assert int(pm.gather(ours)["cache"]["i"]) == 5


class _Small(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="out")(nn.gelu(nn.Dense(16, name="hidden")(x)))


def test_a_call_with_a_batch_the_grid_does_not_divide_runs_replicated_with_a_warning(devices):
    """As ``partition()`` does with such an example: a batch of 1 (the next step of a
    batch-1 generation) or 3 on data·z = 4 is replicated, with a warning naming the
    input, and exact. It used to be refused with the warning's own text ("so it is
    replicated"), while the same batch ran through ``pm.train_step``. ``strict=True``
    refuses it."""
    model, grid = _Small(), Grid(x=2, z=2, data=2)
    x8 = np.random.default_rng(2).normal(size=(8, 12)).astype(np.float32)
    params = model.init(jax.random.key(0), x8)["params"]
    pm = axonn_jax.partition(model, grid, x8)
    for n in (1, 3):
        with pytest.warns(UserWarning, match=rf"input 0 has shape \({n}, 12\).*not divisible by data·z.*"
                                             r"replicated.*Remedy"):  # fmt: skip
            out = pm.apply(pm.shard(params), x8[:n])
        np.testing.assert_allclose(np.asarray(out), np.asarray(model.apply({"params": params}, x8[:n])),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    strict = axonn_jax.partition(model, grid, x8, strict=True)
    with pytest.raises(ValueError, match=r"batch dim 3.*not divisible by data·z.*strict=True"):
        strict.apply(strict.shard(params), x8[:3])


def test_a_batch_put_on_other_devices_is_moved_onto_the_mesh(devices):
    """A batch committed to one device, or to a mesh of the same devices in another order,
    trains as the host batch does (``pm.train_step``, eager ``pm.value_and_grad``,
    ``pm.apply``); the single-mesh step used to fail inside ``jax.jit`` with "incompatible
    devices" (the pipeline engine placed them already)."""
    model, grid = _Small(), Grid(x=2, z=2, data=2)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(8, 12)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32)
    pm = axonn_jax.partition(model, grid, x)
    loss_fn = lambda out, batch: jnp.mean((out - batch[1]) ** 2)  # noqa: E731
    step = pm.train_step(loss_fn, optax.sgd(0.1), inputs=lambda batch: batch[:1])
    grads = pm.value_and_grad(loss_fn, inputs=lambda batch: batch[:1])
    params = pm.init(jax.random.key(0))
    want_loss, _ = grads(params, (x, y))
    want_out = np.asarray(pm.apply(params, x))
    _, _, want_step = step(*step.init(params), (x, y))
    reversed_mesh = Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("a", "b"))
    for place in (lambda v: jax.device_put(v, jax.devices()[3]),
                  lambda v: jax.device_put(v, NamedSharding(reversed_mesh, P("a")))):  # fmt: skip
        batch = (place(x), place(y))
        _, _, loss = step(*step.init(params), batch)
        assert float(loss) == pytest.approx(float(want_step), rel=1e-6)
        assert float(grads(params, batch)[0]) == pytest.approx(float(want_loss), rel=1e-6)
        np.testing.assert_allclose(np.asarray(pm.apply(params, batch[0])), want_out, rtol=1e-6, atol=1e-7)


def test_a_numpy_int64_batch_has_the_signature_of_its_int32_form(devices):
    """Without ``jax_enable_x64`` JAX computes a NumPy int64 batch as int32: both are one
    signature, so one compiled program (a pipeline compiled every stage again when an
    int64 NumPy batch followed a JAX one of the same shape)."""
    tokens = np.arange(32).reshape(4, 8)
    assert not jax.config.jax_enable_x64
    assert call_signature((tokens.astype(np.int64),), {}) == call_signature((jnp.asarray(tokens),), {})
    assert call_signature((tokens.astype(np.int64),), {}) != call_signature((tokens.astype(np.float32),), {})


class _EncoderDecoder(nn.Module):
    def setup(self):
        self.embed, self.enc = nn.Embed(64, 32), nn.Dense(32)
        self.dec, self.head = nn.Dense(32), nn.Dense(64)

    def encode(self, src):
        return nn.gelu(self.enc(self.embed(src)))

    def decode(self, memory, tgt):
        return self.head(nn.gelu(self.dec(self.embed(tgt))) + memory.mean(1, keepdims=True))

    def __call__(self, src, tgt):
        return self.decode(self.encode(src), tgt)


@pytest.mark.parametrize("method", ["name", "function"])
def test_a_linen_method_is_partitioned_as_model_apply_runs_it(devices, method):
    """``method=`` as ``model.apply`` takes it, its name or the function itself: the encoder
    of an encoder–decoder partitioned alone (its parameters are those its method reads),
    exact. The function used to be taken for an array input ("dtype object is not a valid
    JAX array type")."""
    model = _EncoderDecoder()
    rng = np.random.default_rng(4)
    src, tgt = rng.integers(0, 64, (4, 8)).astype(np.int32), rng.integers(0, 64, (4, 3)).astype(np.int32)
    params = model.init(jax.random.key(0), src, tgt)["params"]
    encode = "encode" if method == "name" else _EncoderDecoder.encode
    pm = axonn_jax.partition(model, Grid(x=2, z=2, data=2), src, method=encode)
    assert sorted(p.path for p in pm.plan.params) == ["embed/embedding", "enc/bias", "enc/kernel"]
    mine = pm.shard({k: params[k] for k in ("embed", "enc")})
    for rows in (4, 8):  # the example's batch, then another
        batch = np.concatenate([src, src])[:rows]
        np.testing.assert_allclose(np.asarray(pm.apply(mine, batch, method=encode)),
                                   np.asarray(model.apply({"params": params}, batch, method=encode)),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


class _Decoder(nn.Module):
    """Flax's own generation idiom: ``MultiHeadDotProductAttention(decode=True)`` keeps a
    key/value cache that ``init`` sizes by its input (the maximum length) and each call
    extends by one token."""

    decode: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        mask = None if self.decode else nn.make_causal_mask(tokens)
        x = x + nn.MultiHeadDotProductAttention(4, decode=self.decode)(nn.LayerNorm()(x), mask=mask)
        return nn.Dense(64)(nn.LayerNorm()(x))


@pytest.mark.parametrize("grid", GRIDS, ids=IDS)
def test_flax_s_decode_cache_is_initialised_on_init_inputs_and_decodes_one_token_a_call(devices, grid):
    """``init_inputs=`` gives ``model.init`` the maximum length while the example is the
    one-token call: the cache is planned at its full length (a one-token example alone made
    a cache of length 1; a full-length example is no valid decode call). Greedy decoding
    through ``pm.apply`` gives the plain decoder's logits at every step; ``pm.init`` makes
    the full-length cache too."""
    batch, length = 4, 8
    decoder, trained = _Decoder(decode=True), _Decoder()
    prompt = np.random.default_rng(5).integers(0, 64, (batch, 3)).astype(np.int32)
    full = jnp.zeros((batch, length), jnp.int32)
    params = trained.init(jax.random.key(0), full)["params"]
    cache = decoder.init(jax.random.key(0), full)["cache"]
    pm = axonn_jax.partition(decoder, grid, prompt[:, :1], mutable=["cache"], init_inputs=(full,))
    assert jax.tree.map(np.shape, pm.init(jax.random.key(0))["cache"]) == jax.tree.map(np.shape, cache)

    def generate(call, variables):
        logits, token = [], prompt[:, :1]
        for t in range(length):
            out, updates = call(variables, token)
            variables = {**variables, **updates}
            logits.append(np.asarray(out[:, -1]))
            token = prompt[:, t + 1:t + 2] if t + 1 < 3 else logits[-1].argmax(-1)[:, None].astype(np.int32)
        return np.stack(logits, 1)

    ours = generate(lambda v, t: pm.apply(v, t, mutable=["cache"]), pm.shard({"params": params, "cache": cache}))
    plain = generate(lambda v, t: decoder.apply(v, t, mutable=["cache"]), {"params": params, "cache": cache})
    np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=2e-6)


def test_init_inputs_are_refused_for_an_nnx_model(devices):
    with pytest.raises(TypeError, match=r"init_inputs= is for linen models.*Remedy: size its cache"):
        axonn_jax.partition(_Net(nnx.Rngs(0)), Grid(x=2, z=2, data=2), np.ones((8, 16), np.float32),
                            init_inputs=(np.ones((8, 16), np.float32),))  # fmt: skip


class _TimeBlock(nn.Module):
    """GroupNorm → conv, plus the time embedding per channel, → GroupNorm → conv, residual."""

    ch: int

    @nn.compact
    def __call__(self, x, temb):
        h = nn.Conv(self.ch, (3, 3))(nn.swish(nn.GroupNorm(num_groups=2)(x)))
        h = h + nn.Dense(self.ch)(nn.swish(temb))[:, None, None, :]
        h = nn.Conv(self.ch, (3, 3))(nn.swish(nn.GroupNorm(num_groups=2)(h)))
        return h + (x if x.shape[-1] == self.ch else nn.Conv(self.ch, (1, 1))(x))


class _TinyUNet(nn.Module):
    """A diffusion UNet ``model(x, t)`` in small: a sinusoidal time embedding through an MLP
    added in every block, a strided-conv down and a transposed-conv up, a skip concatenated."""

    @nn.compact
    def __call__(self, x, t):
        freqs = jnp.exp(-jnp.arange(4, dtype=jnp.float32))
        temb = jnp.concatenate([jnp.sin(t[:, None] * freqs), jnp.cos(t[:, None] * freqs)], -1)
        temb = nn.Dense(16)(nn.swish(nn.Dense(16)(temb)))
        h1 = _TimeBlock(8)(nn.Conv(8, (3, 3))(x), temb)
        h2 = _TimeBlock(16)(nn.Conv(8, (3, 3), strides=(2, 2))(h1), temb)
        up = nn.ConvTranspose(8, (2, 2), strides=(2, 2))(h2)
        u = _TimeBlock(8)(jnp.concatenate([up, h1], -1), temb)
        return nn.Conv(x.shape[-1], (3, 3))(nn.swish(nn.GroupNorm(num_groups=2)(u)))


UNET_GRIDS = [Grid(y=2, data=4), Grid(x=2, y=2, z=2)]
UNET_IDS = ["y2d4", "x2y2z2"]


def _unet_batch(n: int):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(16, 8, 8, 4)).astype(np.float32)
    t, noise = rng.uniform(0, 1000, (16,)).astype(np.float32), rng.normal(size=(16, 8, 8, 4)).astype(np.float32)
    return x[:n], t[:n], noise[:n]


def _stored_specs(tree) -> list:
    return [leaf.sharding.spec for leaf in jax.tree.leaves(tree)]


@pytest.mark.filterwarnings("ignore:input 0 has shape:UserWarning")  # batches 3, 1: replicated
@pytest.mark.parametrize("grid", UNET_GRIDS, ids=UNET_IDS)
def test_a_unet_partitioned_at_one_batch_runs_other_batches_with_its_parameter_layouts(devices, grid):
    """Partitioned on a batch of 16, a diffusion UNet serves batches of 4, 3 and 1 (an
    evaluation batch, the last partial batch, a batch-1 sample) with the parameters as
    sharded, exact. Planned afresh at these batches, the time embedding's Dense output is
    no longer split over the batch by y (4 or fewer rows), and the normal/transposed
    alternation of 8 parameters falls the other way (``ResBlock_0/Conv_1`` in the survey's
    UNet): the calls were refused ("give a different parameter layout", naming no parameter),
    where they are now planned around the plan's layouts."""
    model = _TinyUNet()
    x, t, _ = _unet_batch(16)
    params = model.init(jax.random.key(0), x, t)["params"]
    pm = axonn_jax.partition(model, grid, x, t)
    sharded = pm.shard(params)
    specs = _stored_specs(sharded)
    for n in (4, 3, 1):
        xb, tb, _ = _unet_batch(n)
        out = pm.apply(sharded, xb, tb)
        np.testing.assert_allclose(np.asarray(out), np.asarray(model.apply({"params": params}, xb, tb)),
                                   rtol=1e-5, atol=2e-6, err_msg=f"batch {n}")  # fmt: skip
        assert pm.program_for((xb, tb), {}).param_storage == tuple(p.storage for p in pm.plan.params)
    assert _stored_specs(sharded) == specs == [p.spec for p in pm.plan.params]


@pytest.mark.filterwarnings("ignore:input 0 has shape:UserWarning")  # batch 3: replicated
@pytest.mark.parametrize("grid", UNET_GRIDS, ids=UNET_IDS)
def test_a_unet_partitioned_at_one_batch_differentiates_other_batches(devices, grid):
    """``pm.value_and_grad`` of the noise-prediction loss at batches of 4 and 3 (the UNet
    partitioned on 16): the plain model's loss and every gradient, the gradients stored as
    the plan stores the parameters, and the loss planned with the model (no note)."""
    model = _TinyUNet()
    params = model.init(jax.random.key(0), *_unet_batch(16)[:2])["params"]
    pm = axonn_jax.partition(model, grid, *_unet_batch(16)[:2])
    sharded = pm.shard(params)

    def loss_fn(out, batch):
        return jnp.mean((out - batch[2]) ** 2)

    grads = pm.value_and_grad(loss_fn, inputs=lambda batch: batch[:2])
    for n in (4, 3):
        batch = _unet_batch(n)
        loss, got = grads(sharded, batch)
        plain = lambda p: loss_fn(model.apply({"params": p}, *batch[:2]), batch)  # noqa: B023, E731
        want_loss, want = jax.value_and_grad(plain)(params)
        assert float(loss) == pytest.approx(float(want_loss), rel=1e-5), f"batch {n}"
        assert _stored_specs(got) == [p.spec for p in pm.plan.params]
        assert grads.loss_notes == {}, grads.loss_notes
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(pm.gather(got))[0], jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6,
                                       err_msg=f"batch {n}: {jax.tree_util.keystr(path)}")  # fmt: skip

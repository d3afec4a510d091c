"""The loss planned with the model (issue 27 item 4).

``pm.value_and_grad(loss_fn)`` traces ``loss_fn ∘ model`` as one program and
plans it with the model's rules, so a cross-entropy over vocabulary-split
logits reduces over the split instead of gathering the logits:

* losses users write (optax's integer-label cross-entropy with a ``where``
  mask, a hand-written ``log_softmax`` + ``take_along_axis`` weighted by a mask
  in the batch, a max-margin loss that differentiates the max over the split
  vocabulary; dict batches) are planned (no note) and give the plain model's
  loss and every gradient (the bounds of ``test_partition.py``) on two grids
  of the table (``conftest.spread``);
* the traced step of the repo GPT gathers no vocabulary-sized tensor, and its
  redundancy, loss included, is ≤ 1.03 on ``x=4,data=2`` and ``x=2,y=2,z=2``
  (1.040 and 1.032 with the loss after the gathered logits; 1.012 and 1.004 planned);
* a loss that closes over a value of the enclosing ``jax.jit`` cannot be
  planned: it runs after the model's gathered outputs, exactly, with a note;
* an fp16 step's dynamic loss scale is an input: two scales trace and compile
  one program, the loss is planned, and the step equals the plain fp16 step;
* ``pm.report(loss_fn=, batch=)`` matches the compiled step group by group.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import spread

import axonn_jax
from axonn_jax import Grid
from axonn_jax.models import GPT, GPTConfig, next_token_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from redundancy import traced_compute  # noqa: E402

VOCAB = 96  # no other dim of the model has this size (vocabulary-sized gathers are recognised)
CONFIG = GPTConfig(vocab_size=VOCAB, num_layers=2, hidden=32, num_heads=4, max_seq_len=16)
GRIDS = ["x=4,data=2", "x=2,y=2,z=2"]


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(8, 17)).astype(np.int32)
    mask = (rng.random((8, 16)) < 0.7).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def optax_masked(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"], where=None)
    return jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])


def optax_where(logits, batch):
    where = jnp.broadcast_to(batch["mask"][..., None] > 0, logits.shape)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"], where=where)
    return ce.mean()


def log_softmax_take(logits, batch):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    picked = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return -jnp.sum(picked * batch["mask"]) / jnp.sum(batch["mask"])


def max_margin(logits, batch):
    """The max over the vocabulary differentiated (not under stop_gradient, as in a softmax)."""
    label = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.mean(jnp.max(logits, axis=-1) - label)


LOSSES = {f.__name__: f for f in (optax_masked, optax_where, log_softmax_take, max_margin)}


def _plain(loss_fn, params, batch):
    model = GPT(CONFIG)
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(model.apply({"params": p}, batch["inputs"]), batch)))(params)


@pytest.mark.parametrize("name,grid", spread(LOSSES, GRIDS, per_name=1))
def test_losses_users_write_are_planned_and_exact(name, grid, devices):
    loss_fn, batch = LOSSES[name], _batch()
    model = GPT(CONFIG)
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    want_loss, want_grads = _plain(loss_fn, params, batch)
    pm = axonn_jax.partition(model, Grid.parse(grid), batch["inputs"])
    step = pm.value_and_grad(loss_fn, inputs=lambda b: (b["inputs"],))
    loss, grads = jax.jit(step)(pm.shard(params), batch)
    assert step.loss_notes == {}, step.loss_notes
    _assert_equal(loss, pm.gather(grads), want_loss, want_grads)


def _assert_equal(loss, grads, want_loss, want_grads) -> None:
    """The bounds of ``test_partition.py``: loss rel. 1e-5, each gradient leaf 1e-5 of its largest + 1e-6·G."""
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want_grads))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        want = np.asarray(want)
        assert np.max(np.abs(np.asarray(got) - want)) <= 1e-5 * np.max(np.abs(want)) + 1e-6 * scale


@pytest.mark.parametrize("grid", GRIDS)
def test_the_step_gathers_no_logits_and_repeats_nothing(grid, devices):
    """Traced (no compilation): no all-gather yields a vocabulary-sized dim; redundancy ≤ 1.03."""
    from axonn_jax.runtime.step_report import collect

    tokens = _batch()["inputs"]
    report, pm = traced_compute(GPT(CONFIG), (tokens,), next_token_loss, Grid.parse(grid))
    assert report.redundancy <= 1.03, (grid, report.redundancy, report.repeated(3))
    step = pm.value_and_grad(lambda out, b: next_token_loss(out, *b))
    jaxpr = jax.make_jaxpr(step)(pm.param_structs, (tokens,))
    gathers = [t for t in collect(jaxpr.jaxpr.eqns) if t.kind == "all-gather"]
    assert gathers, "the model's depth gathers are found"
    assert not [t for t in gathers if VOCAB in t.result_shape], gathers


def test_a_loss_over_an_enclosing_trace_runs_after_the_model(devices):
    """``w`` is a value of the enclosing jit: not plannable, so the old path, exactly, and a note."""
    batch = _batch()
    model = GPT(CONFIG)
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    pm = axonn_jax.partition(model, Grid(x=2, z=2, data=2), batch["inputs"])
    notes = {}

    @jax.jit
    def step(p, b, w):
        value_and_grad = pm.value_and_grad(lambda out, bb: w * optax_masked(out, bb),
                                           inputs=lambda bb: (bb["inputs"],))  # fmt: skip
        result = value_and_grad(p, b)
        notes.update(value_and_grad.loss_notes)
        return result

    loss, grads = step(pm.shard(params), batch, jnp.float32(2.0))
    assert any("enclosing trace" in note for note in notes.values()), notes
    want_loss, want_grads = _plain(lambda out, b: 2.0 * optax_masked(out, b), params, batch)
    _assert_equal(loss, pm.gather(grads), want_loss, want_grads)


def _fp16_step(pm, loss_fn, params, scale: float):
    """One fp16 SGD step of ``pm.train_step`` from ``params`` with the loss scale set to ``scale``."""
    step = pm.train_step(loss_fn, optax.sgd(0.5), precision="fp16", inputs=lambda b: (b["inputs"],))
    device, state = step.init(pm.shard(params))
    state = state._replace(loss_scale=_with_scale(state.loss_scale, scale))
    return step, step(device, state, _batch())


def test_the_fp16_loss_scale_is_an_input_of_the_planned_loss(devices):
    """Two scales (powers of two: the same scaled arithmetic) trace and compile one program, the
    loss is planned (no note), and both steps equal the plain fp16 step on one device."""
    batch, model = _batch(), GPT(CONFIG)
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    pm = axonn_jax.partition(model, Grid(x=2, z=2, data=2), batch["inputs"])
    traced = []

    def loss_fn(out, b):
        traced.append(1)  # runs when a program is traced, never when it runs
        return optax_masked(out, b)

    step, (got_params, got_state, got_loss) = _fp16_step(pm, loss_fn, params, 2.0**8)
    assert step.loss_notes == {}, step.loss_notes
    traces, run = len(traced), step._program(0).run
    for scale in (2.0**12, 2.0**3):  # the same program: nothing traced, nothing compiled
        device, state = step.init(pm.shard(params))  # the step took the last ones (donated)
        state = state._replace(loss_scale=_with_scale(state.loss_scale, scale))
        new_params, _, loss = step(device, state, batch)
        assert float(loss) == float(got_loss)
        jax.tree.map(np.testing.assert_array_equal, pm.gather(new_params), pm.gather(got_params))
    assert len(traced) == traces and run._cache_size() == 1

    half = jax.tree.map(lambda w: w.astype(jnp.float16), params)  # the plain fp16 step, fp32 masters
    want_loss, want_grads = _plain(lambda o, b: optax_masked(o, b) * jnp.float16(2.0**8), half, batch)
    want = jax.tree.map(lambda w, g: w - 0.5 * g.astype(jnp.float32) / 2.0**8, params, want_grads)
    np.testing.assert_allclose(float(got_loss), float(want_loss) / 2.0**8, rtol=2e-3)  # fp16: eps 2**-10
    trees = [jax.tree.leaves(t) for t in (pm.gather(got_state.optimizer.master), want, params)]
    moved = [float(np.linalg.norm(np.asarray(w) - np.asarray(w0))) for _, w, w0 in zip(*trees)]
    for (got, w, _), step_norm in zip(zip(*trees), moved):  # fp16 gradients: 1e-3 of each update
        err = float(np.linalg.norm(np.asarray(got) - np.asarray(w)))
        assert err <= 1e-3 * step_norm + 1e-6 * max(moved), (err, step_norm)


def _with_scale(loss_scale, scale: float):
    """``loss_scale`` with its scale set to ``scale`` (placed as the step keeps it)."""
    given = jax.device_put(jnp.float32(scale), loss_scale.scale.sharding)
    return dataclasses.replace(loss_scale, scale=given)


def _wire_by_group(transfers, grid) -> dict:
    """(kind, mesh axes of size > 1) → wire bytes of one device."""
    live = lambda axes: tuple(a for a in ("data", "z", "y", "x") if a in axes and grid.axis_size(a) > 1)  # noqa: E731
    groups: dict = {}
    for kind, axes, wire in transfers:
        groups[(kind, live(axes))] = groups.get((kind, live(axes)), 0.0) + wire
    return groups


def test_the_report_with_its_loss_matches_the_compiled_step(devices):
    """``pm.report(loss_fn=, batch=)`` describes the step that runs: group by group, the wire
    bytes of the compiled ``value_and_grad`` (the loss's split max and sums over x included,
    the logits' x all-gather gone), and the plain step's FLOPs count the loss."""
    import itertools

    from axonn_jax.runtime.hlo import collectives, mesh_axis_groups

    grid, tokens = Grid(x=2, y=2, z=2), jax.ShapeDtypeStruct((8, 16), jnp.int32)
    pm = axonn_jax.partition(GPT(CONFIG), grid, tokens)
    loss_fn = lambda out, t: next_token_loss(out, t)  # noqa: E731
    with_loss, model_only = pm.report(tokens, loss_fn=loss_fn, batch=tokens), pm.report(tokens)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          jax.eval_shape(pm.init, jax.random.key(0)), pm.param_shardings)  # fmt: skip
    text = jax.jit(pm.value_and_grad(loss_fn)).lower(params, tokens).compile().as_text()
    ids, names = np.vectorize(lambda d: d.id)(pm.mesh.devices), pm.mesh.axis_names
    axes_of = {mesh_axis_groups(ids, names, axes): axes
               for r in range(1, len(names) + 1) for axes in itertools.combinations(names, r)}  # fmt: skip
    compiled = [(c.kind, axes_of[frozenset(frozenset(g) for g in c.groups)], c.wire_bytes)
                for c in collectives(text, num_devices=8) if not c.trivial]  # fmt: skip
    ours = [(t.kind, t.axes, t.wire_bytes) for t in with_loss.communication.transfers]
    assert _wire_by_group(ours, grid) == pytest.approx(_wire_by_group(compiled, grid), rel=1e-12)
    before = _wire_by_group([(t.kind, t.axes, t.wire_bytes) for t in model_only.communication.transfers], grid)
    after = _wire_by_group(ours, grid)
    assert after[("all-reduce", ("x",))] > before[("all-reduce", ("x",))]  # the loss's reductions
    assert after[("all-gather", ("x",))] < before[("all-gather", ("x",))]  # no gathered logits
    assert with_loss.compute.plain.total > model_only.compute.plain.total  # the loss's own FLOPs

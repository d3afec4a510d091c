"""A loss with metrics: ``has_aux=True``, as ``jax.value_and_grad`` has it.

``pm.value_and_grad(loss_fn, has_aux=True)`` takes a ``loss_fn`` returning
``(loss, aux)`` (aux: any pytree of arrays) and returns ``((loss, aux), grads)``;
``pm.train_step(..., has_aux=True)`` returns ``(loss, aux)`` where it returns the loss.

* loss, aux and gradients equal the plain ``jax.value_and_grad(..., has_aux=True)``
  on one mesh (the loss planned with the model) and on pipelines (the aux computed on
  the last stage; message-driven and zero-bubble schedules); with microbatches, the aux
  is the mean of the microbatches' aux, as the loss is;
* a loss that cannot be planned (it closes over the enclosing jit) returns its aux too;
* a train step returns the aux of the parameters it started from; with fp16 the aux is
  not scaled (its copy of the loss equals the unscaled loss, bit for bit);
* a model with state (BatchNorm) returns ``(((loss, aux), updates), grads)``;
* wrong returns are refused by name: a scalar with ``has_aux=True``, a pair without it,
  an integer aux that microbatches would average.

Pipelines under ``mpiexec`` (the aux sent from the last stage to every rank) are
covered by ``pipeline_cases.run_case`` (every step there returns an aux).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import axonn_jax
from axonn_jax import Grid
from axonn_jax.models import GPT, GPTConfig

VOCAB = 96
CONFIG = GPTConfig(vocab_size=VOCAB, num_layers=2, hidden=32, num_heads=4, max_seq_len=16)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(8, 17)).astype(np.int32)
    mask = (rng.random((8, 16)) < 0.7).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _inputs(batch):
    return (batch["inputs"],)


def loss_with_metrics(logits, batch):
    """A masked cross-entropy, with the metrics a training loop logs (of several shapes)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    loss = jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])
    hits = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
    return loss, {"accuracy": jnp.sum(hits * batch["mask"]) / jnp.sum(batch["mask"]),
                  "logit_max": jnp.max(logits), "first_logits": logits[0, 0, :5], "loss": loss}  # fmt: skip


def _halves(batch, m: int) -> list:
    rows = len(batch["inputs"]) // m
    return [jax.tree.map(lambda x, k=k: x[k * rows:(k + 1) * rows], batch) for k in range(m)]


def _plain(params, batch, m: int = 1):
    """Loss, aux and gradients of the plain model, the mean over ``m`` microbatches."""
    model = GPT(CONFIG)
    fn = jax.jit(jax.value_and_grad(lambda p, b: loss_with_metrics(model.apply({"params": p}, b["inputs"]), b),
                                    has_aux=True))  # fmt: skip
    parts = [fn(params, b) for b in _halves(batch, m)]
    mean = lambda *xs: sum(np.asarray(x, np.float64) for x in xs) / m  # noqa: E731
    (loss, aux), grads = jax.tree.map(mean, *parts)
    return loss, aux, grads


def _assert_close(got, want, what: str) -> None:
    """The bounds of ``test_partition.py``: 1e-5 of each leaf's largest value, + 1e-6 of the tree's."""
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w)
        assert g.shape == w.shape, (what, jax.tree_util.keystr(path), g.shape, w.shape)
        err = np.max(np.abs(g - w))
        assert err <= 1e-5 * np.max(np.abs(w)) + 1e-6 * scale, (what, jax.tree_util.keystr(path), err)


CASES = [("x=2,y=2,z=2", "message", 1), ("x=4,data=2", "message", 2),
         ("pipeline=2,x=2,z=2", "message", 2), ("pipeline=2,x=2,data=2", "zb", 4)]  # fmt: skip


@pytest.mark.parametrize("grid,schedule,microbatches", CASES)
def test_loss_aux_and_grads_equal_plain_jax(grid, schedule, microbatches, devices):
    batch, model = _batch(), GPT(CONFIG)
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    want_loss, want_aux, want_grads = _plain(params, batch, microbatches)
    pm = axonn_jax.partition(model, Grid.parse(grid), batch["inputs"])
    step = pm.value_and_grad(loss_with_metrics, inputs=_inputs, microbatches=microbatches, schedule=schedule,
                             has_aux=True)  # fmt: skip
    (loss, aux), grads = (step if pm.grid.pipeline > 1 else jax.jit(step))(pm.shard(params), batch)
    assert step.loss_notes == {}, step.loss_notes  # planned with the model (its last stage)
    if pm.grid.pipeline > 1:  # host arrays, 0-d ones too, for any microbatch count
        assert all(type(x) is np.ndarray for x in jax.tree.leaves(aux)), jax.tree.map(type, aux)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert sorted(aux) == sorted(want_aux)
    _assert_close(aux, want_aux, f"aux on {grid}")
    _assert_close(pm.gather(grads), want_grads, f"grads on {grid}")


def test_a_loss_that_cannot_be_planned_returns_its_aux_too(devices):
    """``w`` is a value of the enclosing jit: the loss runs after the model's gathered outputs."""
    batch, model = _batch(), GPT(CONFIG)
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    pm = axonn_jax.partition(model, Grid(x=2, z=2, data=2), batch["inputs"])
    notes = {}

    @jax.jit
    def step(p, b, w):
        def loss_fn(out, bb):
            loss, aux = loss_with_metrics(out, bb)
            return w * loss, aux

        value_and_grad = pm.value_and_grad(loss_fn, inputs=_inputs, has_aux=True)
        result = value_and_grad(p, b)
        notes.update(value_and_grad.loss_notes)
        return result

    (loss, aux), grads = step(pm.shard(params), batch, jnp.float32(1.0))
    assert any("enclosing trace" in note for note in notes.values()), notes
    want_loss, want_aux, want_grads = _plain(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _assert_close(aux, want_aux, "aux")
    _assert_close(pm.gather(grads), want_grads, "grads")


@pytest.mark.parametrize("grid,precision", [("x=2,z=2,data=2", "fp32"), ("pipeline=2,x=2,z=2", "fp32"),
                                            ("x=2,z=2,data=2", "fp16"), ("pipeline=2,x=2,z=2", "fp16")])  # fmt: skip
def test_a_train_step_returns_the_aux_of_the_params_it_started_from(grid, precision, devices):
    batch, model = _batch(), GPT(CONFIG)
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    pm = axonn_jax.partition(model, Grid.parse(grid), batch["inputs"])
    step = pm.train_step(loss_with_metrics, optax.adamw(1e-3), precision=precision, inputs=_inputs,
                         microbatches=2, has_aux=True)  # fmt: skip
    device, opt_state = step.init(pm.shard(params))
    losses = []
    for _ in range(2):
        device, opt_state, (loss, aux) = step(device, opt_state, batch)
        losses.append(float(loss))
        # the aux is not scaled: fp16's scaled loss, divided by the scale, is its own copy
        assert float(aux["loss"]) == float(loss), (float(aux["loss"]), float(loss))
    assert losses[1] < losses[0]
    if precision == "fp32":
        want_loss, want_aux, _ = _plain(params, batch, 2)
        (loss, aux), _ = pm.value_and_grad(loss_with_metrics, inputs=_inputs, microbatches=2,
                                           has_aux=True)(pm.shard(params), batch)  # fmt: skip
        np.testing.assert_allclose(losses[0], float(want_loss), rtol=1e-5)
        _assert_close(aux, want_aux, "aux of a step's value_and_grad")


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(16)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
        return nn.Dense(4)(nn.relu(h))


def test_a_model_with_state_returns_its_aux_and_its_updates(devices):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 4)).astype(np.float32)
    model = BatchNormNet()
    variables = model.init(jax.random.key(0), x)

    def loss_fn(out, batch):
        err = out - batch[1]
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

    def plain(p):
        out, updates = model.apply({**variables, "params": p}, x, mutable=["batch_stats"])
        loss, aux = loss_fn(out, (x, y))
        return loss, (aux, updates)

    (want_loss, (want_aux, want_updates)), want_grads = jax.value_and_grad(plain, has_aux=True)(variables["params"])
    pm = axonn_jax.partition(model, Grid(x=2, data=4), x, mutable=["batch_stats"])
    step = pm.value_and_grad(loss_fn, inputs=lambda b: (b[0],), has_aux=True)
    ((loss, aux), updates), grads = jax.jit(step)(pm.shard(variables), (x, y))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _assert_close(aux, want_aux, "aux")
    _assert_close(updates, want_updates, "updates")
    _assert_close(pm.gather(grads), want_grads, "grads")


@pytest.mark.parametrize("grid", ["x=2,z=2,data=2", "pipeline=2,x=2,z=2"])
def test_wrong_returns_are_refused_by_name(grid, devices):
    batch, model = _batch(), GPT(CONFIG)
    pm = axonn_jax.partition(model, Grid.parse(grid), batch["inputs"])
    params = pm.init(jax.random.key(0))

    def loss_only(out, b):
        return loss_with_metrics(out, b)[0]

    def count(out, b):
        loss, _ = loss_with_metrics(out, b)
        return loss, {"hits": jnp.sum(jnp.argmax(out, -1) == b["targets"])}

    with pytest.raises(TypeError, match=r"returned a float32 array of shape \(\); with has_aux=True it must return a pair"):
        pm.value_and_grad(loss_only, inputs=_inputs, has_aux=True)(params, batch)
    with pytest.raises(TypeError, match="pass has_aux=True"):
        pm.value_and_grad(loss_with_metrics, inputs=_inputs)(params, batch)
    with pytest.raises(TypeError, match=r"aux\['hits'\] has dtype int32; with 2 microbatches"):
        pm.value_and_grad(count, inputs=_inputs, microbatches=2, has_aux=True)(params, batch)
    (_, aux), _ = pm.value_and_grad(count, inputs=_inputs, has_aux=True)(params, batch)
    assert np.asarray(aux["hits"]).dtype == np.int32  # one microbatch: returned as it is


def test_next_token_accuracy_pairs_logits_and_tokens_as_the_loss_does():
    from axonn_jax.models import next_token_accuracy

    logits = jax.nn.one_hot(jnp.array([[1, 2, 3, 0]]), 4) * 5.0  # predicts 1, 2, 3, 0
    window = jnp.array([[9, 1, 2, 0, 0]])  # a loader window: targets 1, 2, 0, 0
    assert float(next_token_accuracy(logits, window)) == 0.75
    assert float(next_token_accuracy(logits, window[:, :-1])) == np.float32(2 / 3)  # the model's input: 3 targets
    with pytest.raises(ValueError, match="do not pair with logits"):
        next_token_accuracy(logits, window[:, :2])


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(420)  # the job's own 360 s timeout fires first
def test_a_loss_refused_on_the_last_stage_raises_on_every_process():
    """Under mpiexec -n 2 (the last stage on rank 1), a loss refused while the last stage is
    traced, and an aux refused after the run, raise on both ranks (rank 0 names rank 1's error):
    caught, the job goes on and trains, where rank 0 used to wait for rank 1 forever."""
    import re

    from mpi_util import run_mpi

    result = run_mpi(2, "refused_loss.py", timeout=360)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    refused = dict(((r, case), msg) for r, case, msg in re.findall(r"REFUSED rank (\d) (\S+): ([^\n]+)", result.stdout))
    assert set(refused) == {(r, c) for r in "01" for c in ("scalar-with-has_aux", "int-aux", "missing-leaf")}, \
        result.stdout  # fmt: skip
    assert "failed on process 1 (TypeError)" in refused[("0", "int-aux")]
    assert "failed on process 1 (ValueError)" in refused[("0", "missing-leaf")]
    assert "'dense_3/kernel' is None but this process runs a stage" in refused[("1", "missing-leaf")]
    assert "has_aux=True it must return a pair" in refused[("0", "scalar-with-has_aux")]
    trained = re.findall(r"TRAINED rank (\d) ([^\n]+)", result.stdout)
    assert sorted(r for r, _ in trained) == ["0", "1"] and trained[0][1] == trained[1][1], result.stdout

"""Inputs as models take them (issue 26 item 5): keyword-only array inputs, ragged graph batches.

* ``model(inputs=x)`` (``def __call__(self, *, inputs)``) trains through
  ``pm.value_and_grad`` and ``pm.train_step`` on three grids of the table (linen
  and nnx between them) and on pipeline grids (the model repeats blocks): ``inputs=`` returning a
  dict gives keyword inputs, and by default a dict batch gives the entries
  named like the keywords given to ``partition()``; microbatches split the
  keyword arrays; the loss gets the batch as the user passed it. Loss, every
  gradient and 5 AdamW steps equal plain Flax + optax (the bounds of
  ``pipeline_cases``).
* A graph batch (nodes ``[N, F]``, edges ``[E, F]``, graphs ``[G, F]``) runs
  on a pipeline grid with one microbatch, equal to the plain model; with
  several it is refused naming every leaf and its leading dim.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from idiom_cases import GraphNet, KeywordOnly, KeywordOnlyNNX, graph_batch, keyword_batch
from partition_cases import adamw_trajectory, reference_apply
from pipeline_cases import LR, STEPS, compare_grads, compare_params

import axonn_jax
from axonn_jax import Grid

#: the five grids of the issue's table, then pipeline grids (4 residual blocks to cut)
GRIDS = ["x=2,y=2,z=2", "x=4,data=2", "z=2,data=4", "x=2,z=2,data=2", "y=2,z=2,data=2"]
PIPELINES = ["pipeline=2,x=2,z=2", "pipeline=4,z=2"]


def _loss(out, batch):
    return jnp.mean((out - batch["targets"]) ** 2)


def _keyword_reference(model, batch):
    """(initial params, (losses, step-1 grads, final params)) of plain Flax + optax, ``model(inputs=x)``."""
    if isinstance(model, nnx.Module):
        graphdef, state, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(state)

        def apply(p, inputs):
            fresh = nnx.clone(state)
            nnx.replace_by_pure_dict(fresh, p)
            return nnx.merge(graphdef, fresh, rest)(inputs=inputs)
    else:
        params = model.init(jax.random.key(0), inputs=batch["inputs"])["params"]

        def apply(p, inputs):
            return model.apply({"params": p}, inputs=inputs)

    params = jax.tree.map(np.asarray, params)
    losses, grads, final = adamw_trajectory(lambda p: _loss(apply(p, batch["inputs"]), batch), params, STEPS, LR)
    return params, (losses, jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, final))


@functools.cache
def _keyword_plain(kind: str):
    """``_keyword_reference`` of the ``kind`` ("linen" or "nnx") model, once per process: every
    grid starts from the same initial params and compares with the same plain run."""
    model = KeywordOnly() if kind == "linen" else KeywordOnlyNNX(rngs=nnx.Rngs(0))
    return _keyword_reference(model, keyword_batch())


#: linen on the grids that split the batch twice or not at all, and on both pipelines; nnx on one of each
CASES = [("linen", g) for g in ["z=2,data=4", "x=2,z=2,data=2", *PIPELINES]] + [("nnx", GRIDS[0]), ("nnx", PIPELINES[0])]


def _train_like_plain(pm, step, batch, init, plain, what: str) -> list[str]:
    """STEPS steps of ``step`` from ``init``: losses, then parameters against the plain run's
    ``(losses, final params, first gradients)``; returns the parameter mismatches."""
    losses, final, grads = plain
    params, state = step.init(pm.shard(init))
    trained = []
    for _ in range(STEPS):
        params, state, loss = step(params, state, batch)
        trained.append(float(loss))
    np.testing.assert_allclose(trained, losses, rtol=1e-5, err_msg=what)
    return compare_params(pm.gather(params), final, init, grads, what)


@pytest.mark.parametrize("kind,grid", CASES, ids=str)
def test_keyword_only_input_trains_like_the_plain_model(kind, grid, devices):
    """``inputs=`` returning a dict (value_and_grad), the default by keyword name (train_step),
    2 microbatches each: loss, every gradient, 5 AdamW steps against the plain model."""
    batch = keyword_batch()
    model = KeywordOnly() if kind == "linen" else KeywordOnlyNNX(rngs=nnx.Rngs(0))
    init, (losses, grads, final) = _keyword_plain(kind)
    grid = Grid.parse(grid)
    pm = axonn_jax.partition(model, grid, inputs=batch["inputs"][:8])
    assert pm.plan.warnings == ()
    what = f"{kind} {grid}"
    vg = pm.value_and_grad(_loss, inputs=lambda b: {"inputs": b["inputs"]}, microbatches=2)
    loss, got = vg(pm.shard(init), batch)
    assert abs(float(loss) - losses[0]) <= 1e-5 * abs(losses[0]), (what, float(loss), losses[0])
    failures = compare_grads(pm.gather(got), grads, what)
    step = pm.train_step(_loss, optax.adamw(LR), microbatches=2)  # the batch's "inputs" by name
    failures += _train_like_plain(pm, step, batch, init, (losses, final, grads), what)
    assert not failures, "\n".join(failures)


def test_keyword_inputs_that_clash_with_a_flag_are_refused(devices):
    batch = keyword_batch()
    pm = axonn_jax.partition(KeywordOnly(), Grid(x=2, z=4), inputs=batch["inputs"])
    params = pm.init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"keyword input\(s\) \['rngs'\]"):
        pm.value_and_grad(_loss, inputs=lambda b: {"inputs": b["inputs"], "rngs": b["targets"]})(
            params, batch, rngs={"dropout": jax.random.key(0)})
    with pytest.raises(TypeError, match=r"partition\(\) was given keyword inputs \['inputs'\]"):
        pm.value_and_grad(_loss)(params, {"x": batch["inputs"], "targets": batch["targets"]})


# --- a ragged batch: a graph net on a pipeline grid --------------------------------------

GRAPH_TARGET = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)


def _graph_loss(out, batch):
    return jnp.mean((out - GRAPH_TARGET) ** 2)


@functools.cache
def _graph_plain():
    """(initial params, plain apply, (losses, step-1 grads, final params)) of the graph net,
    once per process (both pipeline grids compare with it)."""
    batch = graph_batch()
    init, apply = reference_apply(type("Case", (), {"model": GraphNet(), "args": batch})())
    return init, apply, adamw_trajectory(lambda p: _graph_loss(apply(p, *batch), batch), init, STEPS, LR)


@pytest.mark.parametrize("grid", ["pipeline=2,x=2,z=2", "pipeline=2,y=2,z=2"])
def test_graph_batch_runs_whole_on_a_pipeline(grid, devices):
    """nodes [64, F], edges [128, F], graphs [8, F]: one microbatch, the plain model's loss,
    gradients, outputs and 5 AdamW steps; two microbatches refused naming the leaves."""
    batch = graph_batch()
    model = GraphNet()
    init, apply, (losses, grads, final) = _graph_plain()
    pm = axonn_jax.partition(model, Grid.parse(grid), *batch)
    assert len(pm.plan.stages) == 2 and pm.plan.warnings == ()
    what = f"graph net {grid}"
    loss, got = pm.value_and_grad(_graph_loss)(pm.shard(init), batch)
    assert abs(float(loss) - losses[0]) <= 1e-5 * abs(losses[0]), (what, float(loss), losses[0])
    failures = compare_grads(pm.gather(got), grads, what)
    out = pm.forward(pm.shard(init), *batch)
    np.testing.assert_allclose(out, apply(init, *batch), rtol=1e-5, atol=1e-5)  # test_forward's bounds
    step = pm.train_step(_graph_loss, optax.adamw(LR))
    failures += _train_like_plain(pm, step, batch, init, (losses, final, grads), what)
    assert not failures, "\n".join(failures)
    with pytest.raises(ValueError, match=r"microbatches=2 .* leading dims differ \(\[0\]: 64, \[1\]: 128, "
                                         r"\[2\]: 128, \[3\]: 128, \[4\]: 8, .*Remedy: microbatches=1"):
        pm.value_and_grad(_graph_loss, microbatches=2)(pm.shard(init), batch)
    with pytest.raises(ValueError, match=r"leading dims differ"):
        pm.forward(pm.shard(init), *batch, microbatches=2)

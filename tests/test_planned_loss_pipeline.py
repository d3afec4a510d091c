"""The loss planned with the last pipeline stage (issue 27 item 4, on pipeline grids).

On ``pipeline=2,x=2,z=2`` the repo GPT's vocabulary-split logits stay split on
the last stage: its compiled forward+loss+backward program has no
vocabulary-sized all-gather (the loss reduces over the split instead), and
the message-driven pipeline with 1 and 4 microbatches gives the plain model's
loss and every gradient, then 5 AdamW steps, within tests/pipeline_cases.py's
bounds. A loss that cannot be planned runs after the gathered outputs,
exactly, with a note in ``loss_notes``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from pipeline_cases import LR, SEQ, STEPS, VOCAB, compare_grads, compare_params, partitioned, references

import axonn_jax
from axonn_jax.runtime.hlo import collectives
from axonn_jax.runtime.train_step import master_params

GRID = "pipeline=2,x=2,z=2"
COUNTS, TRAJECTORY = (1, 4), 4


@pytest.fixture(scope="module")
def gpt(devices):
    case, pm = partitioned("gpt", GRID)
    return case, pm, references("gpt", COUNTS, TRAJECTORY)


def _vocabulary_gathers(step, case) -> list:
    """All-gathers of logits (a result with the sequence and vocabulary dims; the output
    projection's depth gather is weight-shaped) in the last stage's compiled loss program."""
    last = step.stage_programs(case.inputs(case.batch(1)))[-1]
    found = collectives(last.forward_backward.as_text())
    assert any(c.kind == "all-gather" for c in found), "the stage's depth gathers are found"
    return [c for c in found if c.kind == "all-gather" and any({SEQ, VOCAB} <= set(dims) for _, dims in c.shapes)]


@pytest.mark.parametrize("m", COUNTS)
def test_the_last_stage_plans_the_loss_exactly(gpt, m):
    case, pm, refs = gpt
    ref = refs[m]
    step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=m, schedule="message")
    loss, grads = step(pm.shard(ref.init), case.batch(m))
    assert step.loss_notes == {}, step.loss_notes
    assert abs(float(loss) - ref.losses[0]) <= 1e-5 * abs(ref.losses[0]), (float(loss), ref.losses[0])
    failures = compare_grads(pm.gather(grads), ref.grads, f"{GRID} m={m}")
    assert not failures, "\n".join(failures)
    assert not _vocabulary_gathers(step, case)


def test_adamw_steps_with_the_planned_loss(gpt):
    case, pm, refs = gpt
    ref = refs[TRAJECTORY]
    step = pm.train_step(case.loss, optax.adamw(LR), inputs=case.inputs, microbatches=TRAJECTORY)
    params, opt_state = step.init(pm.shard(ref.init))
    losses = []
    for _ in range(STEPS):
        params, opt_state, loss = step(params, opt_state, case.batch(TRAJECTORY))
        losses.append(float(loss))
    assert step.value_and_grad.loss_notes == {}
    for got, want in zip(losses, ref.losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref.losses)
    failures = compare_params(pm.gather(params), ref.final, ref.init, ref.grads, f"{GRID} AdamW")
    assert not failures, "\n".join(failures)


def test_a_loss_that_cannot_be_planned_runs_after_the_gathered_outputs(gpt, monkeypatch):
    from axonn_jax.runtime.pipeline import setup

    def refuse(*args, **kwargs):
        raise ValueError("planted refusal")

    monkeypatch.setattr(setup, "loss_program", refuse)
    case, pm, refs = gpt
    ref = refs[1]
    step = pm.value_and_grad(lambda out, b: case.loss(out, b), inputs=case.inputs, microbatches=1)
    loss, grads = step(pm.shard(ref.init), case.batch(1))
    assert [n for n in step.loss_notes.values() if "planted refusal" in n], step.loss_notes
    assert abs(float(loss) - ref.losses[0]) <= 1e-5 * abs(ref.losses[0])
    assert not compare_grads(pm.gather(grads), ref.grads, "fallback")
    assert _vocabulary_gathers(step, case), "the fallback gathers the logits"


def test_the_pipeline_report_with_its_loss(gpt):
    """``pm.report(loss_fn=, batch=)`` on the pipeline grid: the last stage's traced step reduces
    over the split logits (x all-reduces of token-shaped values) and gathers none."""
    case, pm, _ = gpt
    tokens = case.batch(1)
    with_loss = pm.report(tokens, loss_fn=case.loss, batch=tokens)
    model_only = pm.report(tokens)

    def logits_gathers(report):
        return [t for t in report.stages[-1].communication.transfers
                if t.kind == "all-gather" and {SEQ, VOCAB} <= set(t.result_shape)]  # fmt: skip

    assert logits_gathers(model_only) and not logits_gathers(with_loss)
    sums = [t for t in with_loss.stages[-1].communication.transfers
            if t.kind == "all-reduce" and t.axes == ("x",) and VOCAB not in t.result_shape]  # fmt: skip
    assert len(sums) > len([t for t in model_only.stages[-1].communication.transfers
                            if t.kind == "all-reduce" and t.axes == ("x",)])  # fmt: skip
    assert with_loss.compute.plain.total > model_only.compute.plain.total  # the loss's FLOPs counted


def _fp16_state(step, pm, params, scale: float):
    """``step.init`` from ``params`` with the dynamic loss scale set to ``scale``."""
    device, state = step.init(pm.shard(params))
    given = jax.device_put(jnp.float32(scale), state.loss_scale.scale.sharding)
    return device, state._replace(loss_scale=dataclasses.replace(state.loss_scale, scale=given))


@pytest.mark.parametrize("across_stages", [False, True], ids=["per_stage", "across_stages"])
def test_fp16_pipelined_steps_scale_the_loss_skip_overflows_and_compile_once(gpt, across_stages):
    """fp16 on a pipeline: the loss scale is an input of the last stage (a new scale traces and
    compiles nothing), a step equals the plain fp16 step with float32 masters, and a step with a
    non-finite gradient is skipped with the scale halved; per-stage updates, and the rounds of an
    update that mixes stages (a global norm, too large to clip: SGD's step stays checkable)."""
    case, pm, refs = gpt
    init, batch, m = refs[1].init, case.batch(2), 2
    traced = []

    def loss_fn(out, b):
        traced.append(1)  # runs when a program is traced, never when it runs
        return case.loss(out, b)

    sgd = optax.chain(optax.clip_by_global_norm(1e9), optax.sgd(0.5)) if across_stages else optax.sgd(0.5)
    step = pm.train_step(loss_fn, sgd, precision="fp16", inputs=case.inputs, microbatches=m)
    assert (step.across_stages is not None) == across_stages
    device, state = _fp16_state(step, pm, init, 2.0**8)
    got_device, got_state, got_loss = step(device, state, batch)
    assert step.loss_notes == {}, step.loss_notes
    assert (float(got_state.loss_scale.scale), int(got_state.loss_scale.good_steps)) == (2.0**8, 1)
    masters = pm.gather(master_params(pm.engine, got_device, got_state))
    traces = len(traced)
    for scale in (2.0**12, 2.0**3):  # powers of two: the same scaled arithmetic, nothing traced
        new_device, new_state, loss = step(*_fp16_state(step, pm, init, scale), batch)
        assert float(loss) == float(got_loss)
        jax.tree.map(np.testing.assert_array_equal, pm.gather(master_params(pm.engine, new_device, new_state)),
                     masters)  # fmt: skip
    assert len(traced) == traces

    half = jax.tree.map(lambda w: jnp.asarray(w, jnp.float16), init)  # the plain fp16 step
    args = case.inputs(batch)

    def plain(p):
        return case.loss(case.model.apply({"params": p}, *args), batch) * jnp.float16(2.0**8)

    want_loss, want_grads = jax.value_and_grad(plain)(half)
    want = jax.tree.map(lambda w, g: w - 0.5 * g.astype(jnp.float32) / 2.0**8, init, want_grads)
    np.testing.assert_allclose(float(got_loss), float(want_loss) / 2.0**8, rtol=2e-3)  # fp16: eps 2**-10
    trees = [jax.tree.leaves(t) for t in (masters, want, init)]
    moved = [float(np.linalg.norm(np.asarray(w) - np.asarray(w0))) for _, w, w0 in zip(*trees)]
    for (got, w, _), step_norm in zip(zip(*trees), moved):  # fp16 gradients: 1e-3 of each update
        err = float(np.linalg.norm(np.asarray(got) - np.asarray(w)))
        assert err <= 1e-3 * step_norm + 1e-6 * max(moved), (err, step_norm)

    # an fp16 weight that overflowed (inf): every gradient downstream is non-finite (set in the
    # weights the step starts from: a step refuses device params other than its masters' copies)
    path = next(p for p, _ in jax.tree_util.tree_leaves_with_path(init) if "norm_final" in str(p))
    overflowed = jax.tree_util.tree_map_with_path(lambda p, x: jnp.full_like(x, jnp.inf) if p == path else x, init)
    device, state = _fp16_state(step, pm, overflowed, 2.0**8)
    before = pm.gather(master_params(pm.engine, device, state))
    new_device, new_state, _ = step(device, state, batch)
    assert (float(new_state.loss_scale.scale), int(new_state.loss_scale.good_steps)) == (2.0**7, 0)
    after = pm.gather(master_params(pm.engine, new_device, new_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # skipped: nothing moved

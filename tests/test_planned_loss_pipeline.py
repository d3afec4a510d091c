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

import optax
import pytest
from pipeline_cases import LR, SEQ, STEPS, VOCAB, build, compare_grads, compare_params, references

import axonn_jax
from axonn_jax.runtime.hlo import collectives

GRID = "pipeline=2,x=2,z=2"
COUNTS, TRAJECTORY = (1, 4), 4


@pytest.fixture(scope="module")
def gpt(devices):
    case = build("gpt")
    pm = axonn_jax.partition(case.model, axonn_jax.Grid.parse(GRID), *case.inputs(case.batch(1)))
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

"""``pm.report()`` on pipeline grids (issue 26 item 5): per stage, the messages, summed.

Each stage's forward and backward are traced on their own (no devices); the
compute report sums the stages over the plain model, so the redundancy means
what it means without pipeline: the repo GPT on ``pipeline=2,x=2,z=2`` and
scanned transformers (their stacks cut between stages) stay ≤ 1.05, with the
plain model's FLOPs the same as on a grid without pipeline.
"""

import control_flow_cases
import numpy as np
import partition_cases
import pytest

import axonn_jax
from axonn_jax import Grid

CASES = [("gpt_linen", "pipeline=2,x=2,z=2"), ("scan_gpt", "pipeline=2,x=2,z=2"),
         ("scan_gpt_nnx", "pipeline=2,y=2,z=2"), ("scan_gpt", "pipeline=4,z=2")]  # fmt: skip


def _case(name: str):
    return (partition_cases if name in partition_cases.MODELS else control_flow_cases).build(name)


@pytest.mark.parametrize("name,grid", CASES, ids=str)
def test_pipeline_report_sums_its_stages_without_repeats(name, grid):
    grid = Grid.parse(grid)
    case = _case(name)
    pm = axonn_jax.partition(case.model, grid, *case.args)
    report = pm.report()
    assert pm.plan.fallbacks == ()  # (warnings name the stacks and embeddings stages share)
    assert len(report.stages) == grid.pipeline
    compute = report.compute
    assert 0.99 <= compute.redundancy <= 1.05, (name, grid, compute.redundancy, compute.repeated(3))
    flat = axonn_jax.partition(case.model, Grid(x=grid.x, y=grid.y, z=grid.z, data=grid.pipeline),
                               *case.args).report()  # fmt: skip
    assert compute.plain.total == flat.compute.plain.total  # the same plain step
    assert compute.per_device == sum((s.flops for s in report.stages[1:]), report.stages[0].flops)
    first, *middle, last = report.stages
    assert first.returns == 0 and last.sends == 0  # nothing before the first, after the last
    assert all(s.sends > 0 for s in [first, *middle]) and all(s.returns > 0 for s in [*middle, last])
    for s in report.stages:  # every stage splits its work over its own devices
        assert s.devices == grid.stage_size and s.flops.total > 0 and s.communication.count > 0
        assert s.memory.activations is not None and s.memory.parameters > 0
    assert report.communication.count == sum(s.communication.count for s in report.stages)
    text = str(report)
    assert "stage 0:" in text and f"redundancy {compute.redundancy:.2f}" in text


def test_stage_flops_follow_the_planned_balance():
    """The traced stages' shares of the work match the planner's FLOP shares (within 5 points)."""
    case = control_flow_cases.build("scan_gpt")
    pm = axonn_jax.partition(case.model, Grid(pipeline=4, z=2), *case.args)
    traced = np.array([s.flops.total for s in pm.report().stages], float)
    planned = np.array([s.flops for s in pm.plan.stages], float)
    assert np.all(np.abs(traced / traced.sum() - planned / planned.sum()) <= 0.05), (traced, planned)

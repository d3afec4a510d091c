"""Automatic pipeline stages are even for every model kind, where the layers allow it.

The models of benchmarks/stage_balance.py (the table in docs/pipeline.md), at
the sizes they are trained at, planned from abstract shapes on
``Grid(pipeline=p)``, p = 2 and 4. "Even" is each stage's share of the
forward FLOPs within 10% of ``1/p``; "where the layers allow it" is checked
against what is possible, computed here independently of the planner's cut
points and DP (a reachability search over every boundary between two
equations):

* the heaviest stage is within 10% of the most even split by FLOPs alone,
  or of ``1/p`` when that is possible;
* if some split at boundaries that send no more bytes than the chosen ones
  has every share within 10% of even, so does the chosen one (FLOP balance
  is only ever traded for smaller messages);
* no "pipeline stages: ... uneven" note: at these sizes FLOPs decide.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

import axonn_jax
from axonn_jax.partitioner import stages as S
from axonn_jax.partitioner.flops import equation_flops
from axonn_jax.partitioner.trace import inline_calls, trace_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import stage_balance  # noqa: E402


def splits_within(bounds, total: float, stages: int, lo: float, hi: float) -> bool:
    """Whether cuts at some of ``bounds`` (FLOPs before each) give ``stages`` stages of
    ``lo·total .. hi·total`` FLOPs each (reachability, one stage at a time)."""
    nodes = np.array([0.0, *bounds, total])
    reach = np.zeros(len(nodes), bool)
    reach[0] = True
    for _ in range(stages):
        span = nodes[None, :] - nodes[:, None]
        ok = (span >= lo * total - 1e-9 * total) & (span <= hi * total + 1e-9 * total)
        reach = (reach[:, None] & ok).any(axis=0)
    return bool(reach[-1])


def most_even(bounds, total: float, stages: int) -> float:
    """The least possible heaviest share over cuts at ``bounds`` (bisection on :func:`splits_within`)."""
    lo, hi = 1.0 / stages, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if splits_within(bounds, total, stages, 0.0, mid) else (mid, hi)
    return hi


@pytest.fixture(scope="module", params=stage_balance.MODELS)
def case(request):
    case = stage_balance.build(request.param)
    traced = trace_model(case.model, *case.args, **case.kwargs)
    jaxpr = inline_calls(traced.jaxpr).jaxpr
    flops = np.array([equation_flops(e) for e in jaxpr.eqns], dtype=np.float64)
    crossing = S.crossing_bytes(jaxpr, traced.num_params, traced.state_outputs)
    return request.param, case, flops, crossing


@pytest.mark.parametrize("pipeline", [2, 4])
def test_stages_are_even_where_the_layers_allow(case, pipeline):
    name, case, flops, crossing = case
    plan = axonn_jax.partition(case.model, axonn_jax.Grid(pipeline=pipeline), *case.args,
                               **case.kwargs).plan  # fmt: skip
    total = flops.sum()
    shares = [flops[s.start : s.stop].sum() / total for s in plan.stages]
    assert sum(s.flops for s in plan.stages) == pytest.approx(total)
    even = 1.0 / pipeline
    before = np.cumsum(flops)[:-1]  # FLOPs before the boundary after each equation
    possible = most_even(before, total, pipeline)
    assert max(shares) <= 1.1 * max(even, possible), (name, shares, possible)
    sent = max(s.send_bytes for s in plan.stages)
    cheap = before[crossing[:-1] <= sent]
    if splits_within(cheap, total, pipeline, 0.9 * even, 1.1 * even):
        assert all(0.9 * even <= x <= 1.1 * even for x in shares), (name, shares)
    assert not [w for w in plan.warnings if w.startswith("pipeline stages:")], plan.warnings


def test_the_reference_search_is_right():
    """splits_within / most_even on a hand-made case: layers of 1, 1, 1, 3 FLOPs."""
    bounds, total = [1.0, 2.0, 3.0], 6.0
    assert splits_within(bounds, total, 2, 0.45, 0.55) is True  # 1+1+1 | 3
    assert splits_within([1.0, 2.0], total, 2, 0.45, 0.55) is False  # without the cut at 3
    assert splits_within(bounds, total, 4, 0.0, 0.49) is False  # the 3 is one layer
    assert most_even(bounds, total, 4) == pytest.approx(0.5, abs=1e-6)
    assert most_even([1.0, 2.0], total, 2) == pytest.approx(4 / 6, abs=1e-6)


def test_the_issues_mlp():
    """The issue's report: 8 × Dense(2048)+relu, Dense(10), here on 32 rows of 784 inputs. Before:
    100/0 at pipeline=2, refused at pipeline=4. Kernel-bound at this batch (each matmul under
    the 1 µs floor), so FLOPs break the ties: the most even split the layers allow."""
    import jax
    import jax.numpy as jnp

    model = stage_balance._deep_mlp(batchnorm=False)
    x = jax.ShapeDtypeStruct((32, 784), jnp.float32)
    traced = trace_model(model, x)
    jaxpr = inline_calls(traced.jaxpr).jaxpr
    flops = np.array([equation_flops(e) for e in jaxpr.eqns], dtype=np.float64)
    for pipeline in (2, 4):
        plan = axonn_jax.partition(model, axonn_jax.Grid(pipeline=pipeline), x).plan
        shares = [flops[s.start : s.stop].sum() / flops.sum() for s in plan.stages]
        possible = most_even(np.cumsum(flops)[:-1], flops.sum(), pipeline)
        assert max(shares) <= possible + 1e-3, (pipeline, shares, possible)
        assert not plan.warnings, plan.warnings


@pytest.mark.parametrize("name", ["scan_gpt", "scan_gpt_nnx"])
def test_scanned_transformer_rows_of_the_table(name):
    """The table's scanned transformers: their stack is cut between stages, and each stage's
    share (counted on the program's equations, where the scan is split at the cuts) equals
    the unrolled blocks' (``small_gpt``: the same 4 blocks in a Python loop) and sums to 1."""
    for pipeline in (2, 4):
        scanned = stage_balance.plan_stages(name, pipeline)
        unrolled = stage_balance.plan_stages("small_gpt", pipeline)
        shares = scanned["shares"]
        assert abs(sum(shares) - 1) < 1e-9 and len(shares) == pipeline
        np.testing.assert_allclose(shares, stage_balance.flop_shares("small_gpt", unrolled["ranges"]),
                                   atol=2e-3, err_msg=f"{name} pipeline={pipeline}")  # fmt: skip
        assert max(shares) * pipeline <= 1.12, (name, pipeline, shares)

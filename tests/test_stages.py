"""Pipeline stages in the plan: cut points, the slowest-stage DP, stages=, the summary, one FLOP count.

Planning only (abstract shapes). How even the stages of each model kind are
is tests/test_stage_balance.py; that pipelined runs on the new cuts equal the
plain model is tests/test_pipeline.py.
"""

import itertools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axonn_jax
from axonn_jax import Grid
from axonn_jax.models import GPT, MLP, GPTConfig
from axonn_jax.partitioner import balance as B
from axonn_jax.partitioner import flops as F
from axonn_jax.partitioner import stages as S
from axonn_jax.partitioner.program import PlanOptions, plan_model
from axonn_jax.partitioner.trace import inline_calls, trace_model

TOKENS = jax.ShapeDtypeStruct((8, 16), jnp.int32)
GPT4 = GPT(GPTConfig(vocab_size=64, num_layers=4, hidden=32, num_heads=4, max_seq_len=16))


class BatchNormMLP(nn.Module):
    """The issue's model: Dense(64) → BatchNorm → relu → Dropout, 3 hidden layers, then Dense(10)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        for _ in range(3):
            x = nn.Dense(64)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
        return nn.Dense(10)(x)


BN_INPUT = jax.ShapeDtypeStruct((8, 32), jnp.float32)  # 8 rows: the statistics outweigh 25% of a row block
BN_CALL = dict(mutable=["batch_stats"], rngs={"dropout": jax.random.key(0)})


def _blocks(stage):
    return sorted({p.split("/")[0] for p in stage.params if p.startswith("block_")})


def _inlined(model, *args, **kwargs):
    traced = trace_model(model, *args, **kwargs)
    return traced, inline_calls(traced.jaxpr).jaxpr


def test_gpt_stages_cut_between_blocks():
    plan = axonn_jax.partition(GPT4, Grid(pipeline=2, x=2), TOKENS).plan
    assert [_blocks(s) for s in plan.stages] == [["block_0", "block_1"], ["block_2", "block_3"]]
    assert "norm_final/scale" in plan.stages[1].params
    # the message between stages is the residual stream [8, 16, 32] fp32 (plus small extras)
    assert 8 * 16 * 32 * 4 <= plan.stages[0].send_bytes < 2 * 8 * 16 * 32 * 4
    assert plan.stages[-1].send_bytes == 0
    assert any("embed/embedding: used by stages [0, 1]" in w for w in plan.warnings)


def test_explicit_boundaries():
    plan = axonn_jax.partition(GPT4, Grid(pipeline=2), TOKENS, stages=["block_3/"]).plan
    assert [_blocks(s) for s in plan.stages] == [["block_0", "block_1", "block_2"], ["block_3"]]


def test_stage_cuts_cut_another_plan_where_this_one_is_cut():
    """``plan.stage_cuts`` are ``stages=`` patterns: a plan given them has stages that use the
    same parameters (here: 3 blocks, then 1, which the costs would not choose); ``None`` without a pipeline; stages cut inside a scan over stacked layers cannot
    be named by parameters, and the refusal says what to do instead."""
    from control_flow_cases import ScanGPT

    uneven = axonn_jax.partition(GPT4, Grid(pipeline=2), TOKENS, stages=["block_3/"]).plan
    [cut] = uneven.stage_cuts
    assert [p for p in uneven.stages[1].params if re.fullmatch(cut, p)] == \
        [p for p in uneven.stages[1].params if p not in uneven.stages[0].params]  # fmt: skip
    again = axonn_jax.partition(GPT4, Grid(pipeline=2), TOKENS, stages=uneven.stage_cuts).plan
    assert [_blocks(st) for st in again.stages] == [["block_0", "block_1", "block_2"], ["block_3"]]
    assert [st.params for st in again.stages] == [st.params for st in uneven.stages]
    by_costs = axonn_jax.partition(GPT4, Grid(pipeline=2), TOKENS).plan
    assert [st.params for st in by_costs.stages] != [st.params for st in uneven.stages]
    assert axonn_jax.partition(GPT4, Grid(x=2), TOKENS).plan.stage_cuts is None
    scanned = axonn_jax.partition(ScanGPT(), Grid(pipeline=2), jax.ShapeDtypeStruct((8, 16), jnp.int32)).plan
    assert scanned.scan_cuts
    with pytest.raises(ValueError, match=r"cut inside a scan over stacked layers.*Remedy: partition the other"):
        scanned.stage_cuts


def test_too_many_stages():
    one_layer = MLP(features=(16,))  # kernel and bias: one possible cut between them
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    assert len(axonn_jax.partition(one_layer, Grid(pipeline=2), x).plan.stages) == 2
    with pytest.raises(ValueError, match=r"MLP on Grid\(.*pipeline=3\): .*fewer than the 2 needed "
                                         r"for 3 pipeline stages.*Remedy: at most 2 stages"):
        axonn_jax.partition(one_layer, Grid(pipeline=3), x)


# --- cut points and the choice ----------------------------------------------------------


def test_every_gap_between_parameter_uses_is_a_cut_point():
    """No boundary is filtered out by its bytes: 8 equal layers and a 10-wide head give 16 points."""
    model = MLP(features=(256,) * 8 + (10,))
    traced, jaxpr = _inlined(model, jax.ShapeDtypeStruct((8, 256), jnp.float32))
    flops = np.array([F.equation_flops(e) for e in jaxpr.eqns], dtype=float)
    points = S.cut_points(jaxpr, traced.num_params, flops, flops)
    assert len(points) == 2 * 9 - 1  # kernel | bias | kernel | ... | bias
    assert [p.after for p in points] == sorted(p.after for p in points)
    # the activations between layers cross in full, not just the head's 10 columns
    assert max(p.send_bytes for p in points) == 8 * 256 * 4
    assert min(p.send_bytes for p in points) == 8 * 10 * 4
    assert all(p.grad_bytes == p.send_bytes for p in points)  # float activations: gradients return


def _brute_force(points, total, stages, costs):
    best = min(max(c + t for c, t in B.stage_times(list(cut), total, costs))
               for cut in itertools.combinations(points, stages - 1))  # fmt: skip
    return best


@pytest.mark.parametrize("costs", [B.StageCosts(), B.StageCosts(link_gbps=0.05, latency_us=3.0),
                                   B.StageCosts(kernel_us=0.0, link_gbps=1e9)],
                         ids=["h100", "slow-link", "flops-only"])  # fmt: skip
def test_dp_finds_the_fastest_slowest_stage(costs):
    """Uneven layers: the DP's slowest stage equals the brute-force optimum over every cut."""
    model = MLP(features=(256, 16, 16, 16, 16, 256, 16, 16))
    traced, jaxpr = _inlined(model, jax.ShapeDtypeStruct((64, 64), jnp.float32))
    flops = np.array([F.equation_flops(e) for e in jaxpr.eqns], dtype=float)
    seconds = np.array([costs.equation_seconds(e) for e in jaxpr.eqns])
    points = S.cut_points(jaxpr, traced.num_params, flops, seconds)
    for stages in (2, 3, 4):
        chosen = B.choose_cuts(points, seconds.sum(), stages, costs)
        got = max(c + t for c, t in B.stage_times(chosen, seconds.sum(), costs))
        want = _brute_force(points, seconds.sum(), stages, costs)
        assert got <= want * (1 + B.TOLERANCE) + 1e-15, (stages, got, want)
        assert len(chosen) == stages - 1 and [p.after for p in chosen] == sorted(p.after for p in chosen)


def test_transfers_keep_cuts_out_of_attention():
    """FLOPs alone cut a GPT inside an attention (q, k, v or the scores alive); the transfer
    term moves the cut to where only the residual stream crosses."""
    gpt = GPT(GPTConfig(vocab_size=256, num_layers=3, hidden=256, num_heads=4, max_seq_len=128,
                        dtype=jnp.bfloat16))  # fmt: skip
    tokens = jax.ShapeDtypeStruct((8, 128), jnp.int32)
    residual = 8 * 128 * 256 * 2
    flops_only = B.StageCosts(link_gbps=1e9, kernel_us=0.0)
    by_flops, _ = plan_model(gpt, Grid(pipeline=2), tokens, options=PlanOptions(stage_costs=flops_only))
    assert by_flops.stages[0].send_bytes > 2 * residual  # the premise: an expensive cut balances best
    plan = axonn_jax.partition(gpt, Grid(pipeline=2), tokens).plan
    assert plan.stages[0].send_bytes <= residual + 1024
    # the most even a residual-stream cut allows: block 0 and block 1's attention | the rest
    shares = [s.flops / sum(t.flops for t in plan.stages) for s in plan.stages]
    assert max(shares) < 0.56, shares


def test_a_narrow_model_says_why_its_stages_are_uneven():
    """Tiny layers are kernel- and transfer-bound: the plan says so instead of claiming FLOP balance."""
    model = MLP(features=(64, 64, 64, 64, 10))
    plan = axonn_jax.partition(model, Grid(pipeline=2), jax.ShapeDtypeStruct((8, 32), jnp.float32)).plan
    notes = [w for w in plan.warnings if w.startswith("pipeline stages:")]
    assert len(notes) == 1, plan.warnings
    assert re.search(r"the heaviest stage has \d+% of the FLOPs where cutting by FLOPs alone gives "
                     r"\d+%: the cuts minimise the slowest stage's modelled time on h100-node — "
                     r"compute with at least 1 µs per matmul, plus boundary transfers .*Remedy: .*"
                     r"partition\(\.\.\., machine=<its profile>\)", notes[0]), notes[0]  # fmt: skip


# --- stages= -----------------------------------------------------------------------------


def _first_use(plan, program, pattern):
    """The first equation using a parameter whose path matches ``pattern``."""
    users = S._param_consumers(program.jaxpr, program.num_params)
    return min(min(users[i]) for i, p in enumerate(plan.params) if re.search(pattern, p.path) and users[i])


@pytest.mark.parametrize("grid", ["pipeline=2", "pipeline=2,x=2,z=2", "pipeline=2,z=2,data=2",
                                  "pipeline=2,y=2,x=2"])  # fmt: skip
def test_stages_are_honoured_on_every_grid(grid):
    """The issue's BatchNorm MLP with 8 rows: before, four patterns gave one cut (stage 0 =
    Dense_0): the BatchNorm statistics returned at the end counted as crossing every later
    boundary, and only boundaries within 25% of the smallest were candidates."""
    cuts = {}
    for pattern in ["Dense_1", "BatchNorm_1", "Dense_2", "Dense_3"]:
        plan, program = plan_model(BatchNormMLP(), Grid.parse(grid), BN_INPUT,
                                   options=PlanOptions(stages=(pattern,)), **BN_CALL)  # fmt: skip
        first = _first_use(plan, program, pattern)
        stage0, stage1 = plan.stages
        assert stage1.start <= first, (pattern, stage1.start, first)
        # stage 1 starts after the previous parameter use: nothing of stage 0's layers moves over
        users = S._param_consumers(program.jaxpr, program.num_params)
        before = max(k for ks in users.values() for k in ks if k < first)
        assert stage1.start > before, (pattern, stage1.start, before)
        assert not any(re.search(pattern, p) for p in stage0.params), (pattern, stage0.params)
        assert plan.stage_boundaries == (pattern,)
        assert f"cut where stages=['{pattern}'] says" in str(plan)
        cuts[pattern] = stage1.start
    assert len(set(cuts.values())) == 4, cuts
    # the statistics stay on the stage that computes them: they never cross a boundary
    for stage in plan.stages:
        assert stage.send_bytes <= 8 * 64 * 4 + 64, stage


def test_state_updates_do_not_count_as_crossing():
    traced, jaxpr = _inlined(BatchNormMLP(), BN_INPUT, **BN_CALL)
    with_state = S.crossing_bytes(jaxpr, traced.num_params)
    without = S.crossing_bytes(jaxpr, traced.num_params, traced.state_outputs)
    stats = 3 * 2 * 64 * 4  # mean and var of three BatchNorms
    assert with_state[-2] - without[-2] == stats


@pytest.mark.parametrize("stages, message", [
    (["nothing_matches"], r"BatchNormMLP on Grid\(.*pipeline=2\): stage boundary 'nothing_matches' "
                          r"\(stages\[0\]\) matches no parameter used by the model; parameters are e\.g\. "
                          r".*Remedy: a regex"),
    (["Dense_0"], r"stage boundary 'Dense_0' \(stages\[0\]\) would start stage 1 at "
                  r"'params/Dense_0/(bias|kernel)', the first parameter the model uses, leaving "
                  r"stage 0 empty\. Remedy: a pattern matching a later layer"),
    (["Dense_2", "Dense_1"], r"stage boundaries \['Dense_2', 'Dense_1'\] are not in model order: "
                             r"'Dense_1' \(stages\[1\]\) starts at 'params/Dense_1/.*', which the model "
                             r"uses before \(or right where\) 'Dense_2' \(stages\[0\]\) starts stage 1\. "
                             r"Remedy: list the boundaries in the order"),
    (["Dense_1", "BatchNorm_1/scale|Dense_1"], r"not in model order"),
    (["Dense_1"], r"stages= gives 1 boundaries for 3 pipeline stages .*it needs 2 .*Remedy: 2 patterns, or a grid "
                  r"with pipeline × virtual = 2 for these"),
    # a grid without a pipeline: the boundaries used to be ignored without a word
    (["Dense_1"], r"on Grid\(x=2, y=1, z=2, data=1, pipeline=1\): stages= gives 1 boundaries for 1 pipeline "
                  r"stages .*it needs 0 .*pipeline × virtual = 2"),
])  # fmt: skip
def test_stages_that_cannot_be_honoured_are_refused(stages, message):
    pipeline = 3 if "for 3 pipeline" in message or len(stages) == 2 else 1 if "pipeline=1" in message else 2
    with pytest.raises(ValueError, match=message):
        axonn_jax.partition(BatchNormMLP(), Grid(pipeline=pipeline, x=2, z=2), BN_INPUT,
                            stages=stages, **BN_CALL)  # fmt: skip


# --- the summary -------------------------------------------------------------------------


def test_summary_states_what_was_balanced():
    text = str(axonn_jax.partition(GPT4, Grid(pipeline=2), TOKENS).plan)
    assert re.search(r"pipeline stages \(2, cut for the fastest slowest stage: compute \+ boundary "
                     r"transfer; slowest: stage \d, [\d.]+ µs per microbatch at h100-node: 494.5 "
                     r"TFLOP/s, at least 1 µs per matmul, 360 GB/s between stages\):", text), text
    assert "balanced by FLOPs" not in text
    assert re.search(r"  stage 0: \d+ params \([\d,]+ B\), [\d.]+% of FLOPs, [\d.]+ µs \(compute "
                     r"[\d.]+ µs \+ transfers [\d.]+ ns\), sends 16,384 B/batch", text), text
    slow = axonn_jax.partition(GPT4, Grid(pipeline=2), TOKENS, machine="perlmutter").plan
    assert slow.stage_costs.name == "perlmutter" and "at perlmutter: 156 TFLOP/s" in str(slow)


def test_default_rates_are_the_h100_profile():
    from axonn_jax.perf.machines import get

    assert get("h100-node").stage_costs(1) == B.StageCosts() == PlanOptions().stage_costs
    costs = B.StageCosts(name="mine", tflops=1.0, link_gbps=1.0)
    plan = axonn_jax.partition(GPT4, Grid(pipeline=2), TOKENS, machine=costs).plan
    assert plan.stage_costs == costs


# --- one FLOP count ----------------------------------------------------------------------


def test_stage_flops_are_the_compute_reports_count():
    """A stage's FLOPs and pm.report()'s count are one formula (partitioner.flops.equation_flops)."""
    from axonn_jax.perf import traced

    for model, args, kwargs in [(GPT4, (TOKENS,), {}), (BatchNormMLP(), (BN_INPUT,), BN_CALL)]:
        plan, program = plan_model(model, Grid(pipeline=2), *args, **kwargs)
        assert sum(s.flops for s in plan.stages) == F.count(program.jaxpr).total
    assert traced.equation_flops is S.equation_flops is F.equation_flops


def test_equation_flops_counts_control_flow_bodies():
    def body(c, w):
        return jnp.tanh(c @ w), None

    closed = jax.make_jaxpr(lambda c, ws: jax.lax.scan(body, c, ws)[0])(
        jnp.ones((4, 8)), jnp.ones((3, 8, 8)))  # fmt: skip
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert F.equation_flops(eqn) == 3 * (2 * 4 * 8 * 8 + 4 * 8) == F.count(closed).total
    assert B.StageCosts(kernel_us=1.0).equation_seconds(eqn) == pytest.approx(
        B.PASSES * (3 * 1e-6 + 3 * 4 * 8 / 494.5e12))  # three matmuls at the kernel floor

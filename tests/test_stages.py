"""Pipeline stages in the plan: layer boundaries, balanced by dynamic programming."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axonn_jax
from axonn_jax import Grid
from axonn_jax.models import GPT, MLP, GPTConfig
from axonn_jax.partitioner import stages as S
from axonn_jax.partitioner.trace import inline_calls, trace_model

TOKENS = jax.ShapeDtypeStruct((8, 16), jnp.int32)
GPT4 = GPT(GPTConfig(vocab_size=64, num_layers=4, hidden=32, num_heads=4, max_seq_len=16))


def _blocks(stage):
    return sorted({p.split("/")[0] for p in stage.params if p.startswith("block_")})


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
    with pytest.raises(ValueError, match="matches no parameter"):
        axonn_jax.partition(GPT4, Grid(pipeline=2), TOKENS, stages=["nonexistent"])
    with pytest.raises(ValueError, match="needs 1"):
        axonn_jax.partition(GPT4, Grid(pipeline=2), TOKENS, stages=["block_1/", "block_2/"])


def test_too_many_stages():
    one_layer = MLP(features=(16,))  # kernel and bias: one possible cut between them
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    assert len(axonn_jax.partition(one_layer, Grid(pipeline=2), x).plan.stages) == 2
    with pytest.raises(ValueError, match=r"MLP on Grid\(.*pipeline=3\): .*fewer than the 2 needed "
                                         r"for 3 pipeline stages.*Remedy: at most 2 stages"):
        axonn_jax.partition(one_layer, Grid(pipeline=3), x)


def test_dp_is_optimal_and_beats_a_uniform_split():
    """Uneven layers: DP's heaviest stage equals the brute-force optimum."""
    model = MLP(features=(256, 16, 16, 16, 16, 256, 16, 16))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    traced = trace_model(model, x)
    jaxpr = inline_calls(traced.jaxpr).jaxpr
    flops = np.array([S.equation_flops(e) for e in jaxpr.eqns])
    users = S._param_consumers(jaxpr, traced.num_params)
    candidates = S._candidates(S.crossing_bytes(jaxpr, traced.num_params), users)
    assert len(candidates) >= 7  # at least one boundary between each pair of layers

    def heaviest(cuts):
        bounds = [-1, *cuts, len(flops) - 1]
        return max(flops[a + 1 : b + 1].sum() for a, b in zip(bounds, bounds[1:]))

    for stages in (2, 3, 4):
        dp = S.plan_stages(traced, jaxpr, stages)
        dp_cost = max(s.flops for s in dp)
        brute = min(heaviest(c) for c in itertools.combinations(candidates, stages - 1))
        assert dp_cost == pytest.approx(brute)
        # a uniform split by layer (Dense) count is never better
        dense = [k for k, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general"]
        per = len(dense) // stages
        uniform = [max(b for b in candidates if b < dense[per * (i + 1)]) for i in range(stages - 1)]
        assert dp_cost <= heaviest(uniform)
    assert max(s.flops for s in S.plan_stages(traced, jaxpr, 4)) < heaviest(
        [max(b for b in candidates if b < dense[2 * (i + 1)]) for i in range(3)]
    )

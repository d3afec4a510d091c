"""Zero-bubble pipelines: each stage's backward split into B (input gradients) and W (weight
gradients), and the schedules that run W where a rank would idle ("zb", "zb-h1").

The split is checked on its own (B + W equal the fused backward, each operation
computed once, tensor-parallel ``shard_map`` bodies included) and through the
pipeline (pipelined == plain Flax/optax, tests/pipeline_cases.py's bounds). The
schedules' idle time and memory are checked in tests/test_schedule_sim.py.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from pipeline_cases import partitioned, run_case

import axonn_jax
from axonn_jax.perf.memory import held_microbatches, matmul_w_elements, w_residual_share
from axonn_jax.perf.options import Options
from axonn_jax.perf.traced import spec_from_model
from axonn_jax.runtime.memory import shard_bytes
from axonn_jax.runtime.pipeline.backward_split import BackwardSplit
from axonn_jax.runtime.pipeline.tasks import TaskKind


# --- the split on its own --------------------------------------------------------------------
def _mlp(params, x):
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return x


def _split_of(f, primals, n_inputs: int):
    """(fused backward, BackwardSplit, leaves): ``f``'s vjp over ``primals`` as a function of
    flat leaves; the last ``n_inputs`` outputs are input gradients (B), the others W's."""
    out, vjp = jax.vjp(f, *primals)
    ct = jnp.cos(out)
    leaves, tree = jax.tree.flatten((vjp, ct))

    def backward(*flat):
        vjp_, ct_ = jax.tree.unflatten(tree, flat)
        grads = vjp_(ct_)
        return [*jax.tree.leaves(grads[:-n_inputs]), *jax.tree.leaves(grads[-n_inputs:])]

    n_out = len(jax.eval_shape(backward, *leaves))
    split = BackwardSplit(backward, leaves, [k >= n_out - n_inputs for k in range(n_out)])
    return backward, split, leaves


def _run_split(split, leaves):
    g_in, carried = jax.jit(split.input_gradients)(*leaves)
    weights = jax.jit(split.weight_gradients)(split.kept(leaves), carried)
    return [*weights, *g_in], carried


def _primitive_count(jaxpr) -> int:
    """Equations of a jaxpr, those inside ``shard_map`` bodies counted instead of the call."""
    n = 0
    for e in jaxpr.eqns:
        inner = e.params.get("jaxpr") if e.primitive.name == "shard_map" else None
        n += _primitive_count(getattr(inner, "jaxpr", inner)) if inner is not None else 1
    return n


def test_b_and_w_equal_the_fused_backward_and_compute_each_operation_once():
    keys = jax.random.split(jax.random.key(0), 7)
    params = [(jax.random.normal(keys[i], (8, 8)) / 3, jax.random.normal(keys[i + 3], (8,))) for i in range(3)]
    x = jax.random.normal(keys[6], (4, 8))
    backward, split, leaves = _split_of(_mlp, (params, x), 1)
    fused = jax.jit(backward)(*leaves)
    got, carried = _run_split(split, leaves)
    assert len(got) == len(fused) == 7
    for g, f in zip(got, fused):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(f))
    # B hands W the output gradient of every layer (dW = xᵀ·dy reads it), nothing recomputed
    assert len(carried) >= 2 and all(c.shape == (4, 8) for c in carried)
    n_fused = _primitive_count(jax.make_jaxpr(backward)(*leaves).jaxpr)
    n_b = _primitive_count(jax.make_jaxpr(split.input_gradients)(*leaves).jaxpr)
    n_w = _primitive_count(jax.make_jaxpr(split.weight_gradients)(split.kept(leaves), carried).jaxpr)
    assert n_b + n_w == n_fused and n_b > 0 and n_w > 0
    # W keeps only what it reads: not the residuals of B alone (tanh's outputs)
    assert len(split.kept_leaves) < len(leaves)


def test_b_and_w_flops_are_the_matmul_layers_halves():
    """Dense layers without activations: B is dx = dy·Wᵀ per layer (the model input's gradient
    is asked for too), W is dW = xᵀ·dy and db per layer: 2·m·k·n per product, db a row sum."""
    rows, width, layers = 4, 8, 3
    keys = jax.random.split(jax.random.key(2), layers + 1)
    params = [(jax.random.normal(keys[i], (width, width)), jnp.zeros(width)) for i in range(layers)]
    x = jax.random.normal(keys[-1], (rows, width))

    def dense(ps, x):
        for w, b in ps:
            x = x @ w + b
        return x

    _, split, _ = _split_of(dense, (params, x), 1)
    b, w = split.flops()
    matmul = 2 * rows * width * width
    assert b == layers * matmul  # dx for every layer (the model input's gradient is asked for too)
    # dW, and db = the row sum of dy (JAX reduces the broadcast's transpose in one or two steps)
    assert layers * (matmul + rows * width) <= w <= layers * (matmul + (rows + 1) * width)


def test_b_and_w_inside_shard_map_keep_the_collectives(devices):
    """A tensor-parallel MLP (column- then row-parallel, psum): B and W become two shard_maps
    on the same mesh; per-device values cross between them; results equal the fused backward."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def local(w1, w2, x):
        return jax.lax.psum(jnp.tanh(x @ w1) @ w2, "x")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "x"), P("x", None), P()), out_specs=P())
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    primals = (jax.random.normal(k1, (8, 16)) / 3, jax.random.normal(k2, (16, 8)) / 4,
               jax.random.normal(k3, (4, 8)))  # fmt: skip
    backward, split, leaves = _split_of(f, primals, 1)
    fused = jax.jit(backward)(*leaves)
    got, carried = _run_split(split, leaves)
    assert carried, "B hands W values computed inside the shard_map"
    for g, want in zip(got, fused):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-6)
    n_fused = _primitive_count(jax.make_jaxpr(backward)(*leaves).jaxpr)
    n_b = _primitive_count(jax.make_jaxpr(split.input_gradients)(*leaves).jaxpr)
    n_w = _primitive_count(jax.make_jaxpr(split.weight_gradients)(split.kept(leaves), carried).jaxpr)
    assert n_b + n_w <= n_fused + 2 * len(carried)  # + one reshape each way per carried value


# --- through the pipeline -------------------------------------------------------------------
def test_zero_bubble_pipeline_equals_unpartitioned_and_compiles_once(devices, caplog):
    """A 4-stage MLP (z=2 inside each stage): loss and gradients with both zero-bubble
    schedules, 5 AdamW steps with "zb"; B and W are separate compiled programs, every
    (stage, microbatch) has one W after its B, and later steps compile nothing."""
    failures = run_case("mlp", axonn_jax.Grid.parse("pipeline=4,z=2"), microbatches=(4,),
                        schedules=("zb", "zb-h1"), trajectory_schedule="zb")  # fmt: skip
    assert not failures, "\n".join(failures)
    case, pm = partitioned("mlp", "pipeline=4,z=2")  # run_case's: its programs are compiled
    step = pm.train_step(case.loss, optax.adamw(1e-3), inputs=case.inputs, microbatches=4, schedule="zb")
    params, opt_state = step.init(pm.init(jax.random.key(0)))
    params, opt_state, _ = step(params, opt_state, case.batch(4))
    records = step.value_and_grad.last_result.records
    for s in range(4):
        for mb in range(4):
            kind = TaskKind.FORWARD_BACKWARD if s == 3 else TaskKind.BACKWARD
            (b,) = [r for r in records if (r.stage, r.kind, r.microbatch) == (s, kind, mb)]
            (w,) = [r for r in records if (r.stage, r.kind, r.microbatch) == (s, TaskKind.WEIGHTS, mb)]
            assert w.start >= b.end - 1e-9
    from jax.stages import Compiled

    programs = step.value_and_grad.stage_programs(case.inputs(case.batch(1)))
    *inner, last = programs
    assert all(isinstance(f, Compiled) for p in inner for f in (p.forward, p.backward_input, p.backward_weights))
    assert isinstance(last.forward_backward_input, Compiled) and isinstance(last.backward_weights, Compiled)
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
        for _ in range(2):
            params, opt_state, loss = step(params, opt_state, case.batch(4))
        jax.block_until_ready(params)
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert not compiles, compiles
    assert np.isfinite(float(loss))


# pipeline 2 and 4, virtual 1 and 2, microbatches 1/4/8, tensor-parallel stages
ZERO_BUBBLE_GRIDS = [
    ("gpt", "pipeline=2,x=2,z=2", (1, 4, 8)),
    ("gpt", "pipeline=4,z=2", (1, 4, 8)),
    ("gpt", "pipeline=2,virtual=2,x=2,z=2", (1, 4, 8)),
    ("gpt", "pipeline=4,virtual=2,z=2", (4, 8)),
    ("hf_gpt2", "pipeline=2,x=2,z=2", (4,)),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,grid,microbatches", ZERO_BUBBLE_GRIDS)
def test_zero_bubble_schedules_equal_unpartitioned(model, grid, microbatches, devices):
    failures = run_case(model, axonn_jax.Grid.parse(grid), microbatches=microbatches,
                        schedules=("zb", "zb-h1"), trajectory_schedule="zb")  # fmt: skip
    assert not failures, "\n".join(failures)


def test_held_residual_bytes_are_measured_per_stage(devices):
    """The queue measures the bytes per device each stage holds at once. With the fused backward:
    exactly the peak microbatches in flight × one microbatch's residuals (the forward program's
    outputs). With zb also what B leaves for a deferred W (the residuals and output gradient W
    reads, B's carried values): between one microbatch's residuals and the peak × all three.
    Both fail if a B or a W does not release what it held (6 microbatches, peak below 6)."""
    case, pm = partitioned("gpt", "pipeline=2,x=2,z=2")
    params = pm.init(jax.random.key(0))
    runs = {}
    for schedule in ("message", "zb"):
        step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=6, schedule=schedule)
        step(params, case.batch(6))
        runs[schedule] = (step.stage_programs(case.inputs(case.batch(1)))[0], step.last_result)
    program, run = runs["message"]
    residuals = shard_bytes(program.forward.out_info[1])
    assert 1 < run.peak_in_flight[0] < 6, run.peak_in_flight  # released as the B's ran
    assert run.peak_held_bytes[0] == run.peak_in_flight[0] * residuals, (run.peak_held_bytes, residuals)
    program, run = runs["zb"]
    carried = shard_bytes(program.backward_input.out_info[1])  # 0 here: stage 0 has no B
    gradient = shard_bytes(program.outbound_cotangent_avals())  # dy, which W reads
    assert 1 < run.peak_in_flight[0] < 6, run.peak_in_flight
    assert residuals <= run.peak_held_bytes[0] <= run.peak_in_flight[0] * (residuals + gradient + carried), (
        run.peak_held_bytes, run.peak_in_flight, residuals, gradient, carried)
    # stage 0's B is empty: a deferred W holds all the residuals and the output gradient, so the
    # peak is k full microbatches and n − k deferred W's of residuals + gradient, exactly
    n, peak = run.peak_in_flight[0], run.peak_held_bytes[0]
    assert any(peak == k * residuals + (n - k) * (residuals + gradient) for k in range(n + 1)), (
        peak, n, residuals, gradient)
    # the perf model prices that (its share of a microbatch per deferred W, from the traced spec)
    spec = spec_from_model(case.model, *case.inputs(case.batch(1)))
    grid, options = pm.grid, Options(microbatches=6, schedule="zb", precision="fp32")
    assert peak <= residuals * held_microbatches(spec, grid, options, 6), (peak, residuals)
    assert (residuals + gradient) / residuals <= w_residual_share(spec, grid, options), (residuals, gradient)
    # a W sized by the stage's weight matmuls alone (inputs + output gradients: 90,112 B here) is
    # a lower bound on a stage with a B (the last: 147,776 B per W) and under-prices stage 0's
    matmul_only = matmul_w_elements(spec, grid) * spec.tokens / grid.batch_shards * options.bytes.activation
    assert 2 * matmul_only < residuals + gradient, (matmul_only, residuals, gradient)
    last = run.peak_in_flight[1]
    assert last >= 1 and run.peak_held_bytes[1] >= last * matmul_only, (run.peak_held_bytes, last, matmul_only)

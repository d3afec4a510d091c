"""Control flow (scan, while_loop/fori_loop, cond/switch) partitioned like the rest of the model.

The models (tests/control_flow_cases.py) are written the way Flax users write
them: a transformer as ``nn.scan`` / ``nnx.scan`` over stacked layers, LSTM and
GRU language models (``nn.RNN``), a weight-tied ``fori_loop``, a data
``while_loop``, ``nn.cond`` + ``nn.switch``. Bounds: those of test_partition.py
(loss, step-1 gradients, parameters after 5 AdamW steps) and of
tests/pipeline_cases.py on pipeline grids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import subjaxprs
from conftest import grid_id, spread
from control_flow_cases import HIDDEN, MODELS, ScanGPT, build
from partition_cases import GRIDS, assert_matches_reference, reference_apply, trajectories

import axonn_jax
from axonn_jax import Grid
from axonn_jax.partitioner import control_flow as CF
from axonn_jax.partitioner.concats import take_apart
from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.flows import variable_layouts

#: the five grids of test_partition plus the two of the redundancy table it lacks
CONTROL_GRIDS = GRIDS + [dict(x=4, data=2), dict(z=2, data=4)]
#: every model on two grids of the table, each grid under several models (conftest.spread)
CASES = spread(MODELS, CONTROL_GRIDS)
_ids = lambda v: grid_id(v) if isinstance(v, dict) else v  # noqa: E731


@pytest.mark.parametrize("model,grid", CASES, ids=_ids)
def test_control_flow_trains_like_the_plain_model(model, grid, devices):
    """Loss, gradients and 5 AdamW steps equal the plain model; nothing falls back to replication."""
    result = trajectories(model, grid)
    assert_matches_reference(result, f"{model} {grid}")
    assert result["pm"].plan.fallbacks == (), result["pm"].plan.fallbacks


REDUNDANCY_GRIDS = ["x=2,y=2,z=2", "x=4,data=2", "z=2,data=4", "y=2,z=2,data=2"]


@pytest.mark.parametrize("grid", REDUNDANCY_GRIDS)
@pytest.mark.parametrize("model", ["scan_gpt", "scan_gpt_nnx"])
def test_scanned_transformer_splits_4d_like_its_unrolled_form(model, grid):
    """No warning, redundancy ≤ 1.05 (and no worse than the same blocks unrolled), every
    stacked matmul weight held 1/(x·y·z) per device with its layer dim whole."""
    grid = Grid.parse(grid)
    case = build(model)
    pm = axonn_jax.partition(case.model, grid, *case.args)
    report = pm.report().compute
    assert pm.plan.warnings == (), pm.plan.warnings
    assert report.redundancy <= 1.05, (report.redundancy, report.repeated(3))
    unrolled = axonn_jax.partition(build("loop_gpt").model, grid, *case.args).report().compute
    assert report.redundancy <= unrolled.redundancy + 0.01, (report.redundancy, unrolled.redundancy)
    tensor = grid.x * grid.y * grid.z
    stacked = [p for p in pm.plan.params if p.path.startswith("blocks/")]
    assert len(stacked) >= 12
    for p in stacked:
        assert p.storage[0] == (), (p.path, p.storage)
        if p.path.endswith("kernel"):
            assert np.prod(p.local_shape(grid)) * tensor == np.prod(p.shape), (p.path, p.storage)


def test_stacked_weights_are_gathered_one_layer_per_iteration():
    """FSDP inside the loop: the depth (z) all-gathers of stacked weights run in the scan, one
    layer at a time (count = layers), and no gather moves the whole stack."""
    case = build("scan_gpt")
    pm = axonn_jax.partition(case.model, Grid(x=2, y=2, z=2), *case.args)
    gathers = [t for t in pm.report().communication.transfers
               if t.kind == "all-gather" and t.axes == ("z",) and t.phase == "forward"]  # fmt: skip
    per_layer = [t for t in gathers if t.count % case.model.layers == 0 and t.count > 0]
    assert len(per_layer) >= 4, gathers  # q, k, v, out, up, down kernels
    whole = {p.local_shape(pm.plan.grid) for p in pm.plan.params if p.path.startswith("blocks/")}
    assert not [t for t in gathers if t.operand_shape in whole], gathers


def _scan_equation(pm):
    program = pm.program
    layouts = variable_layouts(program.jaxpr, program.grid, program.param_storage, program.arg_layouts)
    (eqn,) = [e for e in program.jaxpr.eqns if e.primitive.name == "scan"]
    return eqn, [layouts[v] for v in eqn.invars], R.Context(program.grid)


@pytest.mark.parametrize("model", ["scan_gpt", "lstm"])
def test_carry_layout_is_a_fixed_point_of_the_body(model):
    """The body returns its carry in the layout it received it in (no relayout per
    iteration), though the carry arrives otherwise: the embedding's output is not yet
    reduce-scattered onto the batch; an LSTM's zero state is not split at all."""
    case = build(model)
    pm = axonn_jax.partition(case.model, Grid(x=2, y=2, z=2), *case.args)
    eqn, operands, ctx = _scan_equation(pm)
    step = R.rule(eqn, operands, ctx)
    nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
    carry = step.outs[:nk]
    assert carry != operands[nc:nc + nk]  # the search had to move
    outs = CF.out_layouts(CF.bodies(eqn)[0], step.loop.bodies[0].ins, ctx)
    assert outs[:nk] == carry
    assert all(lay[0][:2] == ("data", "z") for lay in carry)  # batch split over data·z


#: (model, grid, batch rows): the recurrent cells on the redundancy grids, at one row per device
#: on z=2,data=4 (their weight gradients are one matmul after the loop: runtime/loop_weight_grads.py)
RECURRENT_REDUNDANCY = [("lstm", "x=2,y=2,z=2", 8), ("lstm", "x=4,data=2", 8),
                        ("lstm", "z=2,data=4", 8), ("lstm", "y=2,z=2,data=2", 8),
                        ("lstm", "x=2,z=2,data=2", 8), ("gru", "z=2,data=4", 8),
                        ("lstm_plain", "x=4,data=2", 8)]  # fmt: skip


@pytest.mark.parametrize("model,grid,batch", RECURRENT_REDUNDANCY, ids=str)
def test_recurrent_cells_split_4d(model, grid, batch):
    """No warning, redundancy ≤ 1.05: OptimizedLSTMCell's concatenated gate kernels are taken
    apart (partitioner/concats.py), each kernel held 1/(x·y·z) per device like LSTMCell's."""
    grid = Grid.parse(grid)
    case = build(model, batch)
    pm = axonn_jax.partition(case.model, grid, *case.args)
    report = pm.report().compute
    assert pm.plan.warnings == (), pm.plan.warnings
    assert report.redundancy <= 1.05, (report.redundancy, report.repeated(3))
    kernels = [p for p in pm.plan.params if "Cell_0/" in p.path and p.path.endswith("kernel")]
    assert len(kernels) >= 6
    for p in kernels:
        assert np.prod(p.local_shape(grid)) * grid.x * grid.y * grid.z == np.prod(p.shape), (p.path, p.storage)


@pytest.mark.parametrize("model", ["fori_refiner", "lstm"])
def test_loop_weight_gradients_are_not_summed_per_iteration(model):
    """One row per device (z=2,data=4): no weight-shaped value is carried through the backward
    loop (JAX's own scan rule adds every iteration's weight gradient into one), and the step's
    redundancy stays ≤ 1.05 (1.058 / 1.115 with the per-iteration sums)."""
    case = build(model)
    pm = axonn_jax.partition(case.model, Grid(z=2, data=4), *case.args)
    assert pm.report().compute.redundancy <= 1.05
    params = pm.shard(reference_apply(case)[0])
    step = jax.make_jaxpr(jax.grad(lambda p: case.loss(pm.apply(p, *case.args), *case.args)))(params)
    carried = [v.aval.shape for eqn in _all_eqns(step.jaxpr) if eqn.primitive.name == "scan"
               for v in eqn.invars[eqn.params["num_consts"]:eqn.params["num_consts"] + eqn.params["num_carry"]]]  # fmt: skip
    assert (HIDDEN, HIDDEN) not in carried, carried


def _all_eqns(jaxpr):
    """The equations of ``jaxpr`` and of every jaxpr nested in it."""
    yield from jaxpr.eqns
    for sub in subjaxprs(jaxpr):
        yield from _all_eqns(sub)


def _gates(h, kernels, bias, sizes=None):
    """A fused cell's step: ``h @ concat(kernels) + bias``, split into the kernels' columns."""
    fused = h @ jnp.concatenate(kernels, axis=1) + jnp.concatenate(bias).reshape(1, -1)
    cuts = np.cumsum(sizes or [k.shape[1] for k in kernels])[:-1]
    return [jnp.tanh(g) for g in jnp.split(fused, cuts, axis=1)]


def _names(jaxpr) -> list[str]:
    return [e.primitive.name for e in jaxpr.eqns]


def test_concatenations_taken_apart_exactly():
    """dot(h, concat(W_i)) + concat(b_i), split at the pieces: one product per kernel, nothing
    concatenated (in a scan body too); a split that cuts a piece, a concatenation along a
    contracting dim, one whose pieces nothing reads apart: concatenated as written. Results those of the fused form (the same
    products; only the matmul kernel chosen for the narrower shapes may round differently)."""
    rng = np.random.default_rng(0)
    h, rows = rng.standard_normal((4, 6), np.float32), rng.standard_normal((3, 5), np.float32)
    kernels = [rng.standard_normal((6, n), np.float32) for n in (4, 4, 8)]
    bias = [rng.standard_normal(n, np.float32) for n in (4, 4, 8)]
    cases = {
        "aligned": (lambda h, *w: _gates(h, w[:3], w[3:]), ["dot_general"] * 3),
        "cuts a piece": (lambda h, *w: _gates(h, w[:3], w[3:], sizes=[6, 10]),
                         ["concatenate", "dot_general", "concatenate", "split"]),
        "read whole": (lambda h, *w: jnp.concatenate([h, 2 * h]) @ w[0], ["concatenate", "dot_general"]),
        "contracting": (lambda h, *w: jnp.concatenate([h, h], axis=1) @ jnp.concatenate(w[:2], axis=0),
                        ["concatenate", "concatenate", "dot_general"]),
        "rows": (lambda h, *w: sum(jnp.split(jnp.concatenate([h, 2 * h]) @ w[0], 2)), ["dot_general"] * 2),
        "scan body": (lambda h, *w: jax.lax.scan(lambda c, _: (sum(_gates(c, w[:3], w[3:])[:2]) @ w[0]
                                                               [:, :4].T, None), h, None, length=3)[0],
                      ["dot_general"] * 4),
    }  # fmt: skip
    for name, (f, kept) in cases.items():
        closed = jax.make_jaxpr(f)(h, *kernels, *bias)
        got = take_apart(closed)
        inner = [e.params["jaxpr"].jaxpr for e in got.jaxpr.eqns if e.primitive.name == "scan"]
        names = _names(got.jaxpr) + [n for j in inner for n in _names(j)]
        assert [n for n in names if n in ("concatenate", "split", "dot_general")] == kept, (name, names)
        want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, h, *kernels, *bias)
        for g, w in zip(jax.core.eval_jaxpr(got.jaxpr, got.consts, h, *kernels, *bias), want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=name)


def test_fixed_point_search_settles_on_the_common_part_of_a_cycle():
    swap = {(("x",), ("y",)): (("y",), ("x",)), (("y",), ("x",)): (("x",), ("y",))}
    assert CF.fixed_point(lambda c: [swap[c[0]]], [(("x",), ("y",))]) == [((), ())]
    assert CF.fixed_point(lambda c: [(("data", "z"), ())], [((), ())]) == [(("data", "z"), ())]
    assert CF.meet([[(("data", "z", "x"), ())], [(("data", "z"), ("x",))]]) == [(("data", "z"), ())]


def test_stacked_layer_dim_is_never_split():
    """32 stacked layers: the layer dim is the largest a depth split could take; it stays whole."""
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    plan, _ = axonn_jax.partitioner.plan_model(ScanGPT(layers=32), Grid(x=2, y=2, z=2), tokens)
    stacked = [p for p in plan.params if p.path.startswith("blocks/")]
    assert stacked and all(p.storage[0] == () for p in stacked), [(p.path, p.storage) for p in stacked]
    attention = [p for p in stacked if "query/kernel" in p.path][0]
    assert "z" in {a for axes in attention.storage for a in axes}, attention.storage
    with pytest.raises(ValueError, match=r"'blocks/Dense_0/kernel' \(32, 32, 128\) is stacked along dim 0"):
        axonn_jax.partitioner.plan_model(
            ScanGPT(layers=32), Grid(x=2, y=2, z=2), tokens,
            options=axonn_jax.partitioner.PlanOptions(rules={"blocks/Dense_0/kernel": ("z", "y", "x")}))


@pytest.mark.parametrize("grid", ["x=2,y=2,z=2", "x=4,data=2", "z=2,data=4"], ids=str)
def test_while_loop_carrying_parameters_runs_forward_exactly(grid, devices):
    """Reverse mode cannot enter a while loop, so its parameters are checked in the forward pass."""
    case = build("while_decode")
    params, apply = reference_apply(case)
    pm = axonn_jax.partition(case.model, Grid.parse(grid), *case.args)
    want = np.asarray(apply(params, *case.args))
    got = np.asarray(pm.apply(pm.shard(params), *case.args))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert pm.plan.fallbacks == ()


@pytest.mark.parametrize("model", ["cond_switch", "while_normalised", "lstm"])
def test_step_report_covers_branches_and_loops(model):
    """A cond counts its most communicating branch, a while loop one trip (as FLOPs do)."""
    case = build(model)
    report = axonn_jax.partition(case.model, Grid(x=2, y=2, z=2), *case.args).report()
    assert report.communication.transfers and report.compute.redundancy >= 0.99


def test_split_scans_equals_the_scan_forward_and_reverse():
    from axonn_jax.partitioner.scan_cuts import split_scans

    def f(c, xs, w):
        c, ys = jax.lax.scan(lambda c, xw: (jnp.tanh(c @ xw[1]) + xw[0], c.sum()), c, (xs, w))
        d, zs = jax.lax.scan(lambda d, x: (d * 0.5 + x, d), c, xs, reverse=True)
        return c, ys, d, zs

    rng = np.random.default_rng(0)
    args = (rng.standard_normal(4), rng.standard_normal((5, 4)), rng.standard_normal((5, 4, 4)))
    closed = jax.make_jaxpr(f)(*args)
    scans = [k for k, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "scan"]
    split, origins = split_scans(closed.jaxpr, {k: (1, 3) for k in scans})
    pieces = [o for o in origins if o[1] == "piece"]
    assert len(pieces) == 6 and {(a, b) for _, _, a, b in pieces} == {(0, 1), (1, 3), (3, 5)}
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    got = jax.core.eval_jaxpr(split, closed.consts, *args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


PIPELINES = [("scan_gpt", "pipeline=2,x=2,z=2"), ("scan_gpt", "pipeline=4,z=2"),
             ("scan_gpt_nnx", "pipeline=2,y=2,z=2")]  # fmt: skip


@pytest.mark.parametrize("model,grid", PIPELINES, ids=str)
def test_pipeline_stages_cut_the_scanned_stack(model, grid, devices):
    """Each stage runs its range of the stacked layers; gradients (2 microbatches) and 5 AdamW
    steps equal the plain model; stages within 10% of an even share of the FLOPs."""
    import partition_cases
    from pipeline_cases import LR, STEPS, compare_grads, compare_params

    grid = Grid.parse(grid)
    case = build(model)
    (tokens,) = case.args
    # the plain model's 5 AdamW steps, as test_control_flow_trains_like_the_plain_model's (once per process)
    assert (partition_cases.LR, partition_cases.STEPS) == (LR, STEPS)
    params, (losses, grads, final) = partition_cases.reference_trajectory(model)
    pm = axonn_jax.partition(case.model, grid, tokens[: len(tokens) // 2])
    assert pm.plan.scan_cuts and pm.plan.fallbacks == ()
    shares = np.array([s.flops for s in pm.plan.stages]) / sum(s.flops for s in pm.plan.stages)
    assert np.all(np.abs(shares - 1 / grid.pipeline) <= 0.1 / grid.pipeline + 0.02), shares
    inputs = lambda t: (t,)  # noqa: E731
    loss, got = pm.value_and_grad(case.loss, inputs=inputs, microbatches=2)(pm.shard(params), tokens)
    assert abs(float(loss) - losses[0]) <= 1e-5 * abs(losses[0])
    failures = compare_grads(pm.gather(got), grads, f"{model} {grid}")
    step = pm.train_step(case.loss, optax.adamw(LR), inputs=inputs, microbatches=2)
    p, state = step.init(pm.shard(params))
    trained = []
    for _ in range(STEPS):
        p, state, loss = step(p, state, tokens)
        trained.append(float(loss))
    np.testing.assert_allclose(trained, losses, rtol=1e-5)
    failures += compare_params(pm.gather(p), final, params, grads, f"{model} {grid}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("model", ["scan_gpt", "scan_gpt_nnx"])
def test_each_stage_is_given_the_rows_of_its_layers_only(model, devices):
    """pipeline=2,virtual=2,x=2,z=2 cuts the 4 scanned layers over 4 stages: each stage is given only its
    rows of every stacked parameter (its slices rewritten to index them from 0; a stage given
    the whole leaf is refused), the tied embedding whole; the stages' rows are disjoint and
    cover the stack, so their gradients meet row by row (``owned_rows``), the embedding's by
    sum. The stage programs run: loss and gradients equal the plain model's."""
    from pipeline_cases import compare_grads

    from axonn_jax.runtime.pipeline.layer_rows import owned_rows, rows_given

    case = build(model)
    (tokens,) = case.args
    pm = axonn_jax.partition(case.model, Grid(pipeline=2, virtual=2, x=2, z=2), tokens)
    plan, program = pm.plan, pm.program
    flows = program.stage_flows
    stacked = {i for i, p in enumerate(plan.params) if p.shape[:1] == (4,)}
    assert len(stacked) >= 8, [p.path for p in plan.params]
    spans = []
    for f in flows:
        assert {i for i, *_ in f.param_rows} == stacked & set(f.params), f.index
        (span,) = {(first, end) for _, first, end in f.param_rows}  # every stacked leaf: the same layers
        spans.append(span)
        for e in f.eqns:
            if e.primitive.name == "slice" and e.invars[0] in program.jaxpr.invars[: len(plan.params)]:
                assert e.params["start_indices"][0] >= 0 and e.params["limit_indices"][0] <= span[1] - span[0]
    assert sorted(spans) == [(0, 1), (1, 2), (2, 3), (3, 4)], spans
    homes = pm.engine.placed.homes
    rows = owned_rows(flows, homes.users, homes.shared())
    assert set(rows) == stacked and all(sorted(r.values()) == sorted(spans) for r in rows.values())
    assert [i for i in homes.shared() if i not in stacked], "the tied embedding is summed"
    i = min(stacked)
    leaf = np.arange(np.prod(plan.params[i].shape), dtype=np.float32).reshape(plan.params[i].shape)
    np.testing.assert_array_equal(rows_given(flows[1], i, leaf), leaf[slice(*flows[1].rows_of(i))])

    params, apply = reference_apply(case)
    want_loss, want = jax.value_and_grad(lambda p: case.loss(apply(p, tokens), tokens))(params)
    step = pm.value_and_grad(case.loss, inputs=lambda t: (t,), microbatches=2)
    host, exchanged = pm.engine.placed.host, []
    sum_shared = host.sum_shared
    host.sum_shared = lambda *a: exchanged.append(a[5]) or sum_shared(*a)  # what processes would exchange
    loss, got = step(pm.shard(params), tokens)
    assert exchanged == [rows], exchanged  # the stacked gradients row by row, the embedding's summed
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert not compare_grads(pm.gather(got), jax.tree.map(np.asarray, want), model)
    stage = step.stage_programs((tokens[:4],))[1]
    whole = [jax.ShapeDtypeStruct(plan.params[i].shape, plan.params[i].dtype) for i in stage.flow.params]
    args = [program.traced.arg_avals[j] for j in stage.flow.args]
    with pytest.raises(ValueError, match=r"stage 1 reads rows 1:2 of parameter \d+ but was given 4"):
        jax.make_jaxpr(stage.forward_only)(whole, args, stage.inbound_avals())


def test_pipeline_stage_gathers_its_layers_one_per_iteration():
    """A stage's range of a stacked weight is parameter-like: the stage slices the stored
    shard and depth-gathers one layer per iteration inside its scan (no whole-range gather)."""
    from axonn_jax.runtime.executor import Executor
    from axonn_jax.runtime.pipeline.stage_program import StageProgram
    from axonn_jax.runtime.step_report import abstract_stage_mesh, collect

    case = build("scan_gpt")
    (tokens,) = case.args
    pm = axonn_jax.partition(case.model, Grid(pipeline=2, x=2, z=2), tokens)
    program, grid = pm.program, pm.plan.grid
    flow = program.stage_flows[0]
    stage = StageProgram(flow, Executor(program), abstract_stage_mesh(grid), last=False)
    params = [jax.ShapeDtypeStruct(flow.param_shape(i, pm.plan.params[i].shape), pm.plan.params[i].dtype)
              for i in flow.params]  # fmt: skip
    args = [jax.ShapeDtypeStruct(program.traced.arg_avals[j].shape, program.traced.arg_avals[j].dtype)
            for j in flow.args]  # fmt: skip
    closed = jax.make_jaxpr(stage.forward_only)(params, args, [])
    gathers = [t for t in collect(closed.jaxpr.eqns) if t.kind == "all-gather" and t.axes == ("z",)]
    layers = dict(pm.plan.scan_cuts)[next(iter(dict(pm.plan.scan_cuts)))][0]  # stage 0's range
    per_layer = [t for t in gathers if t.count == layers]
    assert len(per_layer) >= 4, gathers
    whole = {(layers, *p.local_shape(grid)[1:]) for p in pm.plan.params if p.path.startswith("blocks/")}
    assert not [t for t in gathers if t.operand_shape in whole], gathers


def test_one_list_of_call_primitives():
    """partitioner/jaxprs.py is the only module that names call-like primitives."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    naming = [str(p.relative_to(root)) for folder in ("partitioner", "runtime")
              for p in sorted((root / folder).rglob("*.py")) if '"closed_call"' in p.read_text()]  # fmt: skip
    assert naming == ["partitioner/jaxprs.py"], naming

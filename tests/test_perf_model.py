"""Performance model, grid search and ``axonn-jax`` CLI.

* ``layer_volumes`` equals eqs (1)–(5) of SC'24 on hand-computed cases;
* the whole-model count reduces to those equations for one layer (the default
  program splits eq. 3 into a forward reduce-scatter and a backward all-gather),
  equals a hand-computed two-layer case in both forms, and equals a compiled GPT
  train step in both forms (``scatter_batch`` True, the default, and False): the
  bytes of each collective kind in the HLO, and the bytes and number of
  collectives of ``pm.report()`` per (kind, group) (scalar loss reductions
  excluded: they come from the user's loss);
* eq. 7 reproduces the published Perlmutter table;
* the search only returns grids whose product is N and that divide the model;
* offloading never needs more device memory;
* the CLI prints a table and JSON, and rejects bad arguments with exit status 2.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import axonn_jax
from axonn_jax import Grid
from axonn_jax.partitioner.grid import X, Y
from axonn_jax.cli import main
from axonn_jax.perf import machines
from axonn_jax.perf.comm import collectives, elements_by
from axonn_jax.perf.memory import (
    held_microbatches,
    matmul_w_elements,
    memory,
    output_gradient_elements,
    w_residual_share,
)
from axonn_jax.perf.options import Options
from axonn_jax.perf.paper import layer_volumes
from axonn_jax.perf.spec import MatMul, ModelSpec, NormGroup, Param, Regather, Sliced, gpt_spec
from axonn_jax.perf.step import predict
from axonn_jax.search import grids, search
from compiled_steps import compile_apply_step

SMALL_GPT = dict(layers=2, hidden=64, heads=4, seq=32, batch=8, vocab=256)


# --- eqs (1)-(5) ---------------------------------------------------------------
# m, k, n, grid, transposed -> (ag_z, rs_z, ar_y, ar_x, ar_data), computed by hand:
#   ag_z = (z-1)·k·n/(x·y·z), rs_z = (z-1)/z·k·n/(x·y), ar_y = 2(y-1)/y·m·n/(z·x),
#   ar_x = 2(x-1)/x·m·k/(z·y), ar_data = 2(d-1)/d·k·n/(x·y·z); transposed swaps x and y.
HAND = [
    # 1·512·256/8 = 16384; 2·½·1024·256/4 = 65536; 2·½·1024·512/4 = 131072
    ((1024, 512, 256, dict(x=2, y=2, z=2, data=2), False), (16384, 16384, 65536, 131072, 16384)),
    # x=4,y=1,z=1,d=2: ar_x = 2·¾·100·60 = 9000; ar_data = 2·½·60·40/4 = 600
    ((100, 60, 40, dict(x=4, y=1, z=1, data=2), False), (0, 0, 0, 9000, 600)),
    # transposed: the equations see x and y swapped: y=4 acts as Gx=4, so ar_x = 9000 again
    ((100, 60, 40, dict(x=1, y=4, z=1, data=2), True), (0, 0, 0, 9000, 600)),
    # and x=4 acts as Gy=4: ar_y = 2·¾·100·40 = 6000
    ((100, 60, 40, dict(x=4, y=1, z=1, data=2), True), (0, 0, 6000, 0, 600)),
    # z=4 only (FSDP): ag = 3·64·32/4 = 1536, rs = ¾·64·32 = 1536
    ((8, 64, 32, dict(x=1, y=1, z=4, data=1), False), (1536, 1536, 0, 0, 0)),
    # x=2,y=4,z=2,d=1: ag = 1·96·48/16 = 288; rs = ½·96·48/8 = 288;
    # ar_y = 2·¾·64·48/(2·2) = 1152; ar_x = 2·½·64·96/(2·4) = 768
    ((64, 96, 48, dict(x=2, y=4, z=2, data=1), False), (288, 288, 1152, 768, 0)),
    # same, transposed (x=4, y=2 in the equations): ar_y = 2·½·64·48/(2·4) = 384;
    # ar_x = 2·¾·64·96/(2·2) = 2304
    ((64, 96, 48, dict(x=2, y=4, z=2, data=1), True), (288, 288, 384, 2304, 0)),
]


@pytest.mark.parametrize("case, expected", HAND)
def test_layer_volumes_hand_computed(case, expected):
    m, k, n, grid, transposed = case
    v = layer_volumes(m, k, n, transposed=transposed, **grid)
    assert tuple(v) == ("ag_z", "rs_z", "ar_y", "ar_x", "ar_data")
    assert tuple(v.values()) == pytest.approx(expected, abs=0)


def test_layer_volumes_transposed_is_x_y_swapped():
    for x, y in [(1, 2), (2, 4), (8, 1), (3, 5)]:
        a = layer_volumes(48, 120, 240, x=x, y=y, z=2, data=3, transposed=True)
        b = layer_volumes(48, 120, 240, x=y, y=x, z=2, data=3)
        assert a == b


@pytest.mark.parametrize("bad", [dict(m=0), dict(x=-1), dict(z=1.5), dict(data=True)])
def test_layer_volumes_rejects_bad_arguments(bad):
    args = dict(m=8, k=8, n=8, x=1, y=1, z=1, data=1) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        layer_volumes(**args)


# --- what the kernels send --------------------------------------------------------
def _one_layer(m, k, n, transposed):
    in_axis, out_axis = ("x", "y") if transposed else ("y", "x")
    return ModelSpec(
        name="one layer",
        params=(Param("w", (k, n), (in_axis, out_axis), depth=True),),
        matmuls=(MatMul("w", m, k, n, in_axis, out_axis, whole_inputs=1),),  # the model's input
        activations=(),
        batch=m,  # one row per sample: the reduce-scatters divide it
        tokens=m,
        layers=1,
        hidden=k,
    )


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("g", [dict(x=2, y=2, z=2, data=2), dict(x=4, z=2), dict(y=8),
                               dict(z=4, data=2), dict(x=2, y=4, z=2, data=3)])  # fmt: skip
def test_one_layer_reduces_to_the_paper(g, transposed):
    grid = Grid(**g)
    m, k, n = 96 * grid.batch_shards, 48, 72
    paper = layer_volumes(m // grid.data, k, n, transposed=transposed,
                          x=grid.x, y=grid.y, z=grid.z, data=grid.data)  # fmt: skip
    for recompute, scatter_batch in itertools.product((False, True), (False, True)):
        by_what = elements_by(collectives(_one_layer(m, k, n, transposed), grid,
                                          recompute=recompute, scatter_batch=scatter_batch),
                              "what")  # fmt: skip
        again = 2 if recompute else 1
        assert by_what.get("weight gather", 0) == pytest.approx(paper["ag_z"])
        assert by_what.get("weight re-gather", 0) == pytest.approx(paper["ag_z"] * (again - 1))
        assert by_what.get("weight-gradient scatter", 0) == pytest.approx(paper["rs_z"])
        # eq. 3 is the forward all-reduce over the layer's input axis (x when transposed),
        # eq. 4 the backward one over its output axis
        if scatter_batch:
            # the default program splits eq. 3 in halves: a forward reduce-scatter onto the
            # batch and its transpose, the backward all-gather of the output gradient
            assert by_what.get("layer output", 0) == pytest.approx(again * paper["ar_y"] / 2)
            assert by_what.get("layer output gradient", 0) == pytest.approx(paper["ar_y"] / 2)
        else:
            assert by_what.get("layer output", 0) == pytest.approx(again * paper["ar_y"])
        assert by_what.get("input gradient", 0) == pytest.approx(paper["ar_x"])
        assert by_what.get("weight-gradient shard", 0) == pytest.approx(paper["ar_data"])
        assert "layer input" not in by_what  # the model's input is not scattered


def test_whole_model_hand_computed():
    """A normal and a transposed layer (64→128→64) with a bias, m = 512 tokens, x=y=z=data=2.

    Per device (ring elements): rows = 512/(data·z) = 128.
      weight gathers: each block is 64·128/(x·y) = 2048, (z-1)/z of it: 1024 each -> 2048
      scatters: the same, 2048; data all-reduce of z-shards: 2·½·1024 = 1024 each -> 2048
      layer outputs: normal 2·½·128·128/2 = 8192 (y), transposed 2·½·128·64/2 = 4096 (x)
      input gradients: normal 2·½·128·64/2 = 4096 (x), transposed 2·½·128·128/2 = 8192 (y)
      bias [128] split over x: 64 elements, all-reduced over data·z = 4: 2·¾·64 = 96

    The default program (reduce-scatter onto the batch, 8/(data·z) = 2 samples per
    device, divisible by x and y) halves each layer-output all-reduce into a forward
    reduce-scatter and the backward all-gather of its gradient (normal ½·128·128/2 =
    4096 each over y, transposed ½·128·64/2 = 2048 each over x); fc2 all-gathers its
    y-scattered input (½·128·128/2 = 4096) and reduce-scatters its input gradient back
    (the same 4096 instead of the all-reduce's 8192); fc1's input is the model's (not
    scattered: its input gradient is still all-reduced);
    the bias sits on fc1's y-scattered rows: its gradient is also all-reduced over y
    (2·½·64 = 64).
    """
    spec = ModelSpec(
        name="two layers",
        params=(Param("fc1", (64, 128), ("y", "x"), depth=True),
                Param("fc2", (128, 64), ("x", "y"), depth=True),
                Param("b1", (128,), ("x",), scatter_axis="y")),  # fmt: skip
        matmuls=(MatMul("fc1", 512, 64, 128, "y", "x", whole_inputs=1),
                 MatMul("fc2", 512, 128, 64, "x", "y")),  # fmt: skip
        activations=(),
        batch=8,
        tokens=512,
        layers=1,
        hidden=64,
    )
    grid = Grid(x=2, y=2, z=2, data=2)
    weights = {
        ("weight gather", "all-gather", ("z",)): 2048,
        ("weight-gradient scatter", "reduce-scatter", ("z",)): 2048,
        ("weight-gradient shard", "all-reduce", ("data",)): 2048,
        ("input gradient", "all-reduce", ("x",)): 4096,
        ("other parameter gradients", "all-reduce", ("data", "z")): 96,
    }
    cs = collectives(spec, grid, recompute=False, scatter_batch=False)
    assert {(c.what, c.kind, c.axes): c.elements for c in cs} == weights | {
        ("layer output", "all-reduce", ("y",)): 8192,
        ("layer output", "all-reduce", ("x",)): 4096,
        ("input gradient", "all-reduce", ("y",)): 8192,
    }
    assert {c.what: c.calls for c in cs if c.what.startswith("weight")} == {
        "weight gather": 2, "weight-gradient scatter": 2, "weight-gradient shard": 1}
    cs = collectives(spec, grid, recompute=False)
    assert {(c.what, c.kind, c.axes): c.elements for c in cs} == weights | {
        ("layer output", "reduce-scatter", ("y",)): 4096,
        ("layer output gradient", "all-gather", ("y",)): 4096,
        ("layer output", "reduce-scatter", ("x",)): 2048,
        ("layer output gradient", "all-gather", ("x",)): 2048,
        ("layer input", "all-gather", ("y",)): 4096,
        ("input gradient", "reduce-scatter", ("y",)): 4096,
        ("scattered-row parameter gradients", "all-reduce", ("y",)): 64,
    }


def _compiled_collectives(grid: Grid, scatter_batch: bool, planned_loss: bool = False):
    """(the report's transfers, the compiled HLO's non-trivial collectives) of a GPT train step
    (``planned_loss``: ``pm.value_and_grad``'s, the loss planned with the model)."""
    from axonn_jax.models import GPT, GPTConfig, next_token_loss
    from axonn_jax.partitioned import partition
    from axonn_jax.runtime.hlo import collectives as hlo_collectives

    c = SMALL_GPT
    model = GPT(GPTConfig(vocab_size=c["vocab"], num_layers=c["layers"], hidden=c["hidden"],
                          num_heads=c["heads"], max_seq_len=c["seq"]))  # fmt: skip
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    pm = partition(model, grid, tokens, scatter_batch=scatter_batch)
    params = jax.eval_shape(pm.init, jax.random.key(0))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          params, pm.param_shardings)  # fmt: skip
    opt = optax.adamw(1e-3)

    loss_fn = lambda out, t: next_token_loss(out, t)  # noqa: E731
    planned = pm.value_and_grad(loss_fn)

    def step(p, s, t):
        if planned_loss:
            loss, grads = planned(p, t)
        else:
            loss, grads = jax.value_and_grad(lambda q: next_token_loss(pm.apply(q, t), t))(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    text = jax.jit(step).lower(params, jax.eval_shape(opt.init, params), tokens).compile().as_text()
    found = [x for x in hlo_collectives(text, num_devices=8) if not x.trivial]
    report = pm.report(tokens, loss_fn=loss_fn, batch=tokens) if planned_loss else pm.report()
    return report.communication.transfers, found


def _live(axes, grid: Grid) -> tuple[str, ...]:
    """The mesh axes of a group, in mesh order, without the size-1 ones."""
    return tuple(a for a in ("pipeline", "data", "z", "y", "x") if a in axes and grid.axis_size(a) > 1)


def _compare_with_hlo(grid: Grid, scatter_batch: bool, planned_loss: bool = False):
    """The model equals the compiled program kind by kind (bytes, and calls where XLA's
    combiner is predictable) and ``pm.report()`` group by group (bytes and collectives)."""
    transfers, found = _compiled_collectives(grid, scatter_batch, planned_loss)
    hlo_bytes, hlo_calls = collections.Counter(), collections.Counter()
    for c in found:
        # the user's loss is a scalar reduced over the batch axes: not part of the model
        scalar = sum(4 for dtype, dims in c.shapes if dims == ())
        wire = c.wire_bytes * (1 - scalar / c.result_bytes)
        hlo_bytes[c.kind] += wire
        hlo_calls[c.kind] += 1 if wire else 0
    loss_rows = SMALL_GPT["batch"] * (SMALL_GPT["seq"] - 1) if planned_loss else 0  # next-token targets
    ours = collectives(gpt_spec(**SMALL_GPT), grid, recompute=False, scatter_batch=scatter_batch,
                       loss_rows=loss_rows)  # fmt: skip
    our_bytes = {k: 4 * v for k, v in elements_by(ours, "kind").items()}
    our_calls, our_groups, report_groups = collections.Counter(), collections.Counter(), collections.Counter()
    for c in ours:
        our_calls[c.kind] += c.calls
        our_groups[(c.kind, _live(c.axes, grid))] += complex(4 * c.elements, c.transfers)
    for t in (t for t in transfers if t.result_shape != ()):  # the loss's scalar sums: not the model's
        report_groups[(t.kind, _live(t.axes, grid))] += complex(t.wire_bytes, t.count)
    assert our_bytes == pytest.approx(dict(hlo_bytes), rel=1e-12)
    # collective by collective: every group's wire bytes and number of collectives
    assert our_groups == pytest.approx(dict(report_groups), rel=1e-12)
    if not scatter_batch:
        assert dict(our_calls) == dict(hlo_calls)
        return
    # XLA's combiner also merges the independent all-reduces at the end of the backward pass
    # (block 0's input gradient, its first norm, the stream join) into the gradient buckets
    assert {k: v for k, v in our_calls.items() if k != "all-reduce"} == {
        k: v for k, v in hlo_calls.items() if k != "all-reduce"}
    assert hlo_calls["all-reduce"] <= our_calls["all-reduce"] <= hlo_calls["all-reduce"] + 3


@pytest.mark.parametrize("scatter_batch", [True, False], ids=["default", "all_reduce_form"])
def test_matches_compiled_gpt_step(scatter_batch):
    _compare_with_hlo(Grid(x=2, y=2, z=2), scatter_batch)


@pytest.mark.parametrize("g", ["x=2,y=2,z=2", "x=4,data=2"])
def test_matches_compiled_gpt_step_with_the_planned_loss(g):
    """The loss planned with the model: no output gathers, its max and sums all-reduced over x
    (``collectives(loss_rows=)``), as in the compiled ``pm.value_and_grad`` and ``pm.report(loss_fn=)``."""
    _compare_with_hlo(Grid.parse(g), True, planned_loss=True)


@pytest.mark.slow
@pytest.mark.parametrize("scatter_batch", [True, False], ids=["default", "all_reduce_form"])
@pytest.mark.parametrize("g", ["x=2,z=2,data=2", "y=2,z=2,data=2", "x=2,y=2,data=2"])
def test_matches_compiled_gpt_step_more_grids(g, scatter_batch):
    _compare_with_hlo(Grid.parse(g), scatter_batch)


# --- eq. 7 ----------------------------------------------------------------------
@pytest.mark.parametrize("inner, size, gbps", [
    (1, 2, 76), (1, 4, 225), (1, 8, 80), (1, 64, 80),   # x: inside a node, then eq. 7
    (2, 2, 76), (2, 4, 40), (2, 16, 40),                # inner product 2
    (4, 2, 20), (4, 8, 20), (16, 4, 20), (64, 2, 20),   # ≥ 4: one GPU per node, shared links
])  # fmt: skip
def test_perlmutter_table_and_eq7(inner, size, gbps):
    assert machines.get("perlmutter").bandwidth(inner, size) == gbps


def test_eq7_across_nodes():
    for m in machines.BUILTIN.values():
        for inner in (1, 2, 4, 8, 16, 32):
            size = 4 * m.gpus_per_node  # always crosses nodes
            expected = m.inter_node_gbps / min(m.gpus_per_node, inner)
            assert m.bandwidth(inner, size) == pytest.approx(expected)
            assert m.seconds(1e9, 0, inner, size) == pytest.approx(1 / expected)


def test_machine_profile_json_roundtrip(tmp_path):
    for m in machines.BUILTIN.values():
        path = tmp_path / f"{m.name}.json"
        machines.save(m, str(path))
        assert machines.load(str(path)) == m
    with pytest.raises(ValueError, match="unknown machine 'nope'"):
        machines.get("nope")


# --- search, memory, step time ------------------------------------------------------
def test_grids_enumerates_every_factorisation():
    for n in (1, 8, 12, 64):
        found = list(grids(n))
        tuples = {(g.x, g.y, g.z, g.data, g.pipeline) for g in found}
        assert len(tuples) == len(found)
        assert all(g.size == n for g in found)
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        brute = {t for t in itertools.product(divisors, repeat=5) if math.prod(t) == n}
        assert tuples == brute
    assert len(list(grids(8, pipeline=False))) == 20


def test_search_returns_only_valid_configs():
    spec = gpt_spec(layers=24, hidden=4096, heads=32, seq=2048, batch=512, vocab=51200)
    result = search(spec, 64, machines.get("perlmutter"), top=1000)
    assert result.ranked and result.considered == len(list(grids(64)))
    assert result.feasible == len(result.ranked)
    assert result.considered == result.feasible + sum(result.rejected.values())
    steps = [p.step_seconds for p in result.ranked]
    assert steps == sorted(steps)
    device = machines.get("perlmutter").memory_gib * 2**30
    for p in result.ranked:
        g = p.grid
        assert g.size == 64 and not spec.problems(g)
        assert 4096 % (g.x * g.y) == 0 and 32 % g.x == 0 and 512 % (g.data * g.z) == 0
        assert p.memory.device <= device
        assert (spec.batch // g.batch_shards) % p.options.microbatches == 0
    # heads = 12: x = 8 or 16 can never divide; they must be rejected, not ranked
    odd = gpt_spec(layers=4, hidden=768, heads=12, seq=128, batch=64, vocab=1024)
    ranked = search(odd, 16, machines.get("frontier"), top=1000).ranked
    assert ranked and all(12 % p.grid.x == 0 for p in ranked)


def test_offload_never_needs_more_device_memory():
    spec = gpt_spec(layers=8, hidden=1024, heads=16, seq=512, batch=64, vocab=8192)
    for g in grids(16):
        if spec.problems(g):
            continue
        for precision in ("mixed", "fp32"):
            for recompute in (False, True):
                on = memory(spec, g, Options(precision, recompute, offload=True))
                off = memory(spec, g, Options(precision, recompute, offload=False))
                assert on.device <= off.device
                assert on.optimizer == 0 < off.optimizer and on.host > 0 == off.host


def test_microbatches_shortcut_is_exact():
    spec = gpt_spec(layers=4, hidden=512, heads=8, seq=256, batch=64, vocab=4096)
    machine = machines.get("frontier")
    for g in (Grid(x=2, z=2, data=2, pipeline=2), Grid(y=2, z=4, pipeline=4), Grid(z=8)):
        base = predict(spec, g, machine, Options(microbatches=2))
        for mb in (1, 2, 4, 8):
            exact = predict(spec, g, machine, Options(microbatches=mb)).step_seconds
            assert base.step_seconds_with(mb) == pytest.approx(exact, rel=1e-12)


def test_gpt_flops_are_ipdps_eq3():
    b, s, l, h, v = 8, 2048, 24, 4096, 51200
    spec = gpt_spec(layers=l, hidden=h, heads=32, seq=s, batch=b, vocab=v)
    eq3 = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert spec.train_flops(recompute=True) == pytest.approx(eq3, rel=1e-12)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_spec_equals_the_traced_plan(tied):
    from axonn_jax.models import GPT, GPTConfig
    from axonn_jax.perf.traced import spec_from_model

    c = SMALL_GPT | dict(layers=3)
    model = GPT(GPTConfig(vocab_size=c["vocab"], num_layers=c["layers"], hidden=c["hidden"],
                          num_heads=c["heads"], max_seq_len=c["seq"], tie_embeddings=tied))  # fmt: skip
    traced = spec_from_model(model, jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32))
    analytic = gpt_spec(**c, tied=tied)

    def params(spec):
        out = collections.Counter()
        for p in spec.params:
            out[(p.shape, p.axes, p.depth, p.per_block, p.scatter_axis, p.fused, p.bucket)] += p.count
        return out

    def matmuls(spec):
        out = collections.Counter()
        for m in spec.matmuls:
            out[(m.m, m.k, m.n, m.in_axis, m.out_axis, m.recomputed, m.fused)] += m.count
            out[("whole inputs", m.m, m.k, m.n)] += m.whole_inputs
        return out

    assert params(traced) == params(analytic)
    assert matmuls(traced) == matmuls(analytic)
    assert traced.num_params == analytic.num_params == model.config.num_params()
    assert (traced.batch, traced.tokens, traced.layers, traced.hidden) == (
        analytic.batch, analytic.tokens, analytic.layers, analytic.hidden)
    assert traced.attention_flops == analytic.attention_flops
    joins = lambda spec: [(j.per_token, j.features, j.rows_axis, j.split_over) for j in spec.joins]  # noqa: E731
    assert joins(traced) == joins(analytic)
    assert set(traced.norms) == set(analytic.norms)
    for g, scatter_batch in itertools.product((Grid(x=2, y=2, z=2), Grid(z=4, data=2)), (True, False)):
        # same weight, activation and norm traffic, in the default program and the all-reduce form
        ours = collectives(traced, g, recompute=True, scatter_batch=scatter_batch)
        ref = collectives(analytic, g, recompute=True, scatter_batch=scatter_batch)
        assert elements_by(ours, "what") == pytest.approx(elements_by(ref, "what"))
        # and as many calls: a block's weights in one gather (gather groups alike)
        assert _calls_by_what(ours) == _calls_by_what(ref)


def _calls_by_what(cs) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for c in cs:
        out[c.what] += c.calls
    return dict(out)


# --- command line -------------------------------------------------------------------
GPT_ARGS = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "8",
            "--vocab", "256"]  # fmt: skip


def test_cli_table(capsys):
    assert main(["plan", "--gpus", "8", "--machine", "frontier", "--top", "3", *GPT_ARGS]) == 0
    out = capsys.readouterr().out
    assert "on 8 × frontier" in out and "grids considered" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert all(math.prod(int(v) for v in r[1:6]) == 8 for r in rows)
    # it ends with what to launch: the first row's grid, as --grid and as Grid(...)
    last = out.rstrip().splitlines()[-1]
    flag = re.match(r"to launch rank 1: --grid (\S+) --microbatches (\d+)", last)
    assert flag, last
    from axonn_jax import Grid

    grid = Grid.parse(flag.group(1))
    assert [str(v) for v in (grid.x, grid.y, grid.z, grid.data, grid.pipeline)] == rows[0][1:6]
    assert flag.group(2) == rows[0][6] and f"axonn_jax.Grid({flag.group(1).replace(',', ', ')})" in last


def test_cli_version():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("axonn-jax")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip().startswith("axonn-jax 0.")


def test_cli_json(capsys):
    assert main(["plan", "--gpus", "16", "--machine", "perlmutter", "--top", "4", "--json",
                 *GPT_ARGS]) == 0  # fmt: skip
    configs = json.loads(capsys.readouterr().out)
    assert len(configs) == 4
    for c in configs:
        assert c["x"] * c["y"] * c["z"] * c["data"] * c["pipeline"] == 16
        assert c["step_seconds"] >= c["comm_seconds"] > 0
        assert {"params", "optimizer", "activations"} <= set(c["bytes_per_gpu"])
    assert [c["step_seconds"] for c in configs] == sorted(c["step_seconds"] for c in configs)
    assert all(c["grid_flag"] == ",".join(f"{k}={c[k]}" for k in ("x", "y", "z", "data", "pipeline")
                                          if c[k] > 1) for c in configs)  # fmt: skip


def test_cli_model_factory(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "from axonn_jax.models import GPT, GPTConfig\n"
        "def make():\n"
        "    cfg = GPTConfig(vocab_size=256, num_layers=2, hidden=64, num_heads=4, max_seq_len=32)\n"
        "    return GPT(cfg), jax.ShapeDtypeStruct((8, 32), jnp.int32)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--gpus", "8", "--machine", "h100-node", "--model", "my_models:make",
                 "--json", "--no-pipeline", "--top", "50"]) == 0  # fmt: skip
    from_model = json.loads(capsys.readouterr().out)
    assert from_model and all(c["pipeline"] == 1 for c in from_model)
    # its 4 heads do not divide x=8: that grid is priced on its own plan, and marked
    assert {c["x"] for c in from_model if c["own_plan"]} == {8}
    assert main(["plan", "--gpus", "8", "--machine", "h100-node", "--model", "my_models:make",
                 "--no-pipeline", "--top", "50"]) == 0  # fmt: skip
    table = capsys.readouterr().out
    marked = [line.split()[1] for line in table.splitlines() if re.match(r"\s*\d+\*\s", line)]
    assert marked == ["8"] and "the partitioner falls back on this grid" in table


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "8", "--machine", "frontier", "--layers", "2"], "missing --hidden"),
    (["--gpus", "8", "--machine", "nope", *GPT_ARGS], "unknown machine 'nope'"),
    (["--gpus", "0", "--machine", "frontier", *GPT_ARGS], "--gpus must be >= 1"),
    (["--gpus", "8", "--machine", "frontier", "--model", "nocolon"], "module:factory"),
    (["--gpus", "8", "--machine", "frontier", "--model", "x:y", *GPT_ARGS], "cannot be combined"),
    (["--gpus", "8", "--machine", "frontier", "--model", "no_such_module_xyz:f"], "cannot import"),
    (["--gpus", "8", "--machine", "frontier", "--top", "0", *GPT_ARGS], "--top must be >= 1"),
    (["--gpus", "8", "--machine", "frontier", "--efficiency", "2", *GPT_ARGS], "--efficiency"),
    (["--gpus", "8", "--machine", "frontier", *GPT_ARGS[:4], "--heads", "5", *GPT_ARGS[6:]],
     "not divisible"),
])  # fmt: skip
def test_cli_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: axonn-jax plan" in err and message in err


@pytest.mark.parametrize("factory, message", [
    ("def make():\n    raise RuntimeError('no weights file')\n",
     r"--model bad_models:make: the factory raised RuntimeError: no weights file \(at .*bad_models\.py:2\)\. Remedy"),
    ("def make():\n    return 3\n", r"--model bad_models:make: the factory must return \(flax model, example inputs\), got int"),
])  # fmt: skip
def test_cli_a_model_factory_that_fails_is_a_usage_error_naming_it(tmp_path, monkeypatch, capsys, factory, message):
    """A factory that raises used to end the CLI with a traceback of its own code."""
    (tmp_path / "bad_models.py").write_text(factory)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "bad_models", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--gpus", "8", "--machine", "frontier", "--model", "bad_models:make"])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_a_model_factory_may_return_keyword_inputs(tmp_path, monkeypatch, capsys):
    """A factory returning a dict of example inputs gives them as keywords, as
    ``partition(model, grid, **inputs)`` takes them (the dict used to be one positional
    input: a raw ``IndexError`` from inside the model). ``--check`` compiles steps of
    positional inputs only: a usage error naming the remedy; a model that fails to trace
    is a usage error naming its error, not a traceback."""
    (tmp_path / "kw_models.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "import flax.linen as nn\n"
        "class Net(nn.Module):\n"
        "    @nn.compact\n"
        "    def __call__(self, *, features):\n"
        "        return nn.Dense(8)(nn.relu(nn.Dense(64)(features)))\n"
        "def make():\n"
        "    return Net(), {'features': jax.ShapeDtypeStruct((16, 32), jnp.float32)}\n"
        "def broken():\n"
        "    return Net(), {'features': jax.ShapeDtypeStruct((16,), jnp.float32), 'other': 1}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--gpus", "8", "--machine", "h100-node", "--model", "kw_models:make", "--json",
                 "--no-pipeline"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)
    for target, flags, message in [("kw_models:make", ["--check", "2"], r"--check compiles steps of positional "
                                    r"inputs.*Remedy"),
                                   ("kw_models:broken", [], r"kw_models:broken: cannot plan the model: TypeError")]:
        with pytest.raises(SystemExit) as exit_:
            main(["plan", "--gpus", "8", "--machine", "h100-node", "--model", target, "--no-pipeline", *flags])
        assert exit_.value.code == 2
        assert re.search(message, capsys.readouterr().err)


def test_cli_profile_then_plan(tmp_path, capsys):
    out = tmp_path / "here.json"
    assert main(["profile", "--devices", "8", "--out", str(out), "--repeats", "2"]) == 0
    machine = machines.load(str(out))
    assert machine.gpus_per_node == 8 and machine.peak_tflops > 0 and machine.latency_us
    assert set(machine.intra_node) == {(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}
    assert all(v > 0 for v in machine.intra_node.values())
    capsys.readouterr()
    assert main(["plan", "--gpus", "8", "--machine", str(out), "--json", "--precision", "fp32",
                 "--no-recompute", *GPT_ARGS]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)


def test_zero_bubble_schedules_are_priced():
    """zb: the fill and drain of the warm-up forwards only ((p−1)/v forwards), W residuals on
    top of the message-driven queue's; ZB-H1: (p−1) forwards at 1F1B's memory; no pipeline:
    every schedule the same."""
    spec = gpt_spec(layers=8, hidden=512, heads=8, seq=256, batch=64, vocab=4096)
    machine = machines.get("frontier")
    grid = Grid(z=2, pipeline=4)
    got = {s: predict(spec, grid, machine, Options(microbatches=16, recompute=False, schedule=s))
           for s in ("message", "1f1b", "zb", "zb-h1")}  # fmt: skip
    assert got["message"].bubble == pytest.approx(3 / 19)  # (p−1)/(m+p−1)
    assert got["zb"].bubble == pytest.approx(1 / 17)  # (p−1)/3 forwards: 1/(16+1)
    assert got["zb-h1"].bubble == pytest.approx(1 / 17)
    assert got["zb"].step_seconds < got["message"].step_seconds == got["1f1b"].step_seconds
    acts = {s: p.memory.activations for s, p in got.items()}
    share = w_residual_share(spec, grid, Options(microbatches=16, recompute=False, schedule="zb"))
    # stage 0's W: all its residuals (2 blocks of 16h + heads·seq, 2 B each, float32 logits)
    # and the output gradient (h, 2 B): 1 + 1024 / 57344
    assert share == pytest.approx(1 + 512 * 2 / (2 * (16 * 512 + 8 * 256) * 2 + 4096 * 4))
    assert acts["zb"] == pytest.approx(acts["message"] * (5 + 4 * share) / 5)  # 5 in flight + 4 deferred W's
    assert acts["zb-h1"] == pytest.approx(acts["message"] * 4 / 5)  # 1F1B's min(m, p)
    virtual = predict(spec, Grid(z=2, pipeline=4, virtual=2), machine,
                      Options(microbatches=16, recompute=False, schedule="zb"))  # fmt: skip
    assert virtual.bubble == pytest.approx(0.5 / 16.5)
    flat = {s: predict(spec, Grid(z=8), machine, Options(microbatches=4, schedule=s)) for s in ("message", "zb")}
    assert flat["zb"].step_seconds == flat["message"].step_seconds and flat["zb"].bubble == 0
    with pytest.raises(ValueError, match="schedule 'zigzag' is unknown"):
        Options(schedule="zigzag")


V_CASES = [(p, m) for p in range(2, 9) for m in sorted({1, 2, 4, 2 * p - 1, 2 * p, 16, 32})]


def _simulated_fill(schedule: str, p: int, m: int, split: tuple[float, float]) -> float:
    """The V's idle time in microbatch-times of a rank's work, from tests/schedule_sim.py."""
    from schedule_sim import simulate, v_shaped

    idle = simulate(schedule, p, 2, m, placement=v_shaped, split=split).idle
    return idle * m / (1 - idle)


@pytest.mark.parametrize("p,m", V_CASES)
def test_v_placement_bubble_matches_the_simulator(p, m):
    """perf.options.v_fill_and_drain against the simulated V (the real schedule classes).
    F = B = W (the model's 1/3 forward): ZB-V and 1F1B exact (1F1B also at B = W = F/2,
    forward 1/2); from m ≥ 2p, zb and ZB-H1 idle at most 0.03 above the model's bubble
    (zb at least the floor); message-driven within 0.03 at B = W = F/2, where it reaches
    the theory (at F = B = W it idles more on the V: docs/pipeline.md)."""
    from axonn_jax.perf.options import fill_and_drain, v_fill_and_drain

    def bubble(fill: float) -> float:
        return fill / (m + fill)

    def model(schedule: str) -> float:  # what predict and search use
        return fill_and_drain(p, 2, schedule, False, "v", m)

    for schedule in ("zb-v", "1f1b"):
        assert _simulated_fill(schedule, p, m, (1, 1)) == pytest.approx(model(schedule), abs=1e-9)
    assert _simulated_fill("1f1b", p, m, (0.5, 0.5)) == pytest.approx(v_fill_and_drain(p, "1f1b", 1 / 2, m), abs=1e-9)
    if m >= 2 * p:
        for schedule in ("zb", "zb-h1"):
            priced, simulated = bubble(model(schedule)), bubble(_simulated_fill(schedule, p, m, (1, 1)))
            assert priced - (1e-9 if schedule == "zb" else 0.03) <= simulated <= priced + 0.03, (schedule, simulated, priced)
        priced = bubble(model("message"))
        assert bubble(_simulated_fill("message", p, m, (0.5, 0.5))) == pytest.approx(priced, abs=0.03)


def test_zb_v_is_priced_on_the_v_only(capsys):
    """predict: ZB-V's bubble and 1F1B's p microbatches of a rank's layers on the V; refused
    elsewhere (Options, fill_and_drain, the CLI)."""
    spec = gpt_spec(layers=8, hidden=512, heads=8, seq=256, batch=64, vocab=4096)
    machine = machines.get("frontier")
    vee = Grid(z=2, pipeline=4, virtual=2, placement="v")
    got = {s: predict(spec, vee, machine, Options(microbatches=16, recompute=False, schedule=s))
           for s in ("message", "zb", "zb-v")}  # fmt: skip
    assert got["zb-v"].bubble == pytest.approx(0.5 / 16.5)  # (p − 1)·F/2, F = 1/3
    assert got["zb-v"].step_seconds < got["message"].step_seconds
    acts = {s: q.memory.activations for s, q in got.items()}
    assert acts["zb-v"] == pytest.approx(acts["message"] * 4 / 4.5) and acts["zb-v"] < acts["zb"]
    with pytest.raises(ValueError, match="V-shaped placement only"):
        predict(spec, Grid(z=2, pipeline=4, virtual=2), machine, Options(microbatches=16, schedule="zb-v"))
    args = ["plan", "--gpus", "8", "--machine", "frontier", "--top", "40", "--json", "--layers", "8",
            "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "8", "--vocab", "256"]
    assert main([*args, "--virtual", "2", "--placement", "v", "--schedule", "zb-v"]) == 0
    piped = [c for c in json.loads(capsys.readouterr().out) if c["pipeline"] > 1]
    assert piped and {c["schedule"] for c in piped} == {"zb-v"}
    assert main([*args, "--virtual", "2", "--placement", "v", "--schedule", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main([*args, "--schedule", "zb-v"])
    assert "--schedule zb-v runs on the V-shaped placement" in capsys.readouterr().err


def test_cli_prices_a_schedule(capsys):
    args = ["plan", "--gpus", "8", "--machine", "frontier", "--top", "40", "--json", *GPT_ARGS]
    assert main(args) == 0
    message = {c["grid_flag"]: c for c in json.loads(capsys.readouterr().out)}
    assert main([*args, "--schedule", "zb"]) == 0
    zb = {c["grid_flag"]: c for c in json.loads(capsys.readouterr().out)}
    piped = [g for g in zb if g in message and message[g]["pipeline"] > 1]
    assert piped and all(zb[g]["bubble"] < message[g]["bubble"] for g in piped)


def test_cli_prices_the_all_reduce_form(capsys):
    """--no-scatter-batch ranks the scatter_batch=False program: its bytes differ from the
    default form's on every grid that splits layers over x or y and equal them elsewhere (the
    forms differ only there), and the launch line names the option."""
    # one microbatch: its rows divide over x and y on every grid, so the two forms differ there
    args = ["plan", "--gpus", "8", "--machine", "frontier", "--top", "40", "--json", "--no-pipeline",
            "--microbatches", "1", *GPT_ARGS]
    assert main(args) == 0
    scatter = {c["grid_flag"]: c for c in json.loads(capsys.readouterr().out)}
    assert main([*args, "--no-scatter-batch"]) == 0
    reduce = {c["grid_flag"]: c for c in json.loads(capsys.readouterr().out)}
    assert sorted(scatter) == sorted(reduce)
    for g, c in scatter.items():
        differs = reduce[g]["comm_bytes_per_gpu"] != c["comm_bytes_per_gpu"]
        assert differs == (c["x"] * c["y"] > 1), (g, c["comm_bytes_per_gpu"], reduce[g]["comm_bytes_per_gpu"])
    assert main(["plan", "--gpus", "8", "--machine", "frontier", "--no-pipeline", "--no-scatter-batch", *GPT_ARGS]) == 0
    assert "scatter_batch=False" in capsys.readouterr().out


def test_convolutions_are_priced_as_their_implicit_gemm():
    """A CNN's convolutions are matmuls of the model: m output positions, k = input
    channels × window, n output channels, FLOPs those the partitioner counts."""
    from axonn_jax.models import CNN
    from axonn_jax.partitioner.flops import equation_flops
    from axonn_jax.partitioner.trace import inline_calls, trace_model
    from axonn_jax.perf.step import flops_per_device
    from axonn_jax.perf.traced import spec_from_model

    model, images = CNN(channels=(16, 32)), jax.ShapeDtypeStruct((16, 16, 16, 3), jnp.float32)
    spec = spec_from_model(model, images)
    convs = [m for m in spec.matmuls if not m.scatters]
    assert [(m.m, m.k, m.n, m.input_per_row) for m in convs] == [
        (16 * 16 * 16, 3 * 9, 16, 3), (16 * 8 * 8, 16 * 9, 32, 16)]  # 2×2 pooling between
    jaxpr = inline_calls(trace_model(model, images).jaxpr).jaxpr
    counted = sum(equation_flops(e) for e in jaxpr.eqns if e.primitive.name == "conv_general_dilated")
    assert sum(m.flops * m.count for m in convs) == counted
    # the compute is split like the layers': x·y and the batch shards; the first convolution
    # reads the images, whole channels (nothing to split over y) and no gradient (2 passes)
    assert [(m.in_axis, m.out_axis, m.passes) for m in convs] == [(None, X, 2), (X, Y, 3)]
    grid = Grid(x=2, y=2, data=2)
    assert flops_per_device(spec, grid, recompute=False) == pytest.approx(
        (2 * convs[0].flops / 2 + 3 * sum(m.flops * m.count for m in spec.matmuls[1:]) / 4) / 2)


def test_a_cnns_activations_are_its_channels_and_its_convolutions_outputs():
    """A CNN block's input is its input channels per position, not the convolution's k
    (channels × window, never materialised); each convolution's output, which relu and the
    pooling read, is kept, all-reduced whole over the input-channel axis (replicated there)."""
    from axonn_jax.models import CNN
    from axonn_jax.perf.step import elementwise_bytes
    from axonn_jax.perf.traced import spec_from_model

    spec = spec_from_model(CNN(channels=(16, 32)), jax.ShapeDtypeStruct((16, 16, 16, 3), jnp.float32))
    # what crosses between its two blocks: conv_0's 16 channels pooled onto a quarter of the positions
    assert spec.hidden == 16 / 4 and spec.tokens == 16 * 16 * 16
    kept = {(a.name, a.per_token, a.axis, a.kind, a.rows_axis) for a in spec.activations}
    assert kept == {
        ("block input (a layer's input)", 3, None, "checkpoint", None),  # the images: conv_0's input
        ("block input (a layer's input)", 16 / 4, X, "checkpoint", None),  # pooled, conv_1's input
        ("matmul input", 32 / 4 / 4, Y, "block", None),                 # pooled again, the head's
        ("layer output", 16, X, "block", None),                         # conv_0's, before relu
        ("layer output", 32 / 4, Y, "block", None),                     # conv_1's (8×8 positions)
        ("layer output", 10 / 256, X, "block", Y),                      # the head's logits
    }
    # on y the first convolution's input and output are whole on every device of the group:
    # their elementwise traffic is not split (that of the second's output is)
    tokens = spec.tokens / 2
    base = elementwise_bytes(spec, Grid(data=2), recompute=False, itemsize=4)
    on_y = elementwise_bytes(spec, Grid(y=2, data=2), recompute=False, itemsize=4)
    assert base - on_y == pytest.approx(4 * 4 * tokens * (8 / 2 + 2 / 2 + 10 / 256 / 2))


def test_a_block_boundary_is_as_wide_as_what_crosses_it():
    """``hidden``, what a pipeline stage sends on and receives the gradient of, is what is
    alive between the first two blocks, per token: HF ViT's stream, 64 (it was 180.7, its
    patch convolution's input pixels per token), an MLP's 1,024-wide hidden layer (it was
    its 256 inputs); our GPT's as ``gpt_spec`` has it."""
    from axonn_jax.models import GPT, MLP, GPTConfig
    from axonn_jax.perf.spec import gpt_spec
    from axonn_jax.perf.traced import PerGridSpec, spec_from_model

    vit = _hf_entry("hf_vit")
    assert PerGridSpec(vit.model, *vit.args, **vit.kwargs).base.hidden == vit.model.config.hidden_size == 64
    assert spec_from_model(MLP((1024, 1024, 256)), jax.ShapeDtypeStruct((64, 256), jnp.float32)).hidden == 1024
    config = GPTConfig(vocab_size=256, num_layers=2, hidden=128, num_heads=8, max_seq_len=64)
    traced = spec_from_model(GPT(config), jax.ShapeDtypeStruct((16, 64), jnp.int32))
    assert traced.hidden == gpt_spec(layers=2, hidden=128, heads=8, seq=64, batch=16, vocab=256).hidden == 128


def test_a_dense_block_input_is_its_first_layers_input_kept_once():
    """An MLP's blocks begin with their layer: the block inputs are the layers' inputs (their
    own widths, kept under checkpointing), not another activation of the first layer's width
    besides them; each layer's output is reduce-scattered onto the batch over its in axis."""
    from axonn_jax.models import MLP
    from axonn_jax.perf.traced import spec_from_model

    spec = spec_from_model(MLP(features=(64, 128, 16)), jax.ShapeDtypeStruct((8, 32), jnp.float32))
    checkpoints = sorted((a.per_token, a.axis, a.count) for a in spec.activations if a.kind == "checkpoint")
    assert checkpoints == [(32, Y, 1), (64, X, 1), (128, Y, 1)]  # dense_0, dense_1, dense_2's inputs
    outputs = sorted((a.per_token, a.axis, a.rows_axis) for a in spec.activations if a.name == "layer output")
    assert outputs == [(16, X, Y), (64, X, Y), (128, Y, X)]
    assert {a.name for a in spec.activations} == {"block input (a layer's input)", "layer output"}


def _hf_entry(name: str):
    """``benchmarks/hf_zoo.py``'s ``name`` (a published model, its inputs and loss); the test
    is skipped without ``transformers``."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import hf_zoo

    return hf_zoo.build(name)


def _compiled_step_collectives(model, inputs, grid: Grid, loss=None, kwargs=None, group_size: int | None = None,
                               text: str | None = None,
                               axes: tuple[str, ...] | None = None) -> dict[str, list[float]]:  # fmt: skip
    """Per kind, the wire bytes of each collective of a ``pm.apply``-based jitted train step
    of ``model`` (``benchmarks/grid_prediction.py``'s), the scalar loss's aside. ``inputs``:
    one input or a tuple of them; ``loss(outputs, *inputs)``, by default the squares loss;
    ``group_size``: only the collectives over groups of that size; ``axes``: only those
    over these mesh axes (their replica groups); ``text``: the step's compiled HLO, where
    the caller has it already."""
    from axonn_jax.partitioner.grid import STAGE_AXES
    from axonn_jax.runtime.hlo import collectives as hlo_collectives, mesh_axis_groups

    if text is None:
        text = compile_apply_step(model, inputs, grid, loss, kwargs).as_text()
    shape = [grid.axis_size(a) for a in STAGE_AXES]
    groups = None if axes is None else mesh_axis_groups(np.arange(math.prod(shape)).reshape(shape), STAGE_AXES, axes)
    out: dict[str, list[float]] = {}
    for c in hlo_collectives(text, num_devices=8):
        if (not c.trivial and group_size in (None, c.group_size)
                and groups in (None, frozenset(frozenset(g) for g in c.groups))):  # fmt: skip
            out.setdefault(c.kind, []).append(c.wire_bytes * (1 - sum(4 for _, dims in c.shapes if dims == ())
                                                              / c.result_bytes))  # fmt: skip
    return {kind: sorted(v) for kind, v in out.items()}


@pytest.mark.parametrize("name, grid", [("mlp", "x=8"), ("mlp", "x=4,y=2"), ("cnn", "x=8"), ("cnn", "y=8"),
                                        ("cnn", "x=2,y=2,z=2")])  # fmt: skip
def test_traced_collectives_are_the_compiled_steps(name, grid):
    """The collectives the model prices for a traced MLP / CNN are the compiled step's: no
    input gradient for a layer reading the model's data (nothing asks for it), and a
    convolution of whole input channels (the images) reduces nothing. Its kernel is stored
    split over y (``rules.conv``: the kernel's input channels follow the input's), so the
    step all-gathers it whole (``Param.read_whole``); and on y grids the flatten before
    the head gathers the y-split channels (a reshape keeps only a merged group's major
    dim split) and all-reduces their gradient (``Regather``). The MLP's and the CNN's
    all-gathers and reduce-scatters are the compiled ones too, the gathers of the
    outputs included: the MLP's features split over y and its batch reduce-scattered over
    x, the CNN's 16 logits per image (less than one per position)."""
    from axonn_jax.models import CNN, MLP
    from axonn_jax.perf.traced import spec_from_model

    model, inputs = ((MLP(features=(256, 256, 256, 64)), jax.ShapeDtypeStruct((64, 64), jnp.float32))
                     if name == "mlp" else
                     (CNN(channels=(32, 64), num_classes=16), jax.ShapeDtypeStruct((32, 32, 32, 8), jnp.float32)))
    g = Grid.parse(grid)
    spec = spec_from_model(model, inputs)
    if name == "cnn":
        assert [p.read_whole for p in spec.params if p.name == "conv_0/kernel"] == [Y]
        assert [(r.per_token * spec.tokens, r.axis, r.grad) for r in spec.regathers] == [(32 * 8 * 8 * 64, Y, True)]
    by_kind = _compiled_step_collectives(model, inputs, g)
    ours = [4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == "all-reduce"]
    compiled = by_kind["all-reduce"]
    # bytes in all (XLA combines the small bias-gradient all-reduces with others of the group)
    assert sum(ours) == pytest.approx(sum(compiled), rel=1e-12) and len(ours) >= len(compiled) > 0
    for kind in ("all-gather", "reduce-scatter"):
        mine = [(c.calls, 4 * c.elements) for c in collectives(spec, g, recompute=False) if c.kind == kind]
        compiled = by_kind.get(kind, [])
        assert sum(calls for calls, _ in mine) == len(compiled), kind
        assert sum(b for _, b in mine) == pytest.approx(sum(compiled), rel=1e-12), kind


@pytest.mark.parametrize("grid", ["x=4,data=2", "x=2,y=2,z=2"])
def test_a_split_fused_qkv_product_is_priced_as_the_compiled_step_gathers_it(grid):
    """HF GPT-2's attention computes q, k and v in one matmul (``c_attn``) and splits the
    product: ``rules.split`` gathers its x-split features, each device keeps its block of
    every piece, and the backward all-reduces the product's gradient (``Regather``; its
    rows stay reduce-scattered over y where the grid scatters them). The model's
    collectives are the compiled step's, kind by kind. Without the gather the model priced
    0.43 of the compiled all-reduce bytes on x=2,y=2,z=2."""
    from axonn_jax.perf.traced import spec_from_model

    entry = _hf_entry("hf_gpt2")
    spec = spec_from_model(entry.model, *entry.args, **entry.kwargs)
    assert [(r.name, r.axis, r.rows_axis) for r in spec.regathers] == [("split input", X, Y)] * 2
    g = Grid.parse(grid)
    compiled = _compiled_step_collectives(entry.model, entry.args, g, loss=entry.loss, kwargs=entry.kwargs)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        assert ours == pytest.approx(sum(compiled[kind]), rel=1e-12), kind


@pytest.mark.parametrize("name, grid", [("hf_llama", "x=2,y=2,z=2"), ("hf_opt", "x=2,y=2,z=2"),
                                        ("hf_bert", "x=2,y=2,z=2"), ("hf_llama", "y=2,z=2,data=2"),
                                        ("hf_vit", "x=4,data=2")])  # fmt: skip
def test_traced_hf_families_are_priced_as_compiled(name, grid):
    """Published models nobody here wrote: the traced model's collective bytes are the
    compiled step's, kind by kind, the norm statistics included (LayerNorm's two, RMSNorm's
    one, over the split hidden dim: ``traced._NormStatistics``; before they were counted,
    the all-reduces were priced at 0.94–0.97): block 0's first on whole rows, the others on
    the stream's scattered rows. A ViT's stream is split over x (its patch convolution's
    output channels), so are its norms; BERT's masked-LM head normalises x-split features."""
    from axonn_jax.perf.traced import spec_from_model

    entry = _hf_entry(name)
    spec, g = spec_from_model(entry.model, *entry.args, **entry.kwargs), Grid.parse(grid)
    stats, (axis, rows) = 1 if name == "hf_llama" else 2, (X, Y) if name == "hf_vit" else (Y, X)
    head = {NormGroup(1, 2, X, Y)} if name == "hf_bert" else set()  # the masked-LM head's
    assert set(spec.norms) == {NormGroup(1, stats, axis, None), NormGroup(4, stats, axis, rows)} | head
    by_kind = _compiled_step_collectives(entry.model, entry.args, g, loss=entry.loss, kwargs=entry.kwargs)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        compiled = sum(by_kind[kind])
        assert ours == pytest.approx(compiled, rel=1e-12), kind


@pytest.mark.parametrize("name", ["hf_bert", "hf_opt", "hf_llama"])
def test_a_per_grid_spec_prices_the_fallbacks_of_its_grid(name):
    """On x=4 the partitioner falls back where 4 does not divide a dim: BERT's 2 token
    types and OPT's 18 positions leave their tables' hidden dim to x; Llama's 2 key/value
    heads are gathered whole over x before they are repeated for the 4 query heads, and
    the gradient of the repeated keys and values (twice their size) is all-reduced where
    they meet the split queries. The one-device plan's spec refuses the first two grids
    and underprices the third; the spec of the grid's own plan (``PerGridSpec``) is the
    compiled step's, kind by kind. Where the one-device plan holds (x=2,y=2,z=2), that
    plan is the grid's spec, not planned again."""
    from axonn_jax.perf.traced import PerGridSpec

    entry, g = _hf_entry(name), Grid(x=4, data=2)
    specs = PerGridSpec(entry.model, *entry.args, **entry.kwargs)
    assert specs.for_grid(Grid(x=2, y=2, z=2)) is specs.base
    spec = specs.for_grid(g)
    assert spec is not specs.base and spec.problems(g) == []
    compiled = _compiled_step_collectives(entry.model, entry.args, g, loss=entry.loss, kwargs=entry.kwargs)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        assert ours == pytest.approx(sum(compiled[kind]), rel=1e-12), kind
    if name == "hf_llama":
        assert {(r.axis, r.grad_per_token / r.per_token) for r in spec.regathers} == {(X, 2.0)}
        assert len(spec.regathers) == 4  # keys and values of 2 blocks
    else:
        assert specs.base.problems(g)


@pytest.mark.parametrize("name, out_proj", [("hf_llama", "o_proj"), ("hf_opt", "out_proj"), ("hf_bert", None),
                                            ("hf_gpt2", None)])  # fmt: skip
def test_a_layer_after_one_of_the_same_orientation_is_priced_as_compiled(name, out_proj):
    """On x=8 the 4 attention heads do not divide 8: the partitioner gathers q, k and v
    whole, and the attention's output projection is a normal layer after normal ones. The
    grid's plan says what the program does: the projection reads a whole input, so its
    input gradient is all-reduced, and that all-reduce is also the gathered heads'
    gradient (priced once); block 0's MLP reads the stream still whole (nothing has
    scattered its rows yet: x=8 has no y to scatter over); the projection's output is
    gathered over x where it joins the stream (``runtime.executor.relayout`` gathers, then
    slices); the norms' and biases' gradients are reduced over the axis that scatters
    their rows on this grid; block 0's residual add slices the whole stream over x (the
    partitioner re-orients BERT's and GPT-2's blocks), so its gradient is all-reduced over
    x. Every kind is the compiled step's (before: Llama's and OPT's reduce-scatters 1.6×;
    BERT 1.06, GPT-2 1.06 in all)."""
    from axonn_jax.perf.traced import PerGridSpec

    entry, g = _hf_entry(name), Grid(x=8)
    spec = PerGridSpec(entry.model, *entry.args, **entry.kwargs).for_grid(g)
    if out_proj:
        projection = next(m for m in spec.matmuls if f"/{out_proj}/" in m.name)
        assert (projection.in_axis, projection.out_axis) == (Y, X) and projection.whole_inputs == projection.count
    compiled = _compiled_step_collectives(entry.model, entry.args, g, loss=entry.loss, kwargs=entry.kwargs)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        assert ours == pytest.approx(sum(compiled[kind]), rel=1e-12), kind


@pytest.mark.parametrize("grid", ["y=2,data=4", "y=8"])
def test_a_tied_head_meeting_features_split_the_other_way_gathers_its_weight(grid):
    """A weight whose storage is another use's can meet an input whose features are split
    over the other tensor axis: HF BERT's masked-LM decoder reads the word-embedding table
    (stored as its lookup wants: vocabulary over x, hidden over y) transposed, after the
    head's transform (a layer of y in, x out: features over x, rows reduce-scattered over
    y). ``rules._consistent`` cannot split k over x on the weight (x splits its vocabulary)
    and leaves k whole: the weight is all-gathered over y (``Param.read_whole``), the
    input's features over x, and the products are whole, so the layer reduces nothing
    forward and gathers no output gradient backward (``MatMul.weight_gathered``). Its
    input rows still split over y, each device's gradient of the gathered table is of its
    rows: the gather's transpose reduce-scatters it over y (``Param.read_whole_rows``).
    The two are the compiled step's decoder all-gather and reduce-scatter to the byte, and
    every kind is the compiled step's. Before, the layer was priced as one contracting over
    y (its output reduce-scattered, its gradient all-gathered): 0.951 of the compiled bytes
    on y=2,data=4 (and on y=2,z=2,data=2), 1.068 on y=8; on x=2,y=2,z=2 the two happen to
    move the same bytes of each kind, so that grid was exact already."""
    from axonn_jax.perf.traced import PerGridSpec
    from axonn_jax.runtime.hlo import collectives as hlo_collectives

    entry, g = _hf_entry("hf_bert"), Grid.parse(grid)
    spec = PerGridSpec(entry.model, *entry.args, **entry.kwargs).for_grid(g)
    table = "bert/embeddings/word_embeddings/embedding"
    assert [(p.read_whole, p.read_whole_rows) for p in spec.params if p.name == table] == [(Y, True)]
    assert [m.name for m in spec.matmuls if m.weight_gathered] == [table]
    ours = collectives(spec, g, recompute=False)
    text = compile_apply_step(entry.model, entry.args, g, entry.loss, entry.kwargs).as_text()
    compiled = [c for c in hlo_collectives(text, num_devices=8) if not c.trivial]
    decoder = {c.kind: c.wire_bytes for c in compiled if "cls/predictions/decoder/" in c.op_name}
    assert {c.kind: 4 * c.elements for c in ours if c.what.startswith("whole-read weight")} == decoder
    assert set(decoder) == {"all-gather", "reduce-scatter"}
    by_kind = _compiled_step_collectives(entry.model, entry.args, g, text=text)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        priced = sum(4 * c.elements for c in ours if c.kind == kind)
        assert priced == pytest.approx(sum(by_kind[kind]), rel=1e-12), kind


@pytest.mark.parametrize("grid", [Grid(x=8), Grid(x=2, y=2, z=2)], ids=["x8", "x2y2z2"])
def test_a_lookup_indexed_by_position_is_priced_at_its_size(grid):
    """HF T5 looks up its relative-position bias (a [query, key, heads] table of buckets,
    vocabulary-parallel over x like its token embedding) by position, not by sample: the
    lookup all-reduces its own elements once, whatever the batch (before: priced as rows of
    the batch × hidden, 8× its size here). The forward lookups' all-reduce is the compiled
    step's, to the byte."""
    from axonn_jax.perf.traced import PerGridSpec
    from axonn_jax.runtime.hlo import collectives as hlo_collectives

    entry = _hf_entry("hf_t5")
    spec = PerGridSpec(entry.model, *entry.args, **entry.kwargs).for_grid(grid)
    assert spec.lookups == 2 and spec.fixed_lookup_elements == 2 * 16 * 16 * 4  # encoder and decoder
    ours = sum(4 * c.elements for c in collectives(spec, grid, recompute=False) if c.what == "embedding lookup")
    text = compile_apply_step(entry.model, entry.args, grid, entry.loss, entry.kwargs).as_text()
    lookups = [c for c in hlo_collectives(text, num_devices=8) if c.kind == "all-reduce"
               and "relative_attention_bias" in c.op_name and "transpose" not in c.op_name]  # fmt: skip
    assert len(lookups) == 1  # XLA combines the four lookups' all-reduces
    assert ours == pytest.approx(lookups[0].wire_bytes, rel=1e-12)


@pytest.mark.parametrize("grid", [Grid(x=4, data=2), Grid(x=2, y=2, z=2)], ids=["x4data2", "x2y2z2"])
def test_a_whole_bias_meeting_head_split_scores_all_reduces_as_compiled(grid):
    """HF T5 adds its position bias (looked up whole, heads split over y) to the attention
    scores (heads split over x, rows scattered over y). The program slices the bias over
    its rows, then its heads; backward it all-reduces the gradient over x (the rows
    sliced), then over y (whole), once per stack: the two blocks' uses are summed first.
    With the stream's two joins (each stack's embeddings meeting block 0's output, over
    x), the step's all-reduces are the compiled step's, to the byte. Before, the bias adds
    were counted as stream joins, one per block, over the axis of the one-device plan's
    flow (y, of size 1 on x=4,data=2, so nothing): 0.82× and 0.88× the compiled bytes."""
    from axonn_jax.perf.traced import PerGridSpec

    entry = _hf_entry("hf_t5")
    spec = PerGridSpec(entry.model, *entry.args, **entry.kwargs).for_grid(grid)
    # each stack: the embeddings meeting block 0's output, the position bias meeting the scores
    assert sorted((j.features, j.rows_axis, j.split_over) for j in spec.joins) == [((), X, (Y,))] * 2 + [((X,), Y, ())] * 2
    compiled = _compiled_step_collectives(entry.model, entry.args, grid, loss=entry.loss, kwargs=entry.kwargs)
    ours = sum(4 * c.elements for c in collectives(spec, grid, recompute=False) if c.kind == "all-reduce")
    assert ours == pytest.approx(sum(compiled["all-reduce"]), rel=1e-12)


def test_a_stream_shorter_than_the_input_prices_its_norms_and_joins_by_its_own_rows():
    """HF Whisper's encoder halves its 32 input frames (conv2, stride 2), so the stream has
    half the rows of the spec's tokens, and 64 features where its first layer reads 16.
    Its norms' statistics are counted on the rows they normalise (0.5 per token) and its
    joins on the whole value's elements: on x=2,y=2,z=2 the step's all-reduces are the
    compiled step's, to the byte. Before, the norms (2× their rows) and the joins (rows ×
    the first layer's 16 features, a quarter of theirs) cancelled to 0.99×."""
    from axonn_jax.perf.traced import PerGridSpec

    entry, g = _hf_entry("hf_whisper"), Grid(x=2, y=2, z=2)
    spec = PerGridSpec(entry.model, *entry.args, **entry.kwargs).for_grid(g)
    assert {n.rows_per_token for n in spec.norms} == {0.5} and sum(n.count for n in spec.norms) == 12
    assert [(j.per_token, j.rows_axis) for j in spec.joins] == [(32.0, X)] * 2  # 8 × 16 × 64 / 256
    compiled = _compiled_step_collectives(entry.model, entry.args, g, loss=entry.loss, kwargs=entry.kwargs)
    ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == "all-reduce")
    assert ours == pytest.approx(sum(compiled["all-reduce"]), rel=1e-12)


@pytest.mark.parametrize("name", ["hf_t5", "hf_whisper"])
def test_an_encoder_decoders_joins_and_lookups_all_reduce_as_compiled_on_x8(name):
    """T5 and Whisper on x=8 (4 heads gathered whole, as for the decoder-only families).
    Two things the spec had wrong, found op by op in the compiled step:

    * the decoder's token and position lookups are its own rows, not the spec's
      ``tokens × hidden`` (Whisper's block boundary is its encoder's);
    * a whole stream is sliced where an equation's *result* is split. Decoder block 0's
      cross-attention output is gathered to meet the whole stream, so that add slices
      nothing: the stream is sliced once, at the MLP's add, and its gradient is
      all-reduced once for both residual adds.

    All-reduces and reduce-scatters are the compiled step's, to the byte (before: T5's
    all-reduces 1.12×). All-gathers differ by one tensor: the spec gathers every output
    ``pm.apply`` returns, the encoder's last hidden state too (8 × 16 × 64 on x=8); the
    loss reads only the logits, so XLA drops that gather from the step."""
    from axonn_jax.perf.traced import PerGridSpec

    entry, g = _hf_entry(name), Grid(x=8)
    spec = PerGridSpec(entry.model, *entry.args, **entry.kwargs).for_grid(g)
    compiled = _compiled_step_collectives(entry.model, entry.args, g, loss=entry.loss, kwargs=entry.kwargs)
    for kind in ("reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        assert ours == pytest.approx(sum(compiled[kind]), rel=1e-12), kind
    ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == "all-gather")
    assert ours - sum(compiled["all-gather"]) == pytest.approx(4 * 8 * 16 * 64 * 7 / 8, rel=1e-12)


def test_a_dim_split_over_x_and_y_is_priced_on_the_axis_that_splits_it():
    """HF ViT on y=2,data=4: 2 does not divide the images' 3 channels, so the partitioner
    splits the patch convolution's output channels, and the stream after it, over x·y
    (``rules.conv``). On this grid only y is larger than 1: the grid's spec takes y for
    those dims, and the data-parallel gradient all-reduce is the compiled step's, to the
    byte (taking x, of size 1, it priced those parameters whole: 1.12×)."""
    from axonn_jax.perf.traced import PerGridSpec

    entry, g = _hf_entry("hf_vit"), Grid(y=2, data=4)
    spec = PerGridSpec(entry.model, *entry.args, **entry.kwargs).for_grid(g)
    kernel = next(p for p in spec.params if p.name.endswith("patch_embeddings/projection/kernel"))
    assert kernel.axes == (None, None, None, Y)
    ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False)
               if c.kind == "all-reduce" and set(c.axes) <= {"data", "z"})  # fmt: skip
    compiled = _compiled_step_collectives(entry.model, entry.args, g, loss=entry.loss, kwargs=entry.kwargs,
                                          group_size=4)  # fmt: skip
    assert ours == pytest.approx(sum(compiled["all-reduce"]), rel=1e-12)
    # and the whole step, kind by kind (the stream's join sliced over y, read from the plan)
    compiled = _compiled_step_collectives(entry.model, entry.args, g, loss=entry.loss, kwargs=entry.kwargs)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        assert ours == pytest.approx(sum(compiled[kind]), rel=1e-12), kind



def test_a_dim_split_over_x_and_y_both_larger_than_1_is_priced_split_over_both():
    """HF ViT on x=2,y=2,z=2: the partitioner splits the patch convolution's output
    channels over x·y (2 does not divide the images' 3 channels), and with them the
    convolution's kernel and bias, the class token, the position embeddings and block 0's
    first norm. Where both x and y are larger than 1, such a dim is split over both
    (``Param.axes[d] == ("x", "y")``): each device stores a 1/(x·y) slice, so the kernel's
    z gather and gradient reduce-scatter and the others' z gradient all-reduce move half
    what one axis would, and that norm's statistics are all-reduced over x·y
    (``NormGroup.axis``), on block 0's whole rows. The step is then the compiled one's,
    kind by kind, to the byte (taking x alone: 1.032, all-gathers 1.031, reduce-scatters
    1.031, all-reduces 1.039)."""
    from axonn_jax.perf.spec import NormGroup
    from axonn_jax.perf.traced import PerGridSpec

    entry, g = _hf_entry("hf_vit"), Grid(x=2, y=2, z=2)
    spec = PerGridSpec(entry.model, *entry.args, **entry.kwargs).for_grid(g)
    kernel = next(p for p in spec.params if p.name.endswith("patch_embeddings/projection/kernel"))
    assert kernel.axes == (None, None, None, (X, Y)) and kernel.local_elements(g) == 8 * 8 * 3 * 64 / 8
    assert NormGroup(1, 2, (X, Y), None) in spec.norms
    compiled = _compiled_step_collectives(entry.model, entry.args, g, loss=entry.loss, kwargs=entry.kwargs)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        assert ours == pytest.approx(sum(compiled[kind]), rel=1e-12), kind

def test_the_search_prices_a_traced_model_on_each_grid_s_own_plan():
    """``search`` takes a ``PerGridSpec``: HF BERT's x=4 and x=8 grids, which the one-device
    plan's spec refuses (its 2 token types), are ranked with the spec of their own plan."""
    from axonn_jax.perf.traced import PerGridSpec

    entry = _hf_entry("hf_bert")
    specs = PerGridSpec(entry.model, *entry.args, **entry.kwargs)
    machine = machines.get("h100-node")
    one_plan = search(specs.base, 8, machine, top=100, pipeline=False)
    per_grid = search(specs, 8, machine, top=100, pipeline=False)
    wide = {(g.x, g.y, g.z, g.data) for g in grids(8, pipeline=False) if g.x >= 4}
    assert not wide & {(p.grid.x, p.grid.y, p.grid.z, p.grid.data) for p in one_plan.ranked}
    ranked = {(p.grid.x, p.grid.y, p.grid.z, p.grid.data): p for p in per_grid.ranked}
    assert wide <= set(ranked) and per_grid.feasible == one_plan.feasible + len(wide) == per_grid.considered
    g = Grid(x=4, data=2)
    best = ranked[(4, 1, 1, 2)]
    assert best.comm_bytes == pytest.approx(predict(specs.for_grid(g), g, machine, best.options).comm_bytes)


@pytest.mark.parametrize("grid", ["x=4,data=2", "x=2,y=2,z=2"])
def test_a_scatter_add_into_rows_split_over_the_batch_is_priced_as_compiled(grid):
    """``h.at[index].add(updates)`` (``idiom_cases.AddInto``, a graph's message passing):
    the rule gathers the operand's rows over the batch axes (``Regather`` over data and
    z, after the rows the default program scattered onto the batch over a tensor axis),
    each device adds its updates into all the rows, and the partial sums are reduce-
    scattered back onto the rows (``PartialSums``; all-gathered in backward), over the
    updates' scattered-rows axis too. Priced as the compiled step, every kind (before:
    0.41 of its bytes on both grids)."""
    import idiom_cases

    from axonn_jax.compiled_check import squares_loss
    from axonn_jax.perf.traced import spec_from_model

    model, args, kwargs = idiom_cases.idioms()["scatter_add"]
    g = Grid.parse(grid)
    spec = spec_from_model(model, *args, grid=g, **kwargs)
    assert [(ps.axes, ps.rows, ps.rows_axis) for ps in spec.partial_sums] == [(("data", "z"), 64, Y)]
    assert {r.axis for r in spec.regathers if r.name == "scatter-add input"} == {"data", "z", Y}
    by_kind = _compiled_step_collectives(model, args, g, loss=lambda out, *xs: squares_loss(out, xs[0]))
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        assert ours == pytest.approx(sum(by_kind[kind]), rel=1e-12), kind


#: (grid, kinds priced as compiled exactly, all-reduce bytes ours / compiled where not exact)
RESNET_BN_GRIDS = [
    ("y=8", ("all-gather", "reduce-scatter", "all-reduce"), None),
    ("x=8", ("all-gather", "reduce-scatter", "all-reduce"), None),
    ("x=4,data=2", ("all-gather", "reduce-scatter", "all-reduce"), None),
    ("y=2,data=4", ("all-gather", "reduce-scatter"), 1.002),
    ("x=2,y=4", ("all-gather", "reduce-scatter", "all-reduce"), None),
    ("x=2,y=2,z=2", ("all-gather", "reduce-scatter"), 1.001),
]


@pytest.mark.parametrize("grid, exact, all_reduce", RESNET_BN_GRIDS)
def test_a_resnet_with_batchnorm_is_priced_as_compiled(grid, exact, all_reduce):
    """Flax's ImageNet-style ResNet (``idiom_cases.ResNetBN``: ``BatchNorm(axis_name=)``)
    against its compiled step, kind by kind. What the model prices for it:

    * each BatchNorm's statistics, all-reduced over the batch axes forward and backward
      (``BatchStatistics``; not before), and no gradient of its running statistics (model
      state: ``Param.trainable``; they used to be priced as parameter gradients);
    * a block's first convolution meets input channels split over the axis its kernel
      stores the output channels over: the kernel is gathered over it and sliced on the
      other dim, its gradient all-reduced (``Param.read_whole_grad``), and its output
      channels are whole (``MatMul.out_axis`` from the rule's use, not the storage);
    * a convolution's output all-reduced whole and sliced again by a BatchNorm over the
      same axis has its gradient all-reduced there (``MatMul.sliced_output``), unless the
      next convolution reads it whole (its input-gradient all-reduce is that gradient);
      so have the statistics that BatchNorm computed from it while whole, one per channel
      (its mean and variance where the running averages of y-split channels meet them,
      the inverse deviation where the y-split scale does), and a value sliced as the rule
      reads it: block 1's second convolution output, gathered over x for the residual add,
      is sliced over y whole (``Sliced``: its rows, per token, or values per microbatch,
      and the tensor axes still splitting them there). The y all-reduces are the compiled
      step's to the byte on every grid;
    * a convolution after ``conv_init``, whose output channels are split over x·y,
      reduces over both (``MatMul.in_also``);
    * block 1's residual add meets x-split and y-split channels: a relayout on the
      one-device plan, which on x grids (y = 1) is an all-gather over x, so those grids
      are priced on their own plans (``PerGridSpec.holds``).

    Before: y=2,data=4 0.552 of the compiled all-reduce bytes and 0.004 of its
    all-gathers; x=2,y=4 0.52; x=4,data=2 0.993 and 0.015 of its all-gathers; then
    y=2,data=4 0.997, x=2,y=4 0.963 and x=2,y=2,z=2 0.969 before the statistics and the
    gathered residual were sliced as above. Left: the batch axes' all-reduces (data on
    y=2,data=4, z on x=2,y=2,z=2) move 40 values fewer than priced, 240 and 160 bytes:
    ``BatchStatistics`` prices two statistics of every channel backward, where for a norm
    of whole channels before y-split parameters the compiled step reduces a whole (C,) and
    a y-split (1, 1, 1, C/y).
    """
    import idiom_cases

    from axonn_jax.compiled_check import squares_loss
    from axonn_jax.perf.traced import PerGridSpec

    model, args, kwargs = idiom_cases.idioms()["resnet_bn_axis_name"]
    g = Grid.parse(grid)
    spec = PerGridSpec(model, *args, **kwargs).for_grid(g)
    assert not any(p.trainable for p in spec.params if "mean" in p.name or "var" in p.name)
    assert sum(b.count * b.stats for b in spec.batch_statistics) == 6 * 2  # six norms: mean, mean square
    if g.y > 1:
        assert sum(p.count for p in spec.params if p.read_whole_grad) == 3  # both Conv_0s, conv_proj
        assert {p.name.split("/")[-2] for p in spec.params if p.read_whole_grad} == {"Conv_0", "conv_proj"}
        sliced = [s for m in spec.matmuls for s in m.sliced_output]
        assert sum(s.elements for s in sliced if not s.rows) == 3 * (16 + 32 + 32)  # three norms' mean, var, rsqrt
        block_1 = next(m for m in spec.matmuls if "block_1/Conv_1" in m.name)
        # block 1's residual: the x-split output, gathered over x, sliced over y whole
        assert block_1.out_axis == X and block_1.sliced_output == (Sliced(Y, 8 * 4 * 4 * 32 / spec.tokens),)
    loss = lambda out, *xs: squares_loss(out, xs[0])  # noqa: E731
    text = compile_apply_step(model, args, g, loss, kwargs).as_text()
    by_kind = _compiled_step_collectives(model, args, g, text=text)
    ours = {kind: sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
            for kind in ("all-gather", "reduce-scatter", "all-reduce")}  # fmt: skip
    for kind in exact:
        assert ours[kind] == pytest.approx(sum(by_kind.get(kind, [0])), rel=1e-12), kind
    over_y = sum(4 * c.elements for c in collectives(spec, g, recompute=False)
                 if c.kind == "all-reduce" and _live(c.axes, g) == (Y,))  # fmt: skip
    assert over_y == pytest.approx(sum(_compiled_step_collectives(model, args, g, text=text, axes=(Y,))
                                       .get("all-reduce", [0])), rel=1e-12)  # fmt: skip
    if all_reduce is not None:
        assert ours["all-reduce"] / sum(by_kind["all-reduce"]) == pytest.approx(all_reduce, abs=0.001)


@pytest.mark.parametrize("grid", ["y=2,data=4", "x=2,y=2,z=2", "y=2,z=2,data=2", "x=4,data=2"])
def test_a_wav2vec2_with_its_weight_normed_positional_convolution_is_priced_as_compiled(grid):
    """HF wav2vec2 (``benchmarks/hf_zoo.py``) against its compiled step: every kind, and the
    collectives over each mesh axis, to the byte. Its positional convolution (grouped, with
    ``weight_v``, ``weight_g`` weight-normed into its kernel) is priced as the program runs it:

    * its input, the stream's rows reduce-scattered over y by the feature projection, meets
      a rule that splits its channels over y instead: the runtime's relayout gathers the rows
      over y and slices the channels (``runtime.executor.relayout``), so its gradient is
      all-reduced over y, [B, 55, 64] each way (a ``Regather`` of the convolution's input);
    * the norm of ``weight_v`` over its split output channels is a statistic of 16 rows, one
      per kernel position, the same every microbatch (``NormGroup.fixed_rows``; it was priced
      as 16 rows of the batch, divided by the batch axes);
    * ``weight_g``, whole, scales the split channels: its gradient is all-reduced over their
      axes (``Param.grad_summed_over``);
    * on z grids both are depth-split as the partitioner stores them (weights computed from
      parameters alone that a convolution reads): gathered over z, their gradients
      reduce-scattered there, not all-reduced;
    * ``masked_spec_embed`` is never read without a mask: no gradient of it is reduced.

    Before: y=2,data=4 0.953 (all-gathers 0.925, all-reduces 0.954), x=2,y=2,z=2 0.967
    (all-gathers 0.963, reduce-scatters 0.982, all-reduces 0.947), y=2,z=2,data=2 0.953,
    x=4,data=2 1.0000 (all-reduces 1.0002).
    """
    from axonn_jax.partitioner.grid import STAGE_AXES
    from axonn_jax.perf.spec import NormGroup
    from axonn_jax.perf.traced import PerGridSpec

    entry, g = _hf_entry("hf_wav2vec2"), Grid.parse(grid)
    spec = PerGridSpec(entry.model, *entry.args, **entry.kwargs).for_grid(g)
    params = {p.name.split(" ")[0].split("/")[-1]: p for p in spec.params}
    split = tuple(a for a in (X, Y) if g.axis_size(a) > 1)  # weight_v's output channels: x·y
    assert _live(params["weight_g"].grad_summed_over, g) == split[::-1]  # (in mesh order)
    assert not params["masked_spec_embed"].trainable
    assert params["weight_v"].depth == params["weight_g"].depth == (g.z > 1)
    assert NormGroup(1, 1, split if len(split) > 1 else split[0], fixed_rows=16) in spec.norms
    if g.y > 1:
        assert [(round(r.per_token * spec.tokens), r.axis, r.scattered_rows) for r in spec.regathers
                if r.name == "conv_general_dilated input"] == [(8 * 55 * 64, Y, True)]  # fmt: skip
    text = compile_apply_step(entry.model, entry.args, g, entry.loss, entry.kwargs).as_text()
    ours = collectives(spec, g, recompute=False)
    compiled = _compiled_step_collectives(entry.model, entry.args, g, text=text)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert sum(4 * c.elements for c in ours if c.kind == kind) == pytest.approx(sum(compiled[kind]),
                                                                                    rel=1e-12), kind  # fmt: skip
    live = [a for a in STAGE_AXES if g.axis_size(a) > 1]
    for axes in (c for n in range(1, len(live) + 1) for c in itertools.combinations(live, n)):
        by_axes = _compiled_step_collectives(entry.model, entry.args, g, text=text, axes=axes)
        for kind in ("all-gather", "reduce-scatter", "all-reduce"):
            priced = sum(4 * c.elements for c in ours if c.kind == kind and set(_live(c.axes, g)) == set(axes))
            assert priced == pytest.approx(sum(by_axes.get(kind, [0])), rel=1e-12), (kind, axes)


@pytest.mark.parametrize("grid, repeats, all_reduce", [
    ("x=2,y=2,z=2", 36_864, 0.728), ("x=4,data=2", 49_152, 1.005), ("y=2,data=4", 61_440, 0.957)])
def test_rows_of_an_activation_repeated_by_index_are_priced_as_summed(grid, repeats, all_reduce):
    """A graph net's ``jnp.repeat(globals_, n_edge, total_repeat_length=E)`` is a gather of
    the globals' rows, which the batch axes split, by indices every device holds: each device
    gathers the rows it has and the results are all-reduced over data and z (the rule's sums;
    ``PartialSums`` with no rows to scatter onto). It used to be priced nowhere
    (``_PRICED_REDUCTIONS`` left every gather to the vocabulary-parallel lookups). Its bytes
    are those the compiled step's all-reduces of the four repeats move (attributed by their
    source lines in the step's jaxpr, by hand: ``repeats``); the step's all-reduce bytes went
    from 0.309 / 0.627 / 0.604 of the compiled ones to 0.449 / 0.786 / 0.758, and with their
    gradients all-reduced where the concatenations slice them (``PartialSums.sliced``) to
    ``all_reduce``. The rest of the gap (concatenations relaid out, node lookups, layers
    reading whole features) is in docs/planner.md."""
    import idiom_cases

    from axonn_jax.compiled_check import squares_loss
    from axonn_jax.perf.traced import PerGridSpec

    model, args, kwargs = idiom_cases.idioms()["graph_net"]
    g = Grid.parse(grid)
    spec = PerGridSpec(model, *args, **kwargs).for_grid(g)
    gathered = tuple(p for p in spec.partial_sums if p.name == "gather output")
    assert len(gathered) == 4 and {p.axes for p in gathered} == {("data", "z")}
    only = dataclasses.replace(spec, partial_sums=gathered)
    assert sum(4 * c.elements for c in collectives(only, g, recompute=False) if c.what == "partial sums") == repeats
    by_kind = _compiled_step_collectives(model, args, g, loss=lambda out, *xs: squares_loss(out, xs[0]))
    ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == "all-reduce")
    assert ours / sum(by_kind["all-reduce"]) == pytest.approx(all_reduce, abs=0.001)


@pytest.mark.parametrize("grid", ["x=2,y=2,z=2", "y=2,data=4", "x=4,data=2"])
def test_the_gradient_of_repeated_rows_sliced_by_the_batch_is_all_reduced_as_compiled(grid):
    """``jnp.repeat(globals_, n_node)`` added to the nodes (``idiom_cases.RepeatOntoNodes``):
    the repeat's output is summed whole over the batch axes (and the tensor axis its input's
    rows are scattered over), then sliced to the device's nodes where it meets them. Backward
    the program all-reduces the gradient of what it sliced over those same axes
    (``PartialSums.sliced``). All-reduces and reduce-scatters are the compiled step's (before:
    all-reduces 0.511 / 0.541 / 0.580 of the compiled)."""
    import idiom_cases

    from axonn_jax.compiled_check import squares_loss
    from axonn_jax.perf.traced import PerGridSpec

    model, args = idiom_cases.RepeatOntoNodes(), idiom_cases.repeat_onto_nodes_batch()
    g = Grid.parse(grid)
    spec = PerGridSpec(model, *args).for_grid(g)
    assert [ps.sliced for ps in spec.partial_sums] == [((16.0, (X,)),)]  # [64, 16] per 64 nodes, x-split
    by_kind = _compiled_step_collectives(model, args, g, loss=lambda out, *xs: squares_loss(out, xs[0]))
    for kind in ("reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        assert ours == pytest.approx(sum(by_kind[kind]), rel=1e-12), kind


def test_a_grid_the_partitioner_refuses_is_dropped_by_the_search_with_its_reason():
    """A traced model's spec for a grid comes from planning the model on it; where the
    partitioner refuses the grid (a ``ValueError`` naming the remedy), the search drops
    that grid and counts it, and ranks the others."""
    spec = gpt_spec(layers=4, hidden=256, heads=8, seq=64, batch=16, vocab=512)

    class RefusesX8:
        def for_grid(self, grid: Grid) -> ModelSpec:
            if grid.x == 8:
                raise ValueError(f"cannot plan on {grid}")
            return spec

    result = search(RefusesX8(), 8, machines.get("h100-node"), top=100, pipeline=False)
    assert result.rejected == {"refused by the partitioner": 1}
    assert result.feasible == result.considered - 1 and all(p.grid.x != 8 for p in result.ranked)


@pytest.mark.parametrize("make, message", [
    (lambda: Param("w", (4,), ("z",)), "parameter 'w': axis 'z' is not one of ('x', 'y')"),
    (lambda: Param("w", (4,), ("x",), read_whole="z"), "parameter 'w': read_whole 'z' is not one of ('x', 'y')"),
    (lambda: Regather("r", 1.0, None), "regather 'r': axis None is not one of ('x', 'y', 'data', 'z')"),
    (lambda: Regather("r", 1.0, "z", split_over=("data",)), "regather 'r': split_over 'data' is not one of ('x', 'y')"),
    (lambda: Regather("r", 1.0, X, rows_axis="data"), "regather 'r': rows_axis 'data' is not one of ('x', 'y')"),
    (lambda: Regather("r", 1.0, X, whole_rows=(X,)), "regather 'r': whole_rows 'x' is not one of ('data', 'z')"),
    (lambda: NormGroup(1, axis="z"), "norm group: axis 'z' is not one of ('x', 'y')"),
])  # fmt: skip
def test_a_spec_axis_that_is_not_a_tensor_split_is_refused_by_name(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_a_dropout_mask_is_not_a_stream_join():
    """Dropout selects between the activation and zeros: neither the zeros nor the mask has
    a gradient, so nothing is all-reduced for them, and the GPT with dropout on has one
    stream join, as without (it used to count seven: 1.88× the compiled all-reduce bytes).
    Its collectives are the compiled step's, kind by kind."""
    import idiom_cases

    from axonn_jax.compiled_check import squares_loss
    from axonn_jax.perf.traced import spec_from_model

    model, args, kwargs = idiom_cases.idioms()["gpt_dropout"]
    spec, g = spec_from_model(model, *args, **kwargs), Grid(x=2, y=2, z=2)
    assert [(j.features, j.rows_axis) for j in spec.joins] == [((), X)]
    by_kind = _compiled_step_collectives(model, tuple(args), g, loss=lambda out, *_: squares_loss(out, None),
                                         kwargs=kwargs)  # fmt: skip
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        ours = sum(4 * c.elements for c in collectives(spec, g, recompute=False) if c.kind == kind)
        assert ours == pytest.approx(sum(by_kind[kind]), rel=1e-12), kind


def test_a_kernel_dim_the_grid_does_not_divide_is_not_refused():
    """HF ViT's patch embedding reads the images' 3 channels whole; its kernel's input
    channels are stored split over y where y divides them (``Param.read_whole``). On y=2
    it does not, and the partitioner splits the output channels over x·y instead: the spec
    accepts the grid (it used to refuse it, so the search skipped ViT on every y > 1) and
    prices no gather of the kernel, which the compiled step does not have either. The
    CNN's 8 input channels still divide y=2: its kernel is gathered."""
    from axonn_jax.models import CNN
    from axonn_jax.perf.traced import spec_from_model
    from axonn_jax.runtime.hlo import collectives as hlo_collectives

    entry = _hf_entry("hf_vit")
    spec, g = spec_from_model(entry.model, *entry.args, **entry.kwargs), Grid(y=2, data=4)
    kernel = next(p for p in spec.params if p.name.endswith("patch_embeddings/projection/kernel"))
    assert kernel.read_whole == Y and kernel.shape[2] == 3
    assert spec.problems(g) == [] and kernel.read_whole_split(g) == 1
    assert not [c for c in collectives(spec, g, recompute=False) if c.what == "whole-read weight gather"]
    cnn = spec_from_model(CNN(channels=(32, 64), num_classes=16), jax.ShapeDtypeStruct((32, 32, 32, 8), jnp.float32))
    assert [p.read_whole_split(g) for p in cnn.params if p.read_whole] == [2]
    pm = axonn_jax.partition(entry.model, g, *entry.args, **entry.kwargs)
    assert pm.plan.params[[p.path for p in pm.plan.params].index(kernel.name)].use[3] == (X, Y)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          jax.eval_shape(pm.init, jax.random.key(0)), pm.param_shardings)  # fmt: skip
    grads = jax.jit(jax.grad(lambda p, *xs: entry.loss(pm.apply(p, *xs, **entry.kwargs), *xs)))
    text = grads.lower(params, *entry.args).compile().as_text()
    gathers = [c for c in hlo_collectives(text, num_devices=8) if c.kind == "all-gather" and not c.trivial]
    assert gathers and not [c for c in gathers if any(dims[:3] == (8, 8, 3) for _, dims in c.shapes)]


def test_deferred_w_residuals_are_priced_per_stage():
    """Stage 0's deferred W holds its whole microbatch of residuals plus the output gradient
    (its B is empty); a later stage's W only its weight matmuls' inputs and output gradients:
    on a GPT block 16·h of the 16·h + heads·seq elements per token the block keeps (p=4, y=1:
    qkv input h once for three, their gradients 3h; out h + h; fc_in h + 4h; fc_out 4h + h)."""
    layers, hidden, heads, seq = 8, 512, 8, 256
    spec = gpt_spec(layers=layers, hidden=hidden, heads=heads, seq=seq, batch=64, vocab=4096)
    grid, options = Grid(pipeline=4), Options(microbatches=16, recompute=False, schedule="zb")
    blocks = layers / 4
    vocab_head = hidden + 4096  # the head's input and its output gradient, charged to every stage
    assert matmul_w_elements(spec, grid) == pytest.approx(blocks * 16 * hidden + vocab_head)
    first, later = w_residual_share(spec, grid, options), w_residual_share(spec, grid, options, first=False)
    assert later < 1.0 < first
    assert output_gradient_elements(spec, grid) == hidden
    held = held_microbatches(spec, grid, options, 16)
    assert held == pytest.approx(5 + 4 * first)  # limit p + 1 full, budget p W's
    assert held_microbatches(spec, grid, dataclasses.replace(options, schedule="message"), 16) == 5


@pytest.mark.parametrize("error", [1.1, 0.9])
def test_profile_latency_is_fitted_in_relative_error(error):
    """The largest message off by 10 % must not move the fitted latency, which the small
    message measures (in absolute least squares it moves by 27 %)."""
    from axonn_jax.perf.microbench import fit_latency_bandwidth

    wire = np.array([4e3, 1.3e5, 1e6])
    seconds = 50e-6 + wire / 0.5e9
    seconds[-1] *= error
    alpha, _ = fit_latency_bandwidth(wire, seconds)
    assert alpha == pytest.approx(50e-6, rel=0.03)
    assert abs(np.polyfit(wire, seconds, 1)[1] - 50e-6) > 0.25 * 50e-6  # what the relative fit avoids


def test_profile_times_a_collective_without_its_program_launch():
    """One collective's time is the difference of a long and a short program: a launch cost
    common to both cancels, and a difference lost in noise is timed again, then refused."""
    import time as time_

    from axonn_jax.perf.microbench import _extra_time

    class Program:
        """A stand-in for a compiled program: ``seconds`` of launch plus work per call."""

        def __init__(self, seconds: float):
            self.seconds, self.calls = seconds, 0

        def __call__(self, x):
            self.calls += 1
            time_.sleep(self.seconds)
            return self

        def block_until_ready(self):
            return self

    launch = 0.02
    extra = _extra_time(Program(launch + 0.015), Program(launch), None, repeats=2)
    assert 0.012 < extra < 0.03
    long, short = Program(launch), Program(launch + 0.01)  # never longer: refused after 3 tries
    with pytest.raises(ValueError, match="too busy"):
        _extra_time(long, short, None, repeats=2)
    assert long.calls == 3 * (2 + 1)  # each try: a warm-up and 2 timed runs


def test_cli_no_grid_names_why_and_prints_no_empty_table(capsys):
    """7 GPUs divide no dim of the GPT: the CLI printed an empty table, then memory remedies
    (more GPUs, --offload) for a divisibility problem. Now the error names the divisibility
    remedy and nothing else is printed; a small model's size reads as a count, not 0.00B,
    and its memory in MiB, not columns of 0.0 GiB."""
    assert main(["plan", "--gpus", "7", "--machine", "perlmutter", *GPT_ARGS]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert re.search(r"no grid of 7 GPUs .*do not divide the model.*Remedy: a GPU count whose factors divide the "
                     r"model's dims and batch", err) and "--offload" not in err
    assert main(["plan", "--gpus", "8", "--machine", "perlmutter", *GPT_ARGS]) == 0
    out = capsys.readouterr().out
    assert re.search(r": [\d,.]+M? parameters", out)
    assert "total MiB" in out and "GiB  " not in out  # its memory columns read 0.0 in GiB

"""``pm.report()``: communication and memory of a training step, checked against XLA.

Communication: for the GPT and MLP of the partition table and every grid of
the issue (x=2,y=2,z=2; x=4,z=2; y=2,z=2,data=2; z=8; data=8), a user-written
``jax.jit`` train step (value_and_grad of the loss of ``pm.apply`` + an optax
AdamW update) is compiled and the collectives of its HLO are read with
``runtime.hlo``. Each collective (each element of a combined tuple one) is
keyed by (kind, mesh axes of its replica groups, dtype, local shape). The HLO
multiset must equal the report's plus exactly one scalar fp32 all-reduce over
the live batch axes (data, z): the mean of the user's loss, which lies outside
the model and which the compiler inserts for the batch split. Bytes and ring
wire bytes then agree too (asserted). The forward part of the report must
equal the HLO of a compiled ``pm.apply`` alone (no adjustment).

The test MLP's step is also pinned collective by collective (kind, group,
count, forward and backward bytes), each derived from the layer shapes with the
reason it is there (``_mlp_step_from_layer_shapes``): a change that keeps the
values exact but sends more (an activation not gathered back before the next
layer's matmul) fails it.

Memory: parameter, gradient and AdamW-state bytes per device equal the bytes
of the sharded arrays (every device); with x·y·z = 8 each device holds exactly
1/8 of every matmul weight. What the step keeps for backward at data=8 and on
one device is within 1% of what JAX's own autodiff keeps for the plain model
on one batch shard (``print_saved_residuals``, arguments and constants
excluded); measured: 0.4% (MLP) and 0.04% (GPT) apart.
"""

import contextlib
import functools
import io
import itertools
import re
from collections import Counter

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import grid_id
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from partition_cases import GRIDS, build

import axonn_jax
from axonn_jax.partitioner.blocks import BUCKET_BLOCKS
from axonn_jax.partitioner.grid import BATCH_AXES, STAGE_AXES
from axonn_jax.models import GPT, GPTConfig
from axonn_jax.partitioner.report import ring_wire_bytes
from axonn_jax.runtime.hlo import collectives, mesh_axis_groups

MODELS = ["mlp", "gpt_linen"]
#: (model, grid) cases: the MLP on every grid; the GPT (~10 s of CPU to compile its train
#: step per grid) on the two grids that between them split every axis
CASES = [pytest.param(model, grid, id=f"{model}-{grid_id(grid)}")
         for model in MODELS for grid in (GRIDS if model == "mlp" else [GRIDS[0], GRIDS[2]])]  # fmt: skip
EIGHT_WAY = [g for g in GRIDS if g.get("x", 1) * g.get("y", 1) * g.get("z", 1) == 8]
_HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s32": "int32"}


@functools.cache
def _setup(name: str, grid_items: tuple):
    case = build(name)
    return case, axonn_jax.partition(case.model, axonn_jax.Grid(**dict(grid_items)), *case.args)


@functools.cache
def _initialised(name: str, grid_items: tuple):
    return _setup(name, grid_items)[1].init(jax.random.key(0))


def _partition(name: str, grid: dict):
    """(case, pm, params) of a model on a grid, shared by the tests of this file."""
    key = tuple(sorted(grid.items()))
    return (*_setup(name, key), _initialised(name, key))


def _planned(name: str, grid: dict):
    """(case, pm) without initialising parameters."""
    return _setup(name, tuple(sorted(grid.items())))


def _batch(pm, case):
    """The inputs placed as a user would: batch dim split over (data, z)."""
    sharding = NamedSharding(pm.mesh, P(BATCH_AXES))
    return tuple(jax.device_put(a, sharding) for a in case.args)


def _train_step(pm, case):
    optimizer = optax.adamw(1e-2)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: case.loss(pm.apply(p, *batch), *batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return optimizer, step


def _axes_of_groups(pm) -> dict:
    """{frozenset of replica groups: mesh axes} for every set of live stage axes."""
    ids = np.arange(pm.mesh.size).reshape(pm.mesh.devices.shape)
    live = [a for a in STAGE_AXES if pm.grid.axis_size(a) > 1]
    return {
        mesh_axis_groups(ids, STAGE_AXES, axes): axes
        for r in range(1, len(live) + 1)
        for axes in itertools.combinations(live, r)
    }


def _hlo_elements(pm, compiled) -> tuple[Counter, float]:
    """(kind, axes, dtype, shape) of each non-trivial collective element; total wire bytes."""
    axes_of = _axes_of_groups(pm)
    found, wire = Counter(), 0.0
    for op in collectives(compiled.as_text()):
        if op.trivial:
            continue
        axes = axes_of[frozenset(frozenset(g) for g in op.groups)]
        for dtype, shape in op.shapes:
            found[(op.kind, axes, _HLO_DTYPES[dtype], shape)] += 1
        wire += op.wire_bytes
    return found, wire


def _report_elements(transfers) -> Counter:
    out = Counter()
    for t in transfers:
        out[(t.kind, t.axes, t.dtype, t.result_shape)] += t.count
    return out


def _loss_reduction(grid) -> Counter:
    """The user's loss mean: one fp32 scalar all-reduce over the live batch axes."""
    axes = tuple(a for a in BATCH_AXES if grid.axis_size(a) > 1)
    return Counter({("all-reduce", axes, "float32", ()): 1}) if axes else Counter()


@pytest.mark.parametrize("model, grid", CASES)
def test_communication_equals_compiled_train_step(model, grid, devices):
    case, pm, params = _partition(model, grid)
    report = pm.report().communication
    optimizer, step = _train_step(pm, case)
    compiled = step.lower(params, optimizer.init(params), _batch(pm, case)).compile()
    found, hlo_wire = _hlo_elements(pm, compiled)
    loss = _loss_reduction(pm.grid)
    assert found == _report_elements(report.transfers) + loss
    loss_wire = sum(ring_wire_bytes("all-reduce", np.prod([pm.grid.axis_size(a) for a in k[1]]), 4)
                    for k in loss)  # fmt: skip
    assert report.wire_bytes + loss_wire == pytest.approx(hlo_wire, rel=1e-12)
    assert report.result_bytes + 4 * sum(loss.values()) == sum(
        n * np.prod(k[3], dtype=int) * np.dtype(k[2]).itemsize for k, n in found.items()
    )


@pytest.mark.parametrize("grid", [pytest.param(g, id=grid_id(g), marks=[] if g.get("y") == 2 else
                                                [pytest.mark.slow]) for g in GRIDS])  # fmt: skip
def test_forward_communication_equals_compiled_apply(grid, devices):
    case, pm, params = _partition("mlp", grid)
    compiled = jax.jit(pm.apply).lower(params, *_batch(pm, case)).compile()
    found, _ = _hlo_elements(pm, compiled)
    assert found == _report_elements(pm.report().communication.phase("forward").transfers)


def _device_bytes(tree) -> dict:
    """Bytes each device holds of the arrays in ``tree``."""
    held = Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return dict(held)


@pytest.mark.parametrize("grid", GRIDS, ids=grid_id)
def test_memory_equals_sharded_arrays(grid, devices):
    case, pm, params = _partition("mlp", grid)
    memory = pm.report().memory
    assert set(_device_bytes(params).values()) == {memory.parameters}
    assert memory.parameters == pm.plan.param_bytes_per_device == pm.plan.memory().parameters
    grads = jax.jit(jax.grad(lambda p, b: case.loss(pm.apply(p, *b), *b)))(params, _batch(pm, case))
    assert set(_device_bytes(grads).values()) == {memory.gradients}
    opt_state = optax.adamw(1e-2).init(params)
    moments = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: hasattr(s, "mu"))
               if hasattr(s, "mu")]  # fmt: skip
    assert set(_device_bytes([(m.mu, m.nu) for m in moments]).values()) == {memory.optimizer}


@pytest.mark.parametrize("model, grid", [c for c in CASES if c.values[1] in EIGHT_WAY])
def test_each_device_holds_an_eighth_of_the_matmul_weights(model, grid, devices):
    case, pm, params = _partition(model, grid)
    leaves = dict(zip([p.path for p in pm.plan.params], jax.tree.leaves(params)))
    matmul = [p.path for p in pm.plan.params if p.role in ("normal", "transposed")]
    assert matmul
    for path in matmul:
        full = leaves[path].nbytes
        assert {s.data.nbytes * 8 for s in leaves[path].addressable_shards} == {full}, path
        assert pm.plan.param(path).bytes_per_device(pm.plan.grid) * 8 == full, path


def _plain_saved_bytes(case, plan, shards: int) -> int:
    """Bytes JAX's autodiff keeps for the plain (linen) model on one batch shard."""
    params = jax.tree.unflatten(
        plan.param_tree, [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in plan.params]
    )
    local = [a[: a.shape[0] // shards] for a in case.args]

    def loss(p):
        return sum(jnp.sum(o) for o in jax.tree.leaves(case.model.apply({"params": p}, *local)))

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(loss, params)
    total = 0
    for line in buf.getvalue().splitlines():
        if re.search(r"from (the argument|a constant|a literal)", line):
            continue
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", line).groups()  # e.g. f32[2,16]
        size = np.prod([int(v) for v in dims.split(",") if v], dtype=int)
        total += size * (1 if dtype == "bool" else int(re.search(r"\d+", dtype)[0]) // 8)
    return total


@pytest.mark.parametrize("model, grid", [("mlp", dict(data=8)), ("gpt_linen", dict(data=8)),
                                         ("gpt_linen", dict())])  # fmt: skip
def test_kept_for_backward_matches_plain_autodiff(model, grid, devices):
    case, pm = _planned(model, grid)
    report = pm.report()
    kept = report.memory.activations + report.memory.gathered_weights
    plain = _plain_saved_bytes(case, pm.plan, pm.grid.batch_shards)
    assert abs(kept - plain) <= 0.01 * plain, (kept, plain)
    if pm.grid.size == 1:
        assert report.communication.transfers == ()


def test_report_without_devices_for_1024_devices():
    """Planned and reported for a grid 128× larger than this machine; §1's weight collectives."""
    config = GPTConfig(vocab_size=512, num_layers=2, hidden=256, num_heads=8, max_seq_len=64)
    tokens = jax.ShapeDtypeStruct((256, 64), jnp.int32)
    grid = axonn_jax.Grid(x=8, y=4, z=4, data=8)
    pm = axonn_jax.partition(GPT(config), grid, tokens)
    groups = pm.report().communication.groups()
    depth = [p for p in pm.plan.params if p.storage and any(a and a[-1] == "z" for a in p.storage)]
    shard_bytes = sum(p.bytes_per_device(grid) for p in depth)
    # one gather per block (its q, k, v, out, fc_in and fc_out kernels together), the
    # embedding table (tied: no head) with the first block's
    layers = config.num_layers
    gather = groups[("all-gather", ("z",))]
    assert (gather.count, gather.forward_bytes) == (layers, 4 * shard_bytes)
    assert gather.backward_bytes == 0  # the gathered blocks are kept, not re-gathered
    # the weight gradients: one reduce-scatter (and one data all-reduce) per bucket of blocks
    buckets = -(-layers // BUCKET_BLOCKS)
    scatter = groups[("reduce-scatter", ("z",))]
    assert (scatter.count, scatter.backward_bytes) == (buckets, shard_bytes)
    assert scatter.wire_bytes == gather.wire_bytes == 3 * shard_bytes
    data = groups[("all-reduce", ("data",))]
    assert (data.count, data.backward_bytes) == (buckets, shard_bytes)


def test_report_is_cached_and_printable(devices):
    case, pm = _planned("mlp", dict(x=2, y=2, z=2))
    first = pm.report()
    assert pm.report() is first and pm.report(*case.args) == first
    text = str(first)
    for header in ("parameter", "memory per device", "activations kept for backward",
                   "collective", "reduce-scatter"):  # fmt: skip
        assert header in text, header
    assert "memory per device: parameters" in str(pm.plan)
    assert pm.report(optimizer_slots=1).memory.optimizer * 2 == first.memory.optimizer


# --- the test MLP's step, derived from its layer shapes ------------------------------------
def _mlp_step_from_layer_shapes(samples: int, widths: list[int], grid) -> dict:
    """Every collective of the default program's train step of an MLP, one device.

    Layer i computes ``[rows, k] · [k, n]`` with ``rows = samples / (data·z)``; even
    layers are normal (input axis y, output axis x), odd ones transposed (x, y): each
    layer's output is laid out like the next layer's input (§1). For each layer:

    * forward: its weight block (k/in · n/out) is all-gathered over z, its partial
      sums are reduce-scattered over its input axis onto the batch (rows/in · n/out
      kept: the bias and gelu run on them), and, except for the first layer (the
      model's input arrives whole), its input is all-gathered back over its output
      axis (rows · k/in: the previous layer scattered it there);
    * backward: the output gradient is all-gathered over the input axis (rows · n/out,
      the reduce-scatter's transpose), the input gradient's partial sums (rows · k/in)
      are reduce-scattered over the output axis back onto the batch (rows/out · k/in:
      the input all-gather's transpose; not for the first layer: nothing upstream
      needs it), the
      bias gradient (n/out) is all-reduced over the input axis (its rows were a
      scattered share) and over z (another batch shard), the weight gradient is
      reduce-scattered over z back to the stored shard (k·n/(in·out·z)), in one
      call for each bucket of ``BUCKET_BLOCKS`` layers (each ``Dense_k`` is a block:
      ``Overlap.bucket_blocks``);
    * the model's output leaves the last layer scattered over its input axis and
      split over its output axis: it is all-gathered over both (rows · n/out, then
      rows · n) to be returned whole.

    Returns ``{(kind, axes): (count, forward bytes, backward bytes)}`` (float32).
    """
    size = grid.axis_size
    rows = samples // (grid.data * grid.z)
    out: dict = {}
    scattered: list[int] = []  # each layer's weight-gradient reduce-scatter over z

    def add(kind, axis, phase, elements):
        if size(axis) > 1:
            count, fwd, bwd = out.get((kind, (axis,)), (0, 0, 0))
            nbytes = 4 * elements
            out[(kind, (axis,))] = (count + 1, fwd + nbytes * (phase == "forward"),
                                    bwd + nbytes * (phase == "backward"))  # fmt: skip

    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        a_in, a_out = ("y", "x") if i % 2 == 0 else ("x", "y")
        g_in, g_out = size(a_in), size(a_out)
        add("all-gather", "z", "forward", k // g_in * n // g_out)
        add("reduce-scatter", a_in, "forward", rows // g_in * n // g_out)
        add("all-gather", a_in, "backward", rows * n // g_out)
        if i:
            add("all-gather", a_out, "forward", rows * k // g_in)
            add("reduce-scatter", a_out, "backward", rows // g_out * k // g_in)
        add("all-reduce", a_in, "backward", n // g_out)
        add("all-reduce", "z", "backward", n // g_out)
        scattered.append(k * n // (g_in * g_out * grid.z))
    for b in range(0, len(scattered), BUCKET_BLOCKS):  # a bucket's weight gradients: one call
        add("reduce-scatter", "z", "backward", sum(scattered[b : b + BUCKET_BLOCKS]))
    add("all-gather", a_in, "forward", rows * n // g_out)
    add("all-gather", a_out, "forward", rows * n)
    return out


@pytest.mark.parametrize("grid", [dict(x=2, y=2, z=2), dict(x=4, z=2)], ids=grid_id)
def test_mlp_step_collectives_follow_from_the_layer_shapes(grid):
    """Kind, group, count and bytes of each collective of the test MLP's step.

    Pins what the program sends, not only that it is exact: an activation left
    scattered before the next layer's matmul keeps values exact but makes XLA
    gather parameter-shaped blocks instead (on x=2,y=2,z=2 the wire bytes double);
    this test sees it.
    """
    case, pm = _planned("mlp", grid)
    (samples, features), = (a.shape for a in case.args)
    widths = [features, *case.model.features]
    report = pm.report().communication
    got = {key: (g.count, g.forward_bytes, g.backward_bytes) for key, g in report.groups().items()}
    assert got == _mlp_step_from_layer_shapes(samples, widths, pm.grid)
    if grid == dict(x=2, y=2, z=2):
        assert report.wire_bytes == 12_480

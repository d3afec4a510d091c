"""Communication overlap options (OAG, ORS, OAR): windows in the program, same numbers.

The options act through ``optimization_barrier``s that XLA's GPU compiler keeps
until after its latency-hiding scheduler has placed the asynchronous
collectives (and then removes). XLA's CPU compiler removes them before
scheduling (its collectives are synchronous), so on this machine the windows
are checked in the HLO program handed to XLA: for each option, which
collective may and may not depend on which matmul. The same program compiled
for GPU is checked by ``benchmarks/overlap.py`` (async start/done pairs).

Model: a 3-layer MLP (8 → 16 → 32 → 64) on x=y=z=2, so every layer's
gathered weight, weight-gradient reduce-scatter and activations have distinct
local shapes and can be named by shape. Block gathers: three numbered blocks of
two Dense layers each, every block's weights gathered in one all-gather of a
distinct size.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import pytest
from partition_cases import assert_matches_reference, trajectories

import axonn_jax
from axonn_jax.models import MLP
from axonn_jax.runtime.hlo import ancestors, computations
from axonn_jax.runtime.overlap import Overlap

SETTINGS = [Overlap(*flags) for flags in itertools.product((True, False), repeat=3)]
FEATURES = (16, 32, 64)
#: per layer: (gathered weight, stored weight shard) local shapes on x=y=z=2
GATHERED = [(4, 8), (8, 16), (16, 32)]
SHARD = [(4, 4), (8, 8), (16, 16)]


def _program(overlap: Overlap, scatter_batch: bool = False) -> tuple[list, list]:
    """(forward, backward) instruction lists of the grad program handed to XLA.

    ``scatter_batch=False`` (the all-reduce form) unless asked: its input-gradient
    all-reduces are what OAR moves there.
    """
    x = jnp.ones((16, 8), jnp.float32)
    # each Dense_k is a block: one weight-gradient reduce-scatter per layer, not a bucket's
    overlap = dataclasses.replace(overlap, bucket_blocks=1)
    pm = axonn_jax.partition(MLP(features=FEATURES), axonn_jax.Grid(x=2, y=2, z=2), x,
                             overlap=overlap, scatter_batch=scatter_batch)  # fmt: skip
    params = pm.init(jax.random.key(0), x)

    def loss(p):
        return jnp.mean(pm.apply(p, x) ** 2)

    text = jax.jit(jax.grad(loss)).lower(params).as_text(dialect="hlo")
    bodies = [c for c in computations(text).values()
              if any(i.opcode in ("all-gather", "reduce-scatter") for i in c)]  # fmt: skip
    # the backward reduce-scatters the weight gradients (the default program's forward
    # reduce-scatters activations too)
    backward = next(c for c in bodies if any(i.opcode == "reduce-scatter" and i.dims in SHARD
                                             for i in c))  # fmt: skip
    forward = next(c for c in bodies if c is not backward and any(i.opcode == "all-gather" for i in c))
    return forward, backward


def _one(instructions, opcode, dims):
    found = [i for i in instructions if i.opcode == opcode and i.dims == dims]
    assert len(found) == 1, (opcode, dims, [i.name for i in found])
    return found[0].name


def _dots(instructions, **where):
    return [i.name for i in instructions if i.opcode == "dot" and all(
        getattr(i, k) == v for k, v in where.items())]  # fmt: skip


@pytest.fixture(scope="module")
def programs(devices):
    return {str(o): _program(o) for o in (Overlap(), Overlap(False, False, False))}


def _forward_windows(forward):
    """For layers 1 and 2: does the weight's all-gather depend on the previous layer's matmul?"""
    deps = ancestors(forward)
    gathers = [_one(forward, "all-gather", GATHERED[l]) for l in range(3)]
    matmuls = [next(d for d in _dots(forward) if gathers[l] in deps[d]) for l in range(3)]
    return [matmuls[l - 1] in deps[gathers[l]] for l in (1, 2)], deps, gathers, matmuls


def test_oag_prefetches_the_next_layers_gather(devices):
    on, deps, gathers, matmuls = _forward_windows(_program(Overlap(gather=True))[0])
    assert on == [False, False], "with OAG a layer's gather must not wait for the previous matmul"
    assert matmuls[0] in deps[gathers[2]], "prefetch is one layer ahead, not earlier"
    off, *_ = _forward_windows(_program(Overlap(gather=False))[0])
    assert off == [True, True], "without OAG the gather is issued just in time"


def _backward_parts(backward):
    deps = ancestors(backward)
    scatters = [_one(backward, "reduce-scatter", SHARD[l]) for l in range(3)]
    by_name = {i.name: i for i in backward}
    weight_grads, input_grads = {}, {}
    for l in range(3):  # the weight-gradient matmul: the last matmul feeding the reduce-scatter
        feeding = [d for d in _dots(backward) if d in deps[scatters[l]]]
        weight_grads[l] = next(d for d in feeding if not any(d in deps[e] for e in feeding))
    for l in (1, 2):  # input-gradient matmuls read the gathered weight (kept from forward)
        input_grads[l] = next(d for d in _dots(backward) if d not in weight_grads.values()
                              and by_name[d].dims == (8, FEATURES[l - 1] // 2))  # fmt: skip
    reduces = {l: next((i.name for i in backward if i.opcode == "all-reduce"
                        and input_grads[l] in deps[i.name] and i.dims == by_name[input_grads[l]].dims),
                       None)
               for l in (1, 2)}  # fmt: skip
    return deps, scatters, weight_grads, input_grads, reduces


def test_oar_runs_the_input_gradient_all_reduce_beside_the_weight_gradient_matmul(devices):
    deps, _, dw, di, ar = _backward_parts(_program(Overlap(all_reduce=True))[1])
    for l in (1, 2):
        assert di[l] in deps[dw[l]], f"layer {l}: weight-gradient matmul ordered after dI matmul"
        assert ar[l] not in deps[dw[l]], f"layer {l}: dI all-reduce free to overlap the dW matmul"
    deps, _, dw, di, ar = _backward_parts(_program(Overlap(all_reduce=False))[1])
    for l in (1, 2):
        assert ar[l] in deps[dw[l]], f"layer {l}: without OAR the dW matmul waits for the all-reduce"


#: per layer: its input features (local: half of them, split over its input axis)
INPUTS = (8, *FEATURES[:-1])


def _scattered_input_gradients(backward, deps, input_grads) -> dict:
    """Layers 1, 2: the reduce-scatter of the input gradient onto the batch (8 rows → 4)."""
    return {l: next((i.name for i in backward if i.opcode == "reduce-scatter"
                     and input_grads[l] in deps[i.name] and i.dims == (4, INPUTS[l] // 2)), None)
            for l in (1, 2)}  # fmt: skip


def test_oar_in_the_default_program_reduce_scatters_beside_the_weight_gradient_matmul(devices):
    """The default program (batch reduce-scattered between layers): a layer's input was
    all-gathered over its output axis, so its input gradient is reduce-scattered back
    (the gather's transpose). With OAR the reduce-scatter, and the all-gather of the
    layer below's output gradient that follows it, run beside the weight-gradient
    matmul, which waits only for the input-gradient matmul. Without OAR the program
    is the blocking one: all-reduce, then the weight-gradient matmul."""
    backward = _program(Overlap(), scatter_batch=True)[1]
    deps, _, dw, di, _ = _backward_parts(backward)
    rs = _scattered_input_gradients(backward, deps, di)
    for l in (1, 2):
        assert rs[l], f"layer {l}: the input gradient is reduce-scattered onto the batch"
        assert di[l] in deps[dw[l]], f"layer {l}: weight-gradient matmul ordered after dI matmul"
        assert rs[l] not in deps[dw[l]], f"layer {l}: dI reduce-scatter free to overlap the dW matmul"
        below = [i.name for i in backward if i.opcode == "all-gather" and rs[l] in deps[i.name]]
        assert below and not any(g in deps[dw[l]] for g in below), (
            f"layer {l}: the next all-gather of the backward is free to overlap the dW matmul")
    backward = _program(Overlap(all_reduce=False), scatter_batch=True)[1]
    deps, _, dw, di, ar = _backward_parts(backward)
    assert _scattered_input_gradients(backward, deps, di) == {1: None, 2: None}
    for l in (1, 2):
        assert ar[l] in deps[dw[l]], f"layer {l}: without OAR the dW matmul waits for the all-reduce"


def test_ors_defers_weight_gradient_reduce_scatters(devices):
    # layer 2's weight is gathered one layer ahead (OAG), so without ORS its
    # reduce-scatter must finish before layer 0's backward matmul starts.
    deps, rs, dw, _, _ = _backward_parts(_program(Overlap(reduce_scatter=True))[1])
    assert rs[2] not in deps[dw[0]] and rs[1] not in deps[dw[0]]
    deps, rs, dw, _, _ = _backward_parts(_program(Overlap(reduce_scatter=False))[1])
    assert rs[2] in deps[dw[0]], "without ORS the backward waits for the reduce-scatter"
    # just-in-time gathers (no OAG): the wait is one layer earlier
    deps, rs, dw, _, _ = _backward_parts(_program(Overlap(gather=False, reduce_scatter=False))[1])
    assert rs[2] in deps[dw[1]] and rs[1] in deps[dw[0]]


@pytest.mark.parametrize("overlap", SETTINGS, ids=str)
def test_every_setting_gives_the_same_numbers(overlap, devices):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32)
    base = axonn_jax.partition(MLP(features=FEATURES), axonn_jax.Grid(x=2, y=2, z=2), x)
    pm = axonn_jax.partition(MLP(features=FEATURES), axonn_jax.Grid(x=2, y=2, z=2), x,
                             overlap=overlap)  # fmt: skip
    params = base.init(jax.random.key(0), x)

    def grads(model):
        return jax.jit(jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2)))(params)

    (want_loss, want), (got_loss, got) = grads(base), grads(pm)
    assert float(got_loss) == float(want_loss)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("grid", [dict(x=2, y=2, z=2), dict(y=2, z=2, data=2)], ids=str)
def test_no_overlap_gpt_matches_unpartitioned(grid, devices):
    """The default (all on) is what every other equivalence test runs; this is all off."""
    assert_matches_reference(trajectories("gpt_linen", grid, overlap="none"), f"gpt {grid} none")


def test_parse_and_errors():
    assert Overlap.parse("all") == Overlap()
    assert Overlap.parse("ors") == Overlap(False, True, False)
    assert str(Overlap.parse("oar,oag")) == "oag,oar"
    with pytest.raises(ValueError, match="oag, ors, oar"):
        Overlap.parse("oag,prefetch")


class _Pair(nn.Module):
    """One block of two Dense layers (8 → width → 8)."""

    width: int

    @nn.compact
    def __call__(self, x):
        up = nn.Dense(self.width, use_bias=False, name="up")(x)
        return nn.Dense(8, use_bias=False, name="down")(nn.relu(up))


#: per block: its two weights' shards on x=y=z=2 (8·width·2 / 8 elements), gathered as one row each
BLOCK_WIDTHS = (16, 32, 64)
BLOCK_GATHERED = [(2, 2 * w) for w in BLOCK_WIDTHS]


class _Blocks(nn.Module):
    """Numbered blocks (``block_0`` ...), gathered one block at a time."""

    widths: tuple[int, ...] = BLOCK_WIDTHS

    @nn.compact
    def __call__(self, x):
        for b, width in enumerate(self.widths):
            x = _Pair(width, name=f"block_{b}")(x)
        return x


def _block_program(overlap: Overlap, widths: tuple[int, ...] = BLOCK_WIDTHS) -> dict:
    """The grad program of ``_Blocks(widths)`` on x=y=z=2 handed to XLA, by computation name."""
    x = jnp.ones((16, 8), jnp.float32)
    pm = axonn_jax.partition(_Blocks(widths), axonn_jax.Grid(x=2, y=2, z=2), x, overlap=overlap,
                             scatter_batch=False)  # fmt: skip
    params = pm.init(jax.random.key(0), x)
    text = jax.jit(jax.grad(lambda p: jnp.mean(pm.apply(p, x) ** 2))).lower(params).as_text(dialect="hlo")
    return computations(text)


def _block_forward(overlap: Overlap) -> list:
    return next(c for c in _block_program(overlap).values()
                if any(i.opcode == "all-gather" and i.dims == BLOCK_GATHERED[0] for i in c))  # fmt: skip


@pytest.mark.parametrize("oag", [True, False], ids=["oag", "no_oag"])
def test_block_gathers_keep_the_oag_window(oag, devices):
    """A block's weights in one all-gather; with OAG block b's is issued before block b-1's
    matmuls (prefetched one block ahead, not earlier), without OAG after them."""
    forward = _block_forward(Overlap(gather=oag))
    deps = ancestors(forward)
    gathers = [_one(forward, "all-gather", dims) for dims in BLOCK_GATHERED]
    # a block's own matmuls: those reading its gather and not the next one's
    own = [{d for d in _dots(forward) if gathers[b] in deps[d]
            and (b + 1 == len(gathers) or gathers[b + 1] not in deps[d])} for b in range(3)]  # fmt: skip
    assert all(len(o) == 2 for o in own), own
    waits = [any(d in deps[gathers[b]] for d in own[b - 1]) for b in (1, 2)]
    assert waits == ([False, False] if oag else [True, True])
    if oag:
        assert any(d in deps[gathers[2]] for d in own[0]), "prefetch is one block ahead, not earlier"


#: four blocks with distinct local weight shapes on x=y=z=2: (4, w/2) up, (w/2, 4) down
BUCKET_WIDTHS = (24, 40, 56, 72)


def test_a_bucket_reduces_after_its_first_block_and_the_blocks_below_do_not_wait(devices):
    """Buckets of 2 of 4 blocks, [0, 1] and [2, 3] (the default program's form with 4 blocks
    a bucket): one weight-gradient reduce-scatter per bucket, of both blocks' shards. The
    backward reaches block 3 first: bucket [2, 3]'s reduce-scatter takes blocks 2 and 3's
    weight-gradient matmuls and no matmul of blocks 0 and 1, and none of blocks 0 and 1's
    matmuls waits for it (ORS's window: on GPU it runs beside their backward)."""
    backward = next(c for c in _block_program(Overlap(bucket_blocks=2), BUCKET_WIDTHS).values()
                    if any(i.opcode == "reduce-scatter" for i in c))  # fmt: skip
    deps = ancestors(backward)
    bucket_of = lambda blocks: (1, sum(2 * BUCKET_WIDTHS[b] for b in blocks))  # noqa: E731
    scatters = [i for i in backward if i.opcode == "reduce-scatter"]
    assert sorted(i.dims for i in scatters) == sorted([bucket_of([0, 1]), bucket_of([2, 3])]), scatters
    low, high = (_one(backward, "reduce-scatter", bucket_of(blocks)) for blocks in ([0, 1], [2, 3]))
    weight_grads = {b: _dots(backward, dims=(4, w // 2)) + _dots(backward, dims=(w // 2, 4))
                    for b, w in enumerate(BUCKET_WIDTHS)}  # fmt: skip
    assert all(len(dw) == 2 for dw in weight_grads.values()), weight_grads
    assert all(d in deps[high] for b in (2, 3) for d in weight_grads[b]), "the bucket reduces blocks 2 and 3"
    assert not any(d in deps[high] for b in (0, 1) for d in weight_grads[b]), (
        "bucket [2, 3] is issued after block 2's backward, not after the blocks below")
    below = [d for d in _dots(backward) if d not in deps[high]]  # blocks 0 and 1's, dI of block 2's input
    assert below and not any(high in deps[d] for d in below), "no matmul waits for bucket [2, 3]"
    assert all(d in deps[low] for b in (0, 1) for d in weight_grads[b])

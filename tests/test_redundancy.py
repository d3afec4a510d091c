"""No repeated work: compute and parameters split across the whole tensor-parallel grid.

Published HuggingFace models (``benchmarks/hf_zoo.py``: GPT-2, BERT, Llama,
OPT, T5, Whisper, Wav2Vec2, ViT, small configs) and the repo's CNN, each family on
two of the four grids of issue 15 (every grid under four families; the full
table is ``benchmarks/redundancy.py``'s). Redundancy is ``devices × per-device FLOPs / plain FLOPs``
of one loss-and-gradient step, counted on the traced programs
(:mod:`axonn_jax.partitioner.flops`; ``benchmarks/redundancy.py`` reports the
compiled programs' XLA counts, which agree); the parameter fraction is the
bytes one device holds over the model's. Loss and gradients equal the plain
model's (``benchmarks.redundancy.measure``). The same families in train mode
with every dropout probability 0.1 (``hf_zoo.build(dropout=0.1)``) stay ≤ 1.05:
the random bits are drawn split like the activation they mask.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import spread

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import hf_zoo  # noqa: E402
from redundancy import GRIDS, measure, traced_compute  # noqa: E402

import axonn_jax  # noqa: E402
from axonn_jax import Grid  # noqa: E402


#: every family on two grids of the redundancy table, each grid under four families
FAMILY_GRIDS = spread(hf_zoo.FAMILIES, GRIDS)


@pytest.mark.parametrize("name,grid", FAMILY_GRIDS)
def test_each_device_does_its_share(name, grid):
    """Redundancy ≤ 1.05 and parameter fraction ≤ 1/(x·y·z) + 0.03."""
    grid = Grid.parse(grid)
    entry = hf_zoo.build(name)
    report, pm = traced_compute(entry.model, entry.args, entry.loss, grid)
    assert report.redundancy <= 1.05, (name, grid, report.redundancy, report.repeated(3))
    fraction = pm.plan.param_bytes_per_device / pm.plan.total_param_bytes
    assert fraction <= 1 / (grid.x * grid.y * grid.z) + 0.03, (name, grid, fraction)


@pytest.mark.parametrize("name,grid", FAMILY_GRIDS)
def test_dropout_masks_are_split_like_their_activations(name, grid):
    """Train mode, every dropout probability 0.1: still ≤ 1.05 (the bits follow the activation)."""
    grid = Grid.parse(grid)
    entry = hf_zoo.build(name, dropout=0.1)
    report, pm = traced_compute(entry.model, entry.args, entry.loss, grid, entry.kwargs)
    assert report.redundancy <= 1.05, (name, grid, report.redundancy, report.repeated(3))
    assert not pm.plan.fallbacks, pm.plan.warnings


def test_gpt2_attention_is_head_parallel():
    """After GPT-2's fused qkv is split, the attention core runs on 1/8 of the work per device."""
    grid = Grid(x=2, y=2, z=2)
    entry = hf_zoo.build("hf_gpt2")
    report, pm = traced_compute(entry.model, entry.args, entry.loss, grid)
    plain, split = report.plain, report.per_device
    assert pm.plan.warnings == ()
    matmuls = [k for k in plain.by_line if k.endswith("dot_general")]
    attention = [k for k in matmuls if k.startswith("attention.py")]
    assert attention, matmuls  # flax's dot_product_attention: scores and weighted values
    for key in matmuls:
        assert grid.size * split.by_line[key] <= 1.05 * plain.by_line[key], key


@pytest.mark.parametrize("name", ["hf_wav2vec2", "cnn"])
def test_convolution_kernels_split_eight_ways(name):
    """Every convolution kernel holds 1/(x·y·z) per device: channels over x and y, depth z."""
    from partition_cases import build

    entry = hf_zoo.build(name) if name.startswith("hf_") else build(name)
    pm = axonn_jax.partition(entry.model, Grid(x=2, y=2, z=2), *entry.args)
    kernels = [p for p in pm.plan.params if p.path.endswith("kernel") and len(p.shape) >= 3]
    kernels += [p for p in pm.plan.params if p.path.endswith("weight_v")]
    assert len(kernels) >= 2, [p.path for p in pm.plan.params]
    for p in kernels:
        local = np.prod(p.local_shape(pm.plan.grid))
        assert local * 8 == np.prod(p.shape), (p.path, p.shape, p.storage)


@pytest.mark.slow
@pytest.mark.parametrize("name,dropout", [(n, 0.1) for n in hf_zoo.FAMILIES] + [("hf_gpt2", 0.0)])
def test_loss_and_gradients_equal_the_plain_model(name, dropout):
    """On x=2,y=2,z=2 (every tensor axis): compiled FLOPs ≤ 1.05× and exact numbers
    (train mode with dropout: the plain model's masks, with the same key)."""
    entry = hf_zoo.build(name, dropout=dropout)
    row = measure(name, entry.model, entry.args, entry.loss, "x=2,y=2,z=2", entry.kwargs)
    assert row.max_err <= 1e-5, row
    assert row.redundancy <= 1.05, row


class _StackTile(__import__("flax").linen.Module):
    """Rotary-style ``stack`` of sin and cos and a ``tile``d class token (GPT-J, CLIP)."""

    @__import__("flax").linen.compact
    def __call__(self, x):
        import flax.linen as nn
        import jax.numpy as jnp

        h = nn.Dense(32)(x)
        h = jnp.stack([jnp.sin(h), jnp.cos(h)], axis=1).sum(axis=1)
        token = self.param("cls", nn.initializers.normal(), (1, 1, 32))
        h = jnp.concatenate([jnp.tile(token, (h.shape[0], 1, 1)), h], axis=1)
        return nn.Dense(8)(nn.gelu(h))


@pytest.mark.parametrize("grid", ["x=2,y=2,z=2", "x=4,data=2"])
def test_stack_and_tile_plan_without_fallback_and_exactly(grid):
    """``stack`` and ``tile`` have rules: no replicated fallback, loss and gradients exact."""
    x = np.random.default_rng(0).standard_normal((8, 6, 16)).astype(np.float32)
    row = measure("stack_tile", _StackTile(), (x,), lambda out, _: (out ** 2).mean(), grid)
    assert row.warnings == 0 and row.max_err <= 1e-5, row

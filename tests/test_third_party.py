"""Published Flax models (HuggingFace ``transformers``), unmodified, plan like our own.

Plans only: the inputs are ``jax.ShapeDtypeStruct``s, so nothing is allocated
and no device is touched. The numerical equivalence of these models (loss,
gradients and 5 AdamW steps on the 5 grids) is in ``test_partition.py``
(models ``hf_*`` of ``partition_cases.THIRD_PARTY``).
"""

import re

import jax
import numpy as np
import pytest
from partition_cases import THIRD_PARTY, third_party

import axonn_jax
from axonn_jax import Grid


def _plan(name: str, grid: Grid, layers: int = 2):
    case = third_party(name, layers=layers)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), case.args)
    return axonn_jax.partition(case.model, grid, *specs).plan


@pytest.mark.parametrize("name", THIRD_PARTY)
def test_matmul_weights_are_split_eight_ways(name):
    """Every projection kernel is a 4D layer weight holding 1/8 per device; no fallback."""
    plan = _plan(name, Grid(x=2, y=2, z=2))
    assert plan.warnings == (), plan.warnings
    kernels = [p for p in plan.params if p.path.endswith("kernel")]
    assert len(kernels) >= 8, [p.path for p in plan.params]
    for p in kernels:
        assert p.role in ("normal", "transposed"), (p.path, p.role)
        assert np.prod(p.local_shape(plan.grid)) * 8 == np.prod(p.shape), (p.path, p.storage)
    # the embedding tables are split eight ways too: vocabulary-parallel rows over x, hidden over
    # y, and the depth split (z) on the larger of the two
    tables = [p for p in plan.params if p.path.endswith("embedding") and p.shape[0] >= 8]
    assert tables and all(np.prod(p.local_shape(plan.grid)) * 8 == np.prod(p.shape) for p in tables), [
        (p.path, p.storage) for p in tables]
    # memory: far below a replicated copy (norm scales and biases are split less)
    assert plan.param_bytes_per_device * 5 < plan.total_param_bytes


def test_llama_layers_alternate_normal_and_transposed():
    """Within a block the data flow alternates: q/k/v, gate/up normal; o, down transposed."""
    plan = _plan("hf_llama", Grid(x=2, y=2, z=2))
    roles = {p.path: p.role for p in plan.params if p.path.endswith("kernel")}
    for path, role in roles.items():
        want = "transposed" if re.search(r"(o_proj|down_proj)/kernel$", path) else "normal"
        assert role == want, (path, role)


@pytest.mark.parametrize("pipeline", [2, 4])
def test_gpt2_pipeline_stages_cut_between_blocks(pipeline):
    """4 GPT-2 blocks over 2 or 4 stages: each block's parameters lie in one stage."""
    plan = _plan("hf_gpt2", Grid(pipeline=pipeline, x=2), layers=4)
    assert len(plan.stages) == pipeline
    block_stage = {}
    for stage in plan.stages:
        for path in stage.params:
            found = re.match(r"transformer/h/(\d+)/", path)
            if found:
                assert block_stage.setdefault(found[1], stage.index) == stage.index, path
    blocks_per_stage = 4 // pipeline
    want = {str(b): b // blocks_per_stage for b in range(4)}  # in order, equal shares
    assert block_stage == want, block_stage

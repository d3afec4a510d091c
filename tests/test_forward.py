"""Forward-only passes on pipeline grids: ``pm.apply`` / ``pm.forward`` equal ``model.apply``."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from forward_cases import (batchnorm_forward_failures, dropout_forward_failures, forward_failures,
                           nnx_state_forward_failures)
from partition_cases import build, reference_apply
from rng_cases import NNXNet

import axonn_jax

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,grid,microbatches", [
    ("gpt_linen", dict(pipeline=2, x=2, z=2), 1),   # tied embeddings: a parameter on both stages
    ("gpt_linen", dict(pipeline=2, x=2, z=2), 2),
    ("hf_gpt2", dict(pipeline=2, data=2, y=2), 2),  # outputs: a transformers dataclass
    ("mlp_nnx", dict(pipeline=2, x=4), 1),
])  # fmt: skip
def test_pipelined_forward_equals_plain_apply(name, grid, microbatches, devices):
    failures = forward_failures(name, axonn_jax.Grid(**grid), microbatches)
    assert not failures, failures


def test_pipelined_apply_passes_rng_keys_through(devices):
    """Dropout on: ``rngs=`` is one more call input of stage programs; masks equal the plain model's."""
    failures = dropout_forward_failures(axonn_jax.Grid(pipeline=2, x=2, z=2))
    assert not failures, failures


@pytest.mark.parametrize("microbatches", [1, 2])
def test_pipelined_apply_returns_updated_state(microbatches, devices):
    """``mutable=['batch_stats']``: each stage's new statistics, as model.apply returns them."""
    failures = batchnorm_forward_failures(axonn_jax.Grid(pipeline=2, x=2, z=2), microbatches)
    assert not failures, failures


def test_pipelined_apply_of_nnx_state(devices):
    """nnx state on a pipeline: new statistics and RNG counter; microbatches sharing masks refused."""
    grid = axonn_jax.Grid(pipeline=2, x=4)
    failures = nnx_state_forward_failures(grid)
    assert not failures, failures
    pm = axonn_jax.partition(NNXNet(nnx.Rngs(0, dropout=7)), grid, np.zeros((4, 16), np.float32))
    with pytest.raises(ValueError, match=r"2 microbatches would all use the same dropout masks"):
        pm.forward(pm.init(jax.random.key(0)), np.zeros((8, 16), np.float32), microbatches=2)


def test_pipelined_apply_inside_jit_names_the_remedy(devices):
    case = build("mlp")
    params, _ = reference_apply(case)
    pm = axonn_jax.partition(case.model, axonn_jax.Grid(pipeline=2, x=4), *case.args)
    with pytest.raises(ValueError, match=r"cannot be traced by jax.jit.*outside jax.jit.*pm.train_step"):
        jax.jit(pm.apply)(pm.shard(params), *case.args)


def test_example_evaluates_and_samples_through_the_partitioned_model(devices, tmp_path, monkeypatch):
    """On a pipeline grid the example never gathers the model: forward passes run on the grid."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_gpt

    def no_gather(self, params):
        raise AssertionError("the example gathered the whole model")

    calls = []
    forward = axonn_jax.Partitioned.forward

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("microbatches"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(axonn_jax.Partitioned, "gather", no_gather)
    monkeypatch.setattr(axonn_jax.Partitioned, "forward", counted)
    argv = ["--grid", "pipeline=2,x=2,z=2", "--steps", "2", "--layers", "2", "--hidden", "32",
            "--sample-bytes", "3", "--ckpt-every", "0", "--out", str(tmp_path)]  # fmt: skip
    assert train_gpt.main(argv) == 0
    assert calls.count(1) == 3 and calls.count(4) == 2  # 3 sampled bytes, 2 validation losses

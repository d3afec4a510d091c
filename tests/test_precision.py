"""Precision policies and fp16 dynamic loss scaling.

Unit tests of :class:`LossScale` (skip → halve, growth after the window, bounds),
then an fp16 GPT on x=2, z=2, data=2 (8 simulated CPU devices, masters and
AdamW state offloaded) where one data shard's loss is blown up so that its fp16
gradients overflow: the step must be skipped for every parameter (bitwise
unchanged parameters, masters and optimizer state) and the scale halved; the
following finite steps train and grow the scale after the window. The same
under ``mpiexec -n 2`` with the overflow injected on rank 1 only
(tests/mpi_scripts/loss_scale_overflow.py).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mpi_util import run_mpi
from precision_cases import loss_scaled_step

import axonn_jax
from axonn_jax.models import GPT, GPTConfig
from axonn_jax.runtime.master_optimizer import MasterOptimizer
from axonn_jax.runtime.precision import (
    LossScale,
    Precision,
    all_finite,
    cast_floating,
    combine_finite,
)


def test_precision_policies():
    assert Precision.of(None) == Precision("fp32") and not Precision.of("fp32").half
    bf16, fp16 = Precision.of("bf16"), Precision.of("fp16")
    assert bf16.param_dtype == jnp.bfloat16 and bf16.grad_dtype == jnp.bfloat16
    assert fp16.master_dtype == jnp.float32 and fp16.loss_scaling and not bf16.loss_scaling
    assert bf16.loss_scale().dynamic is False and float(bf16.loss_scale().scale) == 1.0
    tree = {"w": jnp.ones(2), "step": jnp.asarray(3)}
    assert fp16.to_device(tree)["w"].dtype == jnp.float16 and fp16.to_device(tree)["step"].dtype == jnp.int32
    with pytest.raises(ValueError, match="unknown precision 'fp8'.*fp32, bf16, fp16"):
        Precision.of("fp8")


def test_loss_scale_skips_halves_and_grows():
    scale = LossScale.create(2.0**10, growth_interval=3)
    steps = [True, True, False, True, True, True, True]
    seen = []
    for finite in steps:
        scale = jax.jit(LossScale.update)(scale, jnp.asarray(finite))
        seen.append((float(scale.scale), int(scale.good_steps)))
    assert seen == [(1024, 1), (1024, 2), (512, 0), (512, 1), (512, 2), (1024, 0), (1024, 1)]


def test_loss_scale_bounds_and_constant():
    low = LossScale.create(2.0, min_scale=1.0)
    assert float(low.update(False).update(False).scale) == 1.0
    high = LossScale.create(4.0, growth_interval=1, max_scale=8.0)
    assert float(high.update(True).update(True).scale) == 8.0
    constant = LossScale.constant(1.0)
    assert constant.update(False) is constant
    grads = {"w": jnp.full(3, 8.0, jnp.float16)}
    unscaled = LossScale.create(4.0).unscale(grads)
    assert unscaled["w"].dtype == jnp.float32 and float(unscaled["w"][0]) == 2.0
    with pytest.raises(ValueError, match="growth_interval"):
        LossScale.create(growth_interval=0)


def test_all_finite_and_combine():
    assert bool(all_finite({"a": jnp.ones(3), "n": jnp.arange(3)}))
    assert not bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf], jnp.float16)}))
    assert not bool(combine_finite([True, jnp.asarray(False)])) and bool(combine_finite([True, True]))
    assert cast_floating({"a": jnp.ones(2)}, jnp.bfloat16)["a"].dtype == jnp.bfloat16


@pytest.fixture(scope="module")
def fp16_gpt():
    config = GPTConfig(vocab_size=64, num_layers=1, hidden=32, num_heads=4, max_seq_len=16)
    tokens = ((np.arange(8)[:, None] * 3 + np.arange(16)) % 64).astype(np.int32)
    pm = axonn_jax.partition(GPT(config), axonn_jax.Grid(x=2, z=2, data=2), tokens)
    opt = MasterOptimizer(optax.adamw(1e-2), pm.param_shardings, precision="fp16", offload=True)
    params, state = opt.init(pm.init(jax.random.key(0)))
    batch_split = NamedSharding(pm.mesh, P(("data", "z")))

    step = loss_scaled_step(pm, opt)

    def weights(blown_up_rows=()):
        w = np.ones(8, np.float32)
        w[list(blown_up_rows)] = 1e4  # x 2**15 scale: fp16 gradients overflow (max 65504)
        return jax.device_put(w, batch_split)

    return step, params, state, jax.device_put(tokens, batch_split), weights


def test_fp16_overflow_on_one_shard_skips_the_step_everywhere(fp16_gpt):
    step, params, state, tokens, weights = fp16_gpt
    scale = LossScale.create(2.0**15, growth_interval=2)
    before = jax.tree.map(np.asarray, (params, state))
    # rows 6, 7 live on the devices of data=1, z=1 only
    params, state, scale, finite = step(params, state, scale, tokens, weights([6, 7]))
    assert not bool(finite)
    assert (float(scale.scale), int(scale.good_steps)) == (2.0**14, 0)
    after = jax.tree.map(np.asarray, (params, state))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # nothing moved, count included

    for expected in [(2.0**14, 1), (2.0**15, 0)]:  # two good steps: the window, then growth
        params, state, scale, finite = step(params, state, scale, tokens, weights())
        assert bool(finite) and (float(scale.scale), int(scale.good_steps)) == expected
    assert int(state.inner[0].count) == 2
    moved = np.abs(np.asarray(state.master["embed"]["embedding"]) - before[1].master["embed"]["embedding"])
    assert moved.max() > 1e-3


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(660)  # the job's own 600 s timeout fires first
def test_fp16_overflow_on_rank_1_skips_on_both_ranks_under_mpiexec():
    result = run_mpi(2, "loss_scale_overflow.py", devices_per_process=4, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in (0, 1):
        for path in ("global", "local"):
            line = re.search(rf"^RANK {rank} {path} (.*)$", result.stdout, flags=re.M)
            assert line, output[-4000:]
            fields = dict(item.split("=") for item in line.group(1).split())
            assert fields["injected"] == ("yes" if rank == 1 else "no"), line.group(0)
            assert fields["finite"] == "False" and fields["unchanged"] == "True", line.group(0)
            assert fields["scale"] == "16384.0->8192.0", line.group(0)
            assert fields["then"] == "8192.0,16384.0", line.group(0)


@pytest.mark.parametrize("grid", [dict(x=2, z=2, data=2), dict(pipeline=2, x=2, z=2)],
                         ids=lambda g: ",".join(f"{k}={v}" for k, v in g.items()))  # fmt: skip
def test_evaluating_with_the_params_of_a_bf16_step(grid, devices):
    """HF GPT-2: pm.apply takes the bf16 params a precision="bf16" step returns, equal (bit for
    bit) to pm.apply of those params cast to float32 by hand, and to the plain model on them."""
    from partition_cases import third_party

    case = third_party("hf_gpt2")
    pm = axonn_jax.partition(case.model, axonn_jax.Grid(**grid), *case.args)
    step = pm.train_step(lambda out, batch: case.loss(out, *batch), optax.adamw(1e-2), precision="bf16")
    params, opt_state = step.init(pm.init(jax.random.key(0)))
    params, opt_state, _ = step(params, opt_state, case.args)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    logits = np.asarray(pm.apply(params, *case.args).logits)
    cast = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    np.testing.assert_array_equal(logits, np.asarray(pm.apply(cast, *case.args).logits))
    full = jax.tree.map(lambda x: np.asarray(x, np.float32), pm.gather(params))
    plain = np.asarray(case.model.apply({"params": full}, *case.args).logits)
    np.testing.assert_allclose(logits, plain, rtol=1e-4, atol=1e-4 * np.max(np.abs(plain)))


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(660)  # the job's own 600 s timeout fires first
def test_fp16_pipeline_with_one_stage_per_process_trains_as_in_one_process():
    """An fp16 train step on pipeline=2 with each stage on its own process failed on its first
    step: the dynamic loss scale is placed on the last stage's mesh, where rank 0 holds no
    device. Its losses now equal those of the same step in one process."""
    import os
    import subprocess
    import sys

    from mpi_util import TESTS, xla_flags

    result = run_mpi(2, "fp16_pipeline.py", devices_per_process=4, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ranks = dict(re.findall(r"LOSSES rank (\d): ([^\n]+)", result.stdout))
    assert set(ranks) == {"0", "1"} and ranks["0"] == ranks["1"], result.stdout
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    single = subprocess.run([sys.executable, str(TESTS / "mpi_scripts" / "fp16_pipeline.py")], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert single.returncode == 0, single.stderr[-4000:]
    one = [float(v) for v in re.search(r"LOSSES rank 0: ([^\n]+)", single.stdout).group(1).split()]
    np.testing.assert_allclose([float(v) for v in ranks["0"].split()], one, rtol=1e-6)

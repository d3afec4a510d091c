"""Optimizers that combine pipeline stages (global-norm clipping) give the whole-model update.

See ``runtime/stage_update.py``; the numerics and bounds are in ``stage_update_cases.py``.
"""

import jax
import numpy as np
import optax
import pytest
from mpi_util import run_mpi
from pipeline_cases import partitioned
from stage_update_cases import run

import axonn_jax
from axonn_jax.runtime.stage_update import MAX_EXCHANGED_ELEMENTS

GRID = axonn_jax.Grid.parse("pipeline=2,x=2,z=2")


@pytest.mark.parametrize("name", ["clip_adamw", "multisteps_logged", "noisy_sgd", "sm3", "multi_transform_by_key"])
def test_cross_stage_optimizer_equals_plain_optax(name, devices):
    """``noisy_sgd`` ran per stage, each stage splitting the key by its own leaves: the second
    stage's leaves got the first stage's noise; it now runs from the whole-model trace.
    ``sm3`` failed to build (its state per parameter is a list: no mirror of the params);
    so did a ``multi_transform`` whose label function reads the parameters' keys."""
    failures = run(GRID, name)
    assert not failures, "\n".join(failures)


def test_an_init_that_reads_several_stages_is_refused(gpt_two_stages):
    """``optax.contrib.dog``'s default first step is a norm of every parameter; each stage
    initialised its state from its own (silently another first step than plain optax's)."""
    case, pm, params = gpt_two_stages
    with pytest.raises(ValueError, match=r"its init combines parameters of several pipeline stages.*"
                                         r"Remedy: an init that reads each parameter alone"):
        pm.train_step(case.loss, optax.contrib.dog(), inputs=case.inputs).init(params)
    step = pm.train_step(case.loss, optax.contrib.dog(init_step=("learning_rate", 1e-3)), inputs=case.inputs)
    step.init(params)  # the remedy: an init of each parameter alone


def test_an_init_that_cannot_take_a_stage_s_holes_is_refused(gpt_two_stages):
    """``optax.contrib.galore``'s init reads every leaf, the ``None`` of other stages included
    (optax's own map over them); it failed with ``'NoneType' object has no attribute 'dtype'``."""
    case, pm, params = gpt_two_stages
    with pytest.raises(ValueError, match=r"cannot initialise the state of pipeline stage 0 .*holds None"):
        pm.train_step(case.loss, optax.contrib.galore(1e-2), inputs=case.inputs).init(params)


@pytest.fixture(scope="module")
def gpt_two_stages(devices):
    case, pm = partitioned("gpt", GRID)
    return case, pm, pm.init(jax.random.key(0))


def test_leaf_wise_optimizer_keeps_per_stage_updates(gpt_two_stages):
    case, pm, params = gpt_two_stages
    step = pm.train_step(case.loss, optax.MultiSteps(optax.adamw(1e-3), 2), inputs=case.inputs)
    assert step.across_stages is None
    clipped = pm.train_step(case.loss, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)),
                            inputs=case.inputs)  # fmt: skip
    assert clipped.across_stages is not None and clipped.across_stages.rounds > 1


def _normalize_flat() -> optax.GradientTransformation:
    """Mixes whole leaves: every update is divided by the flattened vector's norm."""

    def update(updates, state, params=None):
        flat, unravel = jax.flatten_util.ravel_pytree(updates)
        return unravel(flat / np.float32(2.0) + flat[::-1]), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_mixing_whole_parameters_is_refused(gpt_two_stages):
    import jax.flatten_util  # noqa: F401

    case, pm, params = gpt_two_stages
    step = pm.train_step(case.loss, _normalize_flat(), inputs=case.inputs)
    with pytest.raises(ValueError) as err:
        step.init(params)
    message = str(err.value)
    assert "combines the parameters of pipeline stages [0, 1]" in message
    assert "`concatenate`" in message and "test_stage_update.py" in message  # the source line
    assert f"at most {MAX_EXCHANGED_ELEMENTS} elements" in message and "Remedy:" in message


def test_offload_refuses_a_cross_stage_optimizer(gpt_two_stages):
    case, pm, params = gpt_two_stages
    step = pm.train_step(case.loss, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
                         inputs=case.inputs, offload=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"offload=True cannot do exactly .*Remedy: offload=False"):
        step.init(params)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(660)  # the job's own 600 s timeout fires first
def test_cross_stage_optimizer_under_mpiexec():
    """Both cross-stage optimizers in one launch (one mpiexec and jax.distributed start)."""
    names = ["clip_adamw", "multisteps_logged"]
    result = run_mpi(2, "stage_update_equivalence.py", "pipeline=2", *names, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    # the ranks' lines may interleave in mpiexec's merged stdout: count, do not split
    assert result.stdout.count("OK rank") == 2 * len(names), result.stdout
    for name in names:
        assert result.stdout.count(f" {name} Grid(") == 2, (name, result.stdout)

"""axonn_jax.partition equals the plain single-device Flax/optax computation.

For every model of the repo (linen and nnx) on two grids each (every grid of
the table under several models: conftest.spread), on 8 simulated CPU devices,
in fp32:

* loss of every step: |Δ| ≤ 1e-5·|ref|;
* gradients of step 1, per leaf: max|Δ| ≤ 1e-5·max|ref leaf| + 1e-6·G, where G
  is the largest gradient entry of the model (an absolute floor for leaves whose
  true gradient is 0, e.g. an attention key bias, where both sides are rounding
  noise);
* parameters after 5 AdamW steps, per leaf: ‖Δ‖₂ ≤ 1e-3·‖p_ref − p₀‖₂ (the
  difference relative to the distance the reference travelled: Adam divides
  each element's gradient by its own magnitude, so elements whose gradient is
  at the rounding floor move by up to lr either way and a max-abs bound would
  measure that noise, not the partitioning). For leaves whose true gradient
  is 0 (|ref grad| ≤ 1e-6·G) every step is noise, so the bound is Adam's step
  bound: max|Δ| ≤ 2·5·lr.
"""

import numpy as np
import pytest
from conftest import grid_id, spread
from partition_cases import BATCH_MIXING, DATA_Z_GRIDS, GRIDS, MODELS, assert_matches_reference, trajectories


#: every model on two of the 5 grids the README quotes, each grid under four models
CASES = spread(MODELS, GRIDS)
#: the second grid of each model trains with pm.value_and_grad / pm.train_step (the loss
#: planned with the model), the first with pm.apply in a user's jitted step
THROUGH_TRAIN_STEP = CASES[1::2]


@pytest.mark.parametrize("model,grid", CASES, ids=lambda v: grid_id(v) if isinstance(v, dict) else v)
def test_train_steps_match_unpartitioned(model, grid, devices):
    planned = (model, grid) in THROUGH_TRAIN_STEP
    result = trajectories(model, grid, train_step=planned)
    assert_matches_reference(result, f"{model} {grid}" + (" (pm.train_step)" if planned else ""))
    if planned:  # the loss ran inside the planned program, not after gathered outputs
        assert result["notes"] == {}, result["notes"]


@pytest.mark.parametrize("model,grid", spread(BATCH_MIXING, DATA_Z_GRIDS),
                         ids=lambda v: grid_id(v) if isinstance(v, dict) else v)  # fmt: skip
def test_models_that_mix_batch_rows_match_on_the_data_z_grids(model, grid, devices):
    """cumsum, sort and normalisation over the batch dim: the batch is split over data and z
    together, so a relayout that put the blocks back in another order would be caught."""
    assert_matches_reference(trajectories(model, grid), f"{model} {grid}")


@pytest.mark.parametrize("model", ["gpt_linen", "mlp"])
def test_weights_are_split_eight_ways(model, devices):
    """With x·y·z = 8 each device holds 1/8 of every matmul weight."""
    result = trajectories(model, dict(x=2, y=2, z=2))
    plan = result["pm"].plan
    matmul = [p for p in plan.params if p.role in ("normal", "transposed")]
    assert matmul
    for p in matmul:
        assert np.prod(p.local_shape(plan.grid)) * 8 == np.prod(p.shape), (p.path, p.storage)

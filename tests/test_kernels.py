"""The 4D kernels equal the unsharded Flax computation on every 8-device grid.

Bound (fp32): for outputs and every gradient, max|4D − ref| ≤ 1e-6 · max|ref|;
for the scalar loss (a cancelling sum), |Δ| ≤ 1e-6 · Σ|terms|. Measured worst
case is ~4e-7, i.e. a few ulps of the largest entry.
"""

import pytest
from conftest import grid_id, grids_of
from kernel_cases import CASES, max_scaled_error, run_case

from axonn_jax import Grid

TOLERANCE = 1e-6


@pytest.mark.parametrize("grid", grids_of(8), ids=grid_id)
@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_and_gradients_match_unsharded(case, grid, devices):
    reference, sharded = run_case(case, Grid(**grid))
    assert set(sharded) == set(reference) - {"loss_terms"}
    errors = max_scaled_error(reference, sharded)
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"{case} on {grid}: scaled errors above {TOLERANCE}: {bad}"


def test_mis_sharded_bias_is_rejected(devices, monkeypatch):
    """A bias sharded on the wrong axis is caught by shard_map's replication typing.

    down's output features live on y; a bias sharded over x would make the
    output vary over x, which its out_spec forbids. This guards the claim that
    the kernels' layouts are checked, not silently mis-computed.
    """
    import kernel_cases
    from jax.sharding import PartitionSpec as P

    module, fn, specs_fn, *rest = CASES["mlp"]

    def wrong_specs():
        specs = specs_fn()
        specs["down"]["bias"] = P("x")
        return specs

    monkeypatch.setitem(kernel_cases.CASES, "mlp", (module, fn, wrong_specs, *rest))
    with pytest.raises(ValueError, match="replicated across mesh axis 'x'"):
        run_case("mlp", Grid(x=2, y=2, z=2))

"""The sharded loader: every device holds exactly its rows of the single-device batch.

Exact equality throughout (integer tokens).
"""

import jax
import numpy as np
import pytest
from conftest import grid_id

from axonn_jax import Grid
from axonn_jax.runtime.mesh import stage_meshes
from axonn_jax.corpus import batch_at
from axonn_jax.loader import Loader

GRIDS = [
    dict(x=2, y=2, z=2),
    dict(z=4, data=2),
    dict(data=8),
    dict(x=8),
    dict(y=2, z=2, data=2),
    dict(x=2, z=4),
]
BATCH, SEQ, SEED = 16, 12, 7


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 256, size=5_000).astype(np.uint8)


def _mesh(grid: dict):
    return stage_meshes(Grid(**grid))[0]


def _expected_rows(mesh, device, rows_total: int) -> slice:
    """Rows of the batch that ``device`` must hold: block (data, z) of data·z blocks."""
    (coords,) = np.argwhere(mesh.devices == device)
    at = dict(zip(mesh.axis_names, coords))
    shards = mesh.shape["data"] * mesh.shape["z"]
    block = at["data"] * mesh.shape["z"] + at["z"]
    size = rows_total // shards
    return slice(block * size, (block + 1) * size)


@pytest.mark.parametrize("grid", GRIDS, ids=grid_id)
def test_each_device_holds_its_rows_of_the_single_device_batch(devices, tokens, grid):
    mesh = _mesh(grid)
    loader = Loader(tokens, batch=BATCH, seq=SEQ, mesh=mesh, seed=SEED)
    for step in range(2):
        array = next(loader)
        reference = batch_at(tokens, step=step, batch=BATCH, seq=SEQ, seed=SEED)
        assert array.shape == reference.shape and array.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(array), reference)
        for shard in array.addressable_shards:
            rows = _expected_rows(mesh, shard.device, BATCH)
            np.testing.assert_array_equal(np.asarray(shard.data), reference[rows])
    assert loader.step == 2


@pytest.mark.parametrize("grid", [dict(z=4, data=2), dict(x=2, y=2, z=2)], ids=grid_id)
def test_microbatches_split_the_global_batch_in_order(devices, tokens, grid):
    mesh, m = _mesh(grid), 2
    loader = Loader(tokens, batch=BATCH, seq=SEQ, mesh=mesh, seed=SEED, microbatches=m)
    array = loader.at(3)
    reference = batch_at(tokens, step=3, batch=BATCH, seq=SEQ, seed=SEED)
    assert array.shape == (m, BATCH // m, SEQ + 1)
    np.testing.assert_array_equal(np.asarray(array), reference.reshape(m, BATCH // m, SEQ + 1))
    for shard in array.addressable_shards:
        rows = _expected_rows(mesh, shard.device, BATCH // m)
        expected = reference.reshape(m, BATCH // m, SEQ + 1)[:, rows]
        np.testing.assert_array_equal(np.asarray(shard.data), expected)


def test_resuming_from_state_continues_the_same_sequence(devices, tokens):
    mesh = _mesh(dict(z=4, data=2))
    uninterrupted = Loader(tokens, batch=BATCH, seq=SEQ, mesh=mesh, seed=SEED)
    expected = [np.asarray(next(uninterrupted)) for _ in range(5)]

    first = Loader(tokens, batch=BATCH, seq=SEQ, mesh=mesh, seed=SEED)
    got = [np.asarray(next(first)) for _ in range(2)]
    state = first.state()
    assert state["step"] == 2
    resumed = Loader.from_state(tokens, state, mesh=_mesh(dict(data=8)))  # any grid
    got += [np.asarray(next(resumed)) for _ in range(3)]
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(expected[0], expected[1])  # steps really differ


def test_different_seeds_give_different_batches(devices, tokens):
    mesh = _mesh(dict(data=8))
    a = Loader(tokens, batch=BATCH, seq=SEQ, mesh=mesh, seed=0).at(0)
    b = Loader(tokens, batch=BATCH, seq=SEQ, mesh=mesh, seed=1).at(0)
    assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_errors_name_the_problem_and_remedy(devices, tokens):
    mesh = _mesh(dict(z=4, data=2))
    with pytest.raises(ValueError, match=r"batch 12 is not divisible by microbatches × data × z"):
        Loader(tokens, batch=12, seq=SEQ, mesh=mesh)
    with pytest.raises(ValueError, match=r"multiple of 16"):
        Loader(tokens, batch=8, seq=SEQ, mesh=mesh, microbatches=2)
    with pytest.raises(ValueError, match=r"lack \['z'\]"):
        Loader(tokens, batch=8, seq=SEQ, mesh=jax.sharding.Mesh(np.array(devices), ("data",)))
    with pytest.raises(ValueError, match="too short"):
        Loader(tokens[:10], batch=8, seq=SEQ, mesh=mesh)
    with pytest.raises(ValueError, match="1-D integer"):
        Loader(tokens.astype(np.float32), batch=8, seq=SEQ, mesh=mesh)
    state = Loader(tokens, batch=8, seq=SEQ, mesh=mesh).state()
    with pytest.raises(ValueError, match="corpus of 5000 tokens"):
        Loader.from_state(tokens[:-1], state, mesh=mesh)
    with pytest.raises(ValueError, match=r"lacks \['seed'\]"):
        Loader.from_state(tokens, {k: v for k, v in state.items() if k != "seed"}, mesh=mesh)

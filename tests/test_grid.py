"""Grid: validation, parsing, meshes."""

import pytest

import axonn_jax
from axonn_jax import Grid
from axonn_jax.partitioner.grid import MESH_AXES, STAGE_AXES


def test_sizes_and_shape():
    grid = Grid(x=2, y=1, z=2, data=2, pipeline=1)
    assert grid.size == 8 and grid.tensor_size == 4 and grid.batch_shards == 4
    assert list(grid.shape) == list(MESH_AXES)
    assert list(grid.stage_shape) == list(STAGE_AXES)


def test_immutable_and_hashable():
    grid = Grid(x=2)
    with pytest.raises(AttributeError):
        grid.x = 4  # type: ignore[misc]
    assert {grid: 1}[Grid(x=2)] == 1


@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_sizes_rejected(bad):
    with pytest.raises(ValueError, match=r"Grid\.z must be >= 1, got .*use 1 to switch"):
        Grid(z=bad)


@pytest.mark.parametrize("bad", [2.0, "2", True, None])
def test_non_int_sizes_rejected(bad):
    with pytest.raises(TypeError, match=r"Grid\.x must be a positive int"):
        Grid(x=bad)


def test_parse():
    assert Grid.parse("pipeline=2,x=2,z=2") == Grid(x=2, z=2, pipeline=2)
    assert Grid.parse({"data": 4}) == Grid(data=4)
    assert Grid.parse("") == Grid()
    with pytest.raises(ValueError, match="expected AXIS=SIZE"):
        Grid.parse("w=2")
    with pytest.raises(ValueError, match="given twice"):
        Grid.parse("x=2,x=4")
    with pytest.raises(ValueError, match="positive integers"):
        Grid.parse("x=two")


def test_wrong_device_count_names_sizes_and_remedy(devices):
    with pytest.raises(ValueError) as err:
        axonn_jax.build_mesh(Grid(x=2, y=2))
    text = str(err.value)
    assert "needs 4 devices" in text and "8 are available" in text
    assert "Remedy" in text and "product is 8" in text


def test_indivisible_dimension_error_names_dim_axis_and_remedy():
    with pytest.raises(ValueError) as err:
        Grid(x=4, z=2).check_divides("params/mlp/up/kernel dim 1", 6, ("x",))
    text = str(err.value)
    assert "params/mlp/up/kernel dim 1 has size 6" in text
    assert "x=4" in text and "Remedy" in text


def test_meshes(devices):
    grid = Grid(x=2, z=2, pipeline=2)
    mesh = axonn_jax.build_mesh(grid)
    assert mesh.axis_names == MESH_AXES
    assert mesh.devices.shape == (2, 1, 2, 1, 2)
    stages = axonn_jax.stage_meshes(grid)
    assert len(stages) == 2
    assert all(m.axis_names == STAGE_AXES for m in stages)
    # stages own disjoint, contiguous blocks of devices; x varies fastest
    ids = [[d.id for d in m.devices.flat] for m in stages]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_rank_to_stage_and_position(devices):
    from axonn_jax.runtime.mesh import device_coordinates, local_stages

    grid = Grid(x=2, z=2, pipeline=2)
    coords = device_coordinates(grid)
    assert coords[devices[0]] == dict(pipeline=0, data=0, z=0, y=0, x=0)
    assert coords[devices[5]] == dict(pipeline=1, data=0, z=0, y=0, x=1)
    assert coords[devices[6]] == dict(pipeline=1, data=0, z=1, y=0, x=0)
    assert local_stages(axonn_jax.stage_meshes(grid)) == [0, 1]  # one process owns both stages

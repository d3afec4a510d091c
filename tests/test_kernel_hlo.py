"""The compiled forward+backward of one 4D layer contains exactly §1's collectives.

For every 8-device grid and both layer variants, the non-trivial collectives of
``jit(value_and_grad(loss))`` (groups larger than one device; scalar loss
reductions, which come from the user's loss outside the layer, excluded) are:

  forward   all-gather z of W          [k/in, n/out]
            all-reduce over in-axis    [m/(data·z), n/out]
  backward  all-reduce over out-axis   [m/(data·z), k/in]     (dI)
            reduce-scatter z of dW     [k/(in·z), n/out]
            all-reduce data of dW      [k/(in·z), n/out]

where (in, out) = (y, x) for a normal layer and (x, y) for a transposed one.
"""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import grid_id, grids_of
from jax.sharding import NamedSharding

from axonn_jax import Grid
from axonn_jax.runtime.mesh import stage_meshes
from axonn_jax.partitioner.grid import DATA, STAGE_AXES, Z
from kernel_specs import activation_spec, layer_axes, weight_spec
import kernels4d as K
from axonn_jax.runtime.hlo import collectives, mesh_axis_groups

M, K_DIM, N = 16, 32, 64


def compiled_layer(grid: Grid, transposed: bool):
    mesh = stage_meshes(grid)[0]
    in_axis, out_axis = layer_axes(transposed)
    in_spec, out_spec = activation_spec(2, {-1: in_axis}), activation_spec(2, {-1: out_axis})
    w_spec = weight_spec(2, transposed=transposed)
    layer = jax.shard_map(
        lambda a, w: K.linear(a, w, transposed=transposed),
        mesh=mesh,
        in_specs=(in_spec, w_spec),
        out_specs=out_spec,
    )
    probe = jax.device_put(jnp.ones((M, N)), NamedSharding(mesh, out_spec))

    def loss(a, w):
        return jnp.sum(jnp.tanh(layer(a, w)) * probe)

    a = jax.device_put(jnp.ones((M, K_DIM)), NamedSharding(mesh, in_spec))
    w = jax.device_put(jnp.ones((K_DIM, N)), NamedSharding(mesh, w_spec))
    return mesh, jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(a, w).compile()


def expected_collectives(grid: Grid, transposed: bool, mesh) -> Counter:
    in_axis, out_axis = layer_axes(transposed)
    size = grid.axis_size
    rows = M // (grid.data * grid.z)
    k_in, n_out = K_DIM // size(in_axis), N // size(out_axis)
    ids = np.arange(mesh.size).reshape(mesh.devices.shape)
    wanted = [
        ("all-gather", (k_in, n_out), Z),
        ("all-reduce", (rows, n_out), in_axis),
        ("all-reduce", (rows, k_in), out_axis),
        ("reduce-scatter", (k_in // grid.z, n_out), Z),
        ("all-reduce", (k_in // grid.z, n_out), DATA),
    ]
    return Counter(
        (kind, shape, mesh_axis_groups(ids, STAGE_AXES, axis))
        for kind, shape, axis in wanted
        if size(axis) > 1
    )


def found_collectives(compiled) -> Counter:
    found = Counter()
    for op in collectives(compiled.as_text()):
        if op.trivial:
            continue
        for dtype, shape in op.shapes:
            if shape == ():  # the scalar loss reduction of the user's jnp.sum
                continue
            assert dtype == "f32"
            found[(op.kind, shape, frozenset(frozenset(g) for g in op.groups))] += 1
    return found


@pytest.mark.parametrize("transposed", [False, True], ids=["normal", "transposed"])
@pytest.mark.parametrize("grid", grids_of(8), ids=grid_id)
def test_layer_collectives_are_exactly_the_algorithm(grid, transposed, devices):
    grid = Grid(**grid)
    mesh, compiled = compiled_layer(grid, transposed)
    assert found_collectives(compiled) == expected_collectives(grid, transposed, mesh)


def test_wire_bytes_follow_ring_formulas():
    """Hand-made HLO lines: bytes per device for each collective kind."""
    line = "%a = f32[8,16]{1,0} KIND(%p), replica_groups={{0,1,2,3}}, to_apply=%r"
    size = 8 * 16 * 4
    expect = {
        "all-gather": 3 / 4 * size,
        "all-reduce": 2 * 3 / 4 * size,
        "reduce-scatter": 3 * size,
        "all-to-all": 3 / 4 * size,
    }
    for kind, value in expect.items():
        (op,) = collectives(line.replace("KIND", kind))
        assert op.group_size == 4 and op.wire_bytes == pytest.approx(value)


def test_replica_group_syntaxes():
    iota = "%a = f32[2]{0} all-reduce(%p), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%r"
    assert collectives(iota)[0].groups == ((0, 2), (1, 3))
    mesh = (
        "%a = (f32[], f32[4]{0}) all-reduce(%p, %q), "
        "replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], "
        "device_ids=([2,2,2]T(0,2,1)) {'axis_1'}, use_global_device_ids=true, to_apply=%r"
    )
    (op,) = collectives(mesh)
    assert op.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert op.shapes == (("f32", ()), ("f32", (4,)))
    plain = "%a = f32[4]{0} all-reduce(%p), replica_groups=mesh['a'=2,'b'=4] {'a'}, to_apply=%r"
    assert collectives(plain)[0].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    explicit = "%a = f32[4]{0} all-gather(%p), replica_groups={}, dimensions={0}"
    assert collectives(explicit, num_devices=4)[0].groups == ((0, 1, 2, 3),)

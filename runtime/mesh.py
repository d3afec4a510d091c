"""Device meshes for a :class:`~axonn_jax.Grid`.

Devices are ordered by ``(process_index, id)`` and laid out row-major over
``(pipeline, data, z, y, x)``, so the innermost axes (``x``, then ``y``) stay on
one host whenever they fit, as the AxoNN hierarchy wants, and each pipeline
stage owns a contiguous block of processes.

Example:
    >>> import jax
    >>> from axonn_jax.partitioner.grid import Grid
    >>> mesh = build_mesh(Grid(x=2, z=2, data=2))       # doctest: +SKIP
    >>> mesh.axis_names
    ('pipeline', 'data', 'z', 'y', 'x')
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from axonn_jax.partitioner.grid import MESH_AXES, STAGE_AXES, Grid


def ordered_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """All devices (of every process, after :func:`axonn_jax.init`) in grid order."""
    if devices is None:
        from axonn_jax.runtime.launch import init

        init()
        devices = jax.devices()
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def device_array(grid: Grid, devices: Sequence[jax.Device] | None = None) -> np.ndarray:
    """Devices as an array of shape ``(pipeline, data, z, y, x)``."""
    if devices is None:
        from axonn_jax.runtime.launch import init

        init(grid=grid)  # joins the job; checks the grid against the CPU collectives chosen
    devs = ordered_devices(devices)
    grid.check_devices(len(devs))
    shape = tuple(grid.shape.values())
    return np.asarray(devs, dtype=object).reshape(shape)


def build_mesh(grid: Grid, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The full 5D mesh ``(pipeline, data, z, y, x)``."""
    return Mesh(device_array(grid, devices), MESH_AXES)


def stage_meshes(grid: Grid, devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
    """One 4D mesh ``(data, z, y, x)`` per pipeline stage, stage 0 first.

    With virtual stages (``grid.virtual = v``) there are ``pipeline·v`` stages
    and stage ``s`` runs on the mesh of pipeline rank ``grid.pipeline_rank(s)``
    (``s mod pipeline`` interleaved): the
    same :class:`Mesh` object for stages ``s, s+p, s+2p, …``, so their
    parameters, messages and tasks share its devices (and its dispatch lane).

    Example: ``stage_meshes(Grid(pipeline=2, virtual=2))`` is ``[m0, m1, m0, m1]``;
    with the V-shaped placement (``placement="v"``) stage ``s`` follows
    :meth:`Grid.pipeline_rank <axonn_jax.partitioner.grid.Grid.pipeline_rank>`:
    ``[m0, m1, m1, m0]``.
    """
    array = device_array(grid, devices)
    ranks = [Mesh(array[r], STAGE_AXES) for r in range(grid.pipeline)]
    return [ranks[grid.pipeline_rank(s)] for s in range(grid.stages)]


def stages_stay_in_processes(grid: Grid, devices_per_process: int, process_count: int) -> bool:
    """Whether each pipeline rank's devices all belong to one process.

    Devices are ordered by process, so pipeline rank ``r`` holds the
    ``grid.stage_size`` devices from ``r·stage_size`` on; such a grid runs no XLA
    collective across processes (messages between stages go over MPI).

    Example: ``Grid(pipeline=2, x=2, z=2)`` on 2 processes of 4 devices: True; on
    4 processes of 2 devices: False (each stage spans two processes).
    """
    if devices_per_process * process_count != grid.size:
        return False
    size = grid.stage_size
    return all(r * size // devices_per_process == ((r + 1) * size - 1) // devices_per_process
               for r in range(grid.pipeline))  # fmt: skip


def local_stages(meshes: Sequence[Mesh]) -> list[int]:
    """Indices of the stages that have at least one device on this process."""
    here = jax.process_index()
    return [
        s
        for s, mesh in enumerate(meshes)
        if any(d.process_index == here for d in mesh.devices.flat)
    ]


def device_coordinates(grid: Grid, devices: Sequence[jax.Device] | None = None) -> dict:
    """Map each device to its grid coordinates ``{axis: index}``.

    Example: ``device_coordinates(Grid(x=2, data=4))[dev] == {'pipeline': 0,
    'data': 1, 'z': 0, 'y': 0, 'x': 1}``.
    """
    array = device_array(grid, devices)
    coords = {}
    for index in np.ndindex(array.shape):
        coords[array[index]] = dict(zip(MESH_AXES, index))
    return coords

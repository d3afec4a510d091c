"""The one ``shard_map`` around planned code: layouts in, layouts out, manual over live axes.

Axes of size 1 are logical only (they carry the normal/transposed alternation
but move nothing): specs and collectives name the other axes alone, and with
no such axis (one device) the body runs as it is, without ``shard_map``.
Otherwise ``shard_map`` is manual over *every* mesh axis, size-1 axes included:
manual over only some, JAX puts a sharding annotation into the body of every
reduction, and XLA:CPU's promotion of bf16 all-reduces / reduce-scatters to
fp32 aborts the process on such a body ("Invalid binary instruction opcode
copy", tests/test_bf16_compute.py). Every program that runs the 4D executor —
``pm.apply``, the pipeline's stage programs, the NaN finder's probed stages —
goes through :func:`on_mesh`.

Example:
    >>> body = on_mesh(lambda ps, xs: executor(ps, xs), mesh, grid,        # doctest: +SKIP
    ...                in_layouts=([p.storage for p in plan.params], arg_layouts),
    ...                out_layouts=[output_layouts])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner.grid import BATCH_AXES, Grid
from axonn_jax.partitioner.layout import Layout, live, to_spec
from axonn_jax.partitioner.program import Program
from axonn_jax.runtime.executor import Executor
from axonn_jax.runtime.overlap import Overlap

#: a positional argument's layouts: a list (one Layout per array) or one Layout
LayoutGroup = Sequence[Layout] | Layout


def spec(layout: Layout, grid: Grid) -> jax.sharding.PartitionSpec:
    """The PartitionSpec of ``layout`` over the live (size > 1) axes of ``grid``."""
    return to_spec(live(layout, grid))


def sharding(mesh, grid: Grid, layout: Layout) -> NamedSharding:
    """Where a global array laid out as ``layout`` lives on ``mesh``."""
    return NamedSharding(mesh, spec(layout, grid))


def manual_axes(mesh, grid: Grid) -> frozenset[str]:
    """The mesh axes that move data: those of size > 1 in ``grid`` (collectives name these)."""
    return frozenset(a for a in mesh.axis_names if grid.axis_size(a) > 1)


def _specs(group: LayoutGroup, grid: Grid):
    if isinstance(group, list):
        return [spec(layout, grid) for layout in group]
    return spec(group, grid)


def on_mesh(body: Callable, mesh, grid: Grid, *, in_layouts: Sequence[LayoutGroup],
            out_layouts: list[Layout] | tuple[LayoutGroup, ...]) -> Callable:  # fmt: skip
    """``body`` (a function of local shards) as a function of global arrays on ``mesh``.

    ``in_layouts`` has one entry per positional argument of ``body``: a *list*
    of Layouts for a list of arrays, or one Layout (a tuple) for one array.
    ``out_layouts`` is a list of Layouts for a list result, or a tuple of such
    entries for a tuple result.
    """
    manual = manual_axes(mesh, grid)
    if not manual:  # one device: nothing to communicate, no shard_map needed
        return body
    if isinstance(out_layouts, list):
        out_specs = _specs(out_layouts, grid)
    else:
        out_specs = tuple(_specs(g, grid) for g in out_layouts)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(_specs(g, grid) for g in in_layouts),
                           out_specs=out_specs)  # fmt: skip
    return functools.wraps(body)(lambda *args: _under(mesh, mapped, args))


def _under(mesh, fn: Callable, args: tuple):
    """``fn(*args)`` with ``mesh`` the context mesh where the caller set another one
    (``jax.set_mesh``: ``shard_map`` refuses a mesh other than the context's)."""
    context = jax.sharding.get_abstract_mesh()
    own = getattr(mesh, "abstract_mesh", mesh)
    if context.empty or context == own:
        return fn(*args)
    if context.size != own.size:
        raise ValueError(
            f"the model runs on its grid's mesh ({dict(own.shape)}), inside a jax.set_mesh context of "
            f"another size ({dict(context.shape)}), which JAX does not let a jitted call leave. Remedy: "
            "call pm.apply (and jit the step that calls it) outside `with jax.set_mesh(...)`.")  # fmt: skip
    with jax.sharding.use_abstract_mesh(own):
        return fn(*args)


def apply_program(program: Program, mesh, params: Sequence[jax.Array], args: Sequence[jax.Array],
                  *, overlap: Overlap = Overlap()) -> list:  # fmt: skip
    """The model's output leaves: ``program`` on ``mesh`` (a Mesh or an AbstractMesh), traced inline.

    For tracing inside a caller's transformation (step reports); to run it,
    use :func:`program_function`.
    """
    return _program_body(program, mesh, overlap)(list(params), list(args))


def program_function(program: Program, mesh, *, overlap: Overlap = Overlap()) -> Callable:
    """``(param leaves, arg leaves) → output leaves``: ``program`` on ``mesh``, jitted.

    Under the caller's ``jax.jit`` it is one nested call that XLA inlines;
    called eagerly (or under an eager ``jax.grad``) it compiles once per input
    signature, since an eager ``shard_map`` cannot run the executor's
    custom-VJP collectives. Keep the returned function to reuse its compilation.
    """
    return jax.jit(_program_body(program, mesh, overlap))


def _program_body(program: Program, mesh, overlap: Overlap) -> Callable:
    executor = Executor(program, overlap=overlap)
    return on_mesh(lambda ps, xs: executor(ps, xs), mesh, program.grid,
                   in_layouts=[list(program.param_storage), list(program.arg_layouts)],
                   out_layouts=list(program.output_layouts))  # fmt: skip


def place(value: Any, sharding: NamedSharding) -> jax.Array:
    """Put a host or device array onto ``sharding`` (only this process's shards).

    A device array already laid out so is returned as it is, also where its spec is
    written otherwise (axes of size 1: the same layout; re-placing every leaf of a
    step cost ~10 ms), and so is a tracer (inside ``jax.jit`` the program places it).
    On a mesh of other processes only, the result holds no shard here (a value every
    process passes, such as fp16's loss scale for the last pipeline stage).
    """
    if isinstance(value, jax.core.Tracer):
        return value
    if not sharding.addressable_devices:  # a mesh of other processes only: no shard lives here
        dtype = np.result_type(value)  # (JAX asks a replicated callback once anyway: a view, never kept)
        return jax.make_array_from_callback(np.shape(value), sharding,
                                            lambda index: np.broadcast_to(np.zeros((), dtype), np.shape(value))[index],
                                            dtype=dtype)  # fmt: skip
    if isinstance(value, jax.Array):
        if value.sharding == sharding or value.sharding.is_equivalent_to(sharding, value.ndim):
            return value
        return jax.device_put(value, sharding)
    array = np.asarray(value)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def replicate(values: Sequence[jax.Array], mesh) -> list[jax.Array]:
    """``values`` (arrays on ``mesh``) replicated over it: a collective, so it also gathers
    shards of other processes, where ``device_put`` cannot.

    One compiled program per (mesh, count, layouts): a ``jax.jit`` of a new lambda
    on every call would trace and compile again each time.
    """
    return _replicator(mesh, len(values))(list(values))


@functools.lru_cache(maxsize=64)
def _replicator(mesh, count: int) -> Callable:
    return jax.jit(_identity, out_shardings=[NamedSharding(mesh, P())] * count)


def _identity(values):
    return values


def onto_mesh(tree, mesh, grid: Grid):
    """``tree`` with its device arrays committed elsewhere than ``mesh`` (to one device, or to
    another mesh, its devices in another order included) moved onto it, dim 0 over the batch
    axes where it divides (:func:`batch_sharding`); host arrays, tracers, uncommitted arrays
    and arrays on ``mesh`` stay (``jax.jit`` takes those as they are).

    Example:
        >>> batch = onto_mesh(jax.device_put(batch, jax.devices()[3]), pm.mesh, pm.grid)  # doctest: +SKIP
    """
    def elsewhere(x) -> bool:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.committed:
            return False
        return not (isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh)

    def one(x):
        return place(x, batch_sharding(mesh, grid, x.shape)) if elsewhere(x) else x

    return jax.tree.map(one, tree)


def batch_sharding(mesh, grid: Grid, shape: Sequence[int]) -> NamedSharding:
    """Dim 0 over the live batch axes (data, z) when it divides, else replicated."""
    axes = tuple(a for a in BATCH_AXES if grid.axis_size(a) > 1)
    parts = int(np.prod([grid.axis_size(a) for a in axes])) if axes else 1
    if shape and axes and shape[0] % parts == 0:
        return NamedSharding(mesh, P(axes))
    return NamedSharding(mesh, P())

"""The 4D (+ pipeline) process grid.

A :class:`Grid` names how many devices each parallel dimension uses. It is pure
configuration: building one needs no devices, so the partitioner can plan for
1,024 GPUs on a laptop. Meshes are built from it by :mod:`axonn_jax.runtime.mesh`
(``axonn_jax.build_mesh(grid)``, ``axonn_jax.stage_meshes(grid)``).

Hierarchy, innermost (fastest links) to outermost: ``x``, ``y``, ``z``, ``data``,
``pipeline``. In a JAX mesh the last axis varies fastest, so the mesh axis order
is ``(pipeline, data, z, y, x)`` and each pipeline stage owns the mesh
``(data, z, y, x)``.

Example:
    >>> grid = Grid(x=2, z=2, data=2)
    >>> grid.size, grid.stage_size
    (8, 8)
    >>> Grid.parse("pipeline=2,x=2,z=2")
    Grid(x=2, y=1, z=2, data=1, pipeline=2)

Virtual (interleaved) pipeline stages: ``virtual=v`` cuts the model into
``pipeline·v`` stages and gives pipeline rank ``r`` the stages ``r, r+p,
r+2p, …`` (:meth:`Grid.pipeline_rank`). It is part of the grid, not of the
partition call, because it is a property of the layout that everything keyed by
stage reads (the plan, the meshes, the perf model, the CLI); it uses no extra
devices:

    >>> grid = Grid.parse("pipeline=2,virtual=2")
    >>> grid.size, grid.stages, [grid.pipeline_rank(s) for s in range(grid.stages)]
    (2, 4, [0, 1, 0, 1])

V-shaped placement (``placement="v"``, ``virtual=2`` only, as ZB-V /
DualPipeV): stage ``s`` on rank ``s`` for ``s < p`` and on rank ``2p − 1 − s``
for ``s ≥ p``, so rank ``r`` holds stages ``r`` and ``2p − 1 − r`` and rank 0
holds the first and the last stage (the loss's backward starts on the rank
where the forward began):

    >>> grid = Grid.parse("pipeline=4,virtual=2,placement=v")
    >>> [grid.pipeline_rank(s) for s in range(grid.stages)]
    [0, 1, 2, 3, 3, 2, 1, 0]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

PIPELINE = "pipeline"
VIRTUAL = "virtual"
PLACEMENT = "placement"
#: how virtual stages are spread over pipeline ranks (:meth:`Grid.pipeline_rank`)
PLACEMENTS: tuple[str, ...] = ("interleaved", "v")
DATA = "data"
Z = "z"
Y = "y"
X = "x"

#: Mesh axis names, outermost first (the order of :meth:`Grid.mesh`).
MESH_AXES: tuple[str, ...] = (PIPELINE, DATA, Z, Y, X)
#: Axis names of one pipeline stage's mesh.
STAGE_AXES: tuple[str, ...] = (DATA, Z, Y, X)
#: Axes that split the batch (each holds a different shard of the tokens).
BATCH_AXES: tuple[str, ...] = (DATA, Z)
#: The 3D tensor-parallel axes.
TENSOR_AXES: tuple[str, ...] = (Z, Y, X)


@dataclasses.dataclass(frozen=True)
class Grid:
    """Sizes of the tensor (``x``, ``y``, ``z``), ``data`` and ``pipeline`` axes.

    All sizes are positive integers; ``Grid()`` is a single device. ``virtual``
    is the number of pipeline stages each pipeline rank runs (interleaved
    stages; 1 = one stage per rank); it needs ``pipeline > 1`` and no devices.
    ``placement`` says which rank runs each stage: ``"interleaved"`` (stage
    ``s`` on rank ``s mod p``) or ``"v"`` (V-shaped, ``virtual=2`` only).
    """

    x: int = 1
    y: int = 1
    z: int = 1
    data: int = 1
    pipeline: int = 1
    virtual: int = 1
    placement: str = "interleaved"

    def __post_init__(self) -> None:
        for name in (X, Y, Z, DATA, PIPELINE, VIRTUAL):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"Grid.{name} must be a positive int, got {value!r} "
                    f"({type(value).__name__}). Remedy: pass e.g. Grid({name}=2)."
                )
            if value < 1 and name == VIRTUAL:
                raise ValueError(
                    f"Grid.virtual must be >= 1, got {value}: it is the number of pipeline "
                    f"stages each pipeline rank runs. Remedy: virtual=1 (one stage per rank) "
                    f"or e.g. Grid(pipeline=2, virtual=2) for interleaved stages."
                )
            if value < 1:
                raise ValueError(
                    f"Grid.{name} must be >= 1, got {value}. Every axis of the grid "
                    f"needs at least one device; use 1 to switch that kind of "
                    f"parallelism off."
                )
        if self.virtual > 1 and self.pipeline == 1:
            raise ValueError(
                f"Grid(virtual={self.virtual}) needs a pipeline: virtual is the number of "
                f"stages per pipeline rank, and pipeline=1 runs the model as one program. "
                f"Remedy: Grid(pipeline=2, virtual={self.virtual}) (or more ranks), or virtual=1."
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"Grid.placement must be one of {PLACEMENTS}, got {self.placement!r}. "
                f"Remedy: placement='interleaved' (stage s on rank s mod pipeline) or "
                f"placement='v' with virtual=2 (V-shaped)."
            )
        if self.placement == "v" and self.virtual != 2:
            raise ValueError(
                f"{self} cannot take placement='v': the V-shaped placement puts stage s on rank s "
                f"and stage 2·pipeline−1−s on the same rank, so it needs exactly virtual=2 stages "
                f"per rank, got virtual={self.virtual}. Remedy: "
                f"Grid(pipeline={self.pipeline}, virtual=2, placement='v'), or "
                f"placement='interleaved' for virtual={self.virtual}."
            )

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}={getattr(self, n)}" for n in (X, Y, Z, DATA, PIPELINE))
        virtual = f", virtual={self.virtual}" if self.virtual > 1 else ""
        placement = f", placement={self.placement!r}" if self.placement != "interleaved" else ""
        return f"Grid({sizes}{virtual}{placement})"

    # --- sizes -------------------------------------------------------------
    @property
    def size(self) -> int:
        """Total number of devices: x·y·z·data·pipeline."""
        return self.x * self.y * self.z * self.data * self.pipeline

    @property
    def stages(self) -> int:
        """Pipeline stages the model is cut into: pipeline·virtual."""
        return self.pipeline * self.virtual

    def pipeline_rank(self, stage: int) -> int:
        """The pipeline rank (stage mesh) that runs ``stage``: ``stage mod pipeline``
        (interleaved), or with ``placement="v"`` ``stage`` for the first ``pipeline``
        stages and ``2·pipeline − 1 − stage`` for the others."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} is not one of the {self.stages} stages of {self}")
        if self.placement == "v" and stage >= self.pipeline:
            return 2 * self.pipeline - 1 - stage
        return stage % self.pipeline

    @property
    def placements(self) -> tuple[int, ...]:
        """The pipeline rank of every stage, stage 0 first (:meth:`pipeline_rank`)."""
        return tuple(self.pipeline_rank(s) for s in range(self.stages))

    @property
    def stage_size(self) -> int:
        """Devices of one pipeline stage: x·y·z·data."""
        return self.x * self.y * self.z * self.data

    @property
    def tensor_size(self) -> int:
        """Devices that share one copy of the model weights: x·y·z."""
        return self.x * self.y * self.z

    @property
    def batch_shards(self) -> int:
        """How many ways the batch is split: data·z."""
        return self.data * self.z

    def axis_size(self, name: str) -> int:
        """Size of the named axis (one of :data:`MESH_AXES`)."""
        if name not in MESH_AXES:
            raise ValueError(f"unknown grid axis {name!r}; axes are {MESH_AXES}")
        return getattr(self, name)

    @property
    def shape(self) -> dict[str, int]:
        """Axis sizes in mesh order ``(pipeline, data, z, y, x)``."""
        return {name: getattr(self, name) for name in MESH_AXES}

    @property
    def stage_shape(self) -> dict[str, int]:
        """Axis sizes of one stage mesh ``(data, z, y, x)``."""
        return {name: getattr(self, name) for name in STAGE_AXES}

    # --- construction helpers ---------------------------------------------
    @classmethod
    def parse(cls, text: str | Mapping[str, int]) -> Grid:
        """Build a grid from ``"pipeline=2,x=2,z=2"`` (the CLI form) or a mapping.

        ``virtual=V`` (stages per pipeline rank) is accepted like an axis, and
        ``placement=v`` (or ``interleaved``) names the placement of the stages.
        """
        if isinstance(text, Mapping):
            return cls(**dict(text))
        sizes: dict[str, int | str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if sep and key == PLACEMENT:
                if key in sizes:
                    raise ValueError(f"grid item {key!r} given twice in {text!r}")
                sizes[key] = value.strip()
                continue
            if not sep or key not in (*MESH_AXES, VIRTUAL):
                raise ValueError(
                    f"bad grid item {part!r} in {text!r}: expected AXIS=SIZE with AXIS "
                    f"one of {', '.join(MESH_AXES)} (or virtual=V, stages per pipeline rank; "
                    f"placement=v, the V-shaped placement), "
                    f"e.g. 'pipeline=2,x=2,z=2'."
                )
            if key in sizes:
                raise ValueError(f"grid axis {key!r} given twice in {text!r}")
            try:
                sizes[key] = int(value)
            except ValueError:
                raise ValueError(
                    f"grid axis {key!r} has size {value!r} in {text!r}; sizes are "
                    f"positive integers, e.g. '{key}=2'."
                ) from None
        return cls(**sizes)

    def check_devices(self, device_count: int) -> None:
        """Raise ``ValueError`` unless the grid uses exactly ``device_count`` devices."""
        if self.size != device_count:
            raise ValueError(
                f"{self} needs {self.size} devices (x·y·z·data·pipeline = "
                f"{self.x}·{self.y}·{self.z}·{self.data}·{self.pipeline}) but "
                f"{device_count} are available. Remedy: choose sizes whose product is "
                f"{device_count} (e.g. {Grid.suggest(device_count)}), or launch with "
                f"{self.size} devices (mpiexec -n / XLA_FLAGS="
                f"--xla_force_host_platform_device_count)."
            )

    @staticmethod
    def suggest(device_count: int) -> Grid:
        """A reasonable default for ``device_count`` devices: data × z (FSDP)."""
        z = math.gcd(device_count, 8)
        return Grid(z=z, data=device_count // z)

    def check_divides(self, what: str, size: int, axes: tuple[str, ...] | str) -> None:
        """Raise ``ValueError`` unless ``size`` is divisible by the product of ``axes``.

        ``what`` names the dimension (a parameter path and dim, or "batch").
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        factor = math.prod(self.axis_size(a) for a in axes)
        if size % factor:
            joined = "·".join(f"{a}={self.axis_size(a)}" for a in axes)
            raise ValueError(
                f"{what} has size {size}, which is not divisible by grid axes {joined} "
                f"(= {factor}) of {self}. Remedy: pick grid sizes that divide {size}, "
                f"or make the dimension a multiple of {factor}."
            )


def default_limit(stages: int) -> int:
    """The message-driven pipeline schedule's default ``limit``: one microbatch more than 1F1B keeps.

    Stage ``s`` keeps at most ``limit - s`` microbatches between its forward
    and backward. Here, in the pure layer, because the runtime's schedule and
    the analytical memory model (:mod:`axonn_jax.perf.memory`) both use it.

    The extra microbatch absorbs message latency: with 4 stages, 16
    microbatches and messages taking 5% of a task, the idle fraction is 0.164
    against the theory's 0.158 (1F1B, or ``limit=stages``: 0.188), for one more
    microbatch of residuals per stage (``tests/test_schedule_sim.py``).

    >>> default_limit(4)
    5
    """
    return stages + 1

"""Process bootstrap: one place that knows about MPI launch and abort.

A script written for one process runs unchanged under ``mpiexec -n N`` (or
``srun``): :func:`init` detects the MPI launch, initialises
``jax.distributed`` through mpi4py, chooses the collectives of the CPU devices
(below), and installs an abort path so that an uncaught exception on any rank
ends the whole job (``MPI_Abort``) instead of leaving the other ranks blocked in
a collective. In a single process it does nothing.

CPU collectives. XLA:CPU carries *every* collective of a job through one
implementation: once ``jax.distributed`` is up with gloo, even a ``psum`` over
four devices of one process goes over gloo's TCP pairs (measured 4.0 ms
against 0.3 ms in-process on this project's 2-core machine). A pipeline whose
stages each live inside one process never needs XLA to cross processes (the
activations travel over MPI), so ``cpu_collectives="auto"`` (the default)
picks XLA's in-process collectives (``"local"``) for such a grid and gloo for
any other, provided the grid is known before JAX's backends start:
``axonn_jax.init(grid=...)`` or ``axonn_jax.partition`` before the first
array. A backend started before any grid keeps gloo (with a warning if the
grid turns out to be process-local); a ``"local"`` job refuses a later grid
whose stages span processes, naming the remedy.

Importing axonn_jax has no side effects: :func:`init` runs at the first
device use (building a mesh, ``axonn_jax.partition``) or when called. Under
``mpiexec`` call ``axonn_jax.init()`` before touching JAX arrays yourself
(JAX must join the other processes before its backends start).

Host values between the processes (all-gather, broadcast, barrier) go
through :mod:`axonn_jax.runtime.collectives`.

Example:
    >>> import axonn_jax
    >>> info = axonn_jax.init()
    >>> info.process_count >= 1
    True
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from axonn_jax.partitioner.grid import Grid

#: Environment variables that MPI launchers set to the world size.
_WORLD_SIZE_VARS = (
    "OMPI_COMM_WORLD_SIZE",  # Open MPI
    "PMI_SIZE",  # MPICH / Hydra, Intel MPI, Slurm --mpi=pmi2
    "PMIX_SIZE",  # PMIx launchers
    "MV2_COMM_WORLD_SIZE",  # MVAPICH
)

#: Seconds a failing rank waits between printing its message and ``MPI_Abort``.
#: The launcher forwards each rank's output asynchronously and tears the job
#: down as soon as it hears of the abort; without the wait, a loaded machine
#: can lose the very message that says why the job ended.
ABORT_GRACE_SECONDS = 1.0

#: What :func:`init` accepts as ``cpu_collectives``; "local" is XLA's in-process
#: collectives (``jax_cpu_collectives_implementation=None``): no XLA program may
#: span processes.
CPU_COLLECTIVES = ("auto", "gloo", "mpi", "local")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Who this process is in the job."""

    process_index: int
    process_count: int
    distributed: bool

    @property
    def is_main(self) -> bool:
        """True on the process that should print and write shared files."""
        return self.process_index == 0


_INFO: ProcessInfo | None = None


def mpi_world_size() -> int:
    """World size announced by the MPI launcher's environment (1 if none)."""
    for var in _WORLD_SIZE_VARS:
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 1


def simulate_cpu_devices(grid: Grid, per_process: int | None = None) -> None:
    """Ask XLA for the CPU devices ``grid`` needs in this process: ``per_process``, or the
    grid's size over the MPI ranks. Call it before JAX's backends start; it does nothing
    when ``XLA_FLAGS`` already sets a count, and nothing for GPUs (each process has its own).

    Example (the examples' first line, so that they run as they are on a laptop)::

        simulate_cpu_devices(Grid.parse("pipeline=2,x=2,z=2"))   # 8 CPU devices, 4 under mpiexec -n 2
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    count = per_process or max(1, grid.size // mpi_world_size())
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def init(
    *,
    grid: Grid | None = None,
    cpu_collectives: str = "auto",
    initialization_timeout: int = 300,
    heartbeat_timeout: int = 100,
    abort_on_exception: bool = True,
) -> ProcessInfo:
    """Initialise the job once; later calls return the same :class:`ProcessInfo`.

    Args:
        grid: the grid this job runs (optional): with ``cpu_collectives="auto"``
            it decides the CPU collectives before JAX's backends start. Every
            call with a grid checks it against the collectives chosen.
        cpu_collectives: collectives of the CPU devices under MPI: "auto" (the
            default; "local" for a grid whose pipeline stages each fit in one
            process, "gloo" otherwise), "gloo", "mpi" (one device per process) or
            "local" (XLA's in-process collectives: fast, no XLA program across
            processes). Only the first call's value counts.
        initialization_timeout: seconds to wait for all processes to join.
        heartbeat_timeout: seconds after which jax.distributed declares a silent
            process dead.
        abort_on_exception: install the abort-on-uncaught-exception hook.

    Under MPI with a grid, JAX's backends are started before it returns (every process
    calls it), so a process may then run JAX code alone. Without a grid they start with
    the first JAX call, which every process must make.

    Example: ``axonn_jax.init(grid=axonn_jax.Grid(pipeline=2, x=2, z=2))`` at the
    top of a script run as ``mpiexec -n 2`` with 4 devices per process.
    """
    global _INFO
    if cpu_collectives not in CPU_COLLECTIVES:
        raise ValueError(f"cpu_collectives={cpu_collectives!r}: expected one of {CPU_COLLECTIVES}")
    if _INFO is None:
        _INFO = _join(cpu_collectives, initialization_timeout, heartbeat_timeout, abort_on_exception)
    if grid is not None and _INFO.distributed:
        _settle_collectives(grid)
        _start_backends()
    return _INFO


def _start_backends() -> None:
    """Start JAX's backends now, on every process at once.

    Their start is a handshake of all the processes of the job: JAX code that one
    process runs alone first (``if info.is_main: ...``) would wait for the others'
    (until jax.distributed's timeout, then fail). With the collectives chosen there is
    nothing left to wait for.
    """
    import jax

    jax.devices()


def _join(cpu_collectives: str, initialization_timeout: int, heartbeat_timeout: int,
          abort_on_exception: bool) -> ProcessInfo:  # fmt: skip
    """Join the MPI job (``jax.distributed``) if there is one."""
    global _COLLECTIVES, _AUTO
    import jax

    world = mpi_world_size()
    distributed = world > 1
    if distributed and not jax.distributed.is_initialized():
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            raise RuntimeError(
                f"axonn_jax.init() found {world} MPI ranks but JAX's backends are already "
                "initialised in this process, so jax.distributed can no longer join them. "
                "Remedy: call axonn_jax.init() at the top of the script, before creating "
                "any JAX array or calling jax.devices()."
            )
        _AUTO = cpu_collectives == "auto"
        _COLLECTIVES = None if _AUTO else cpu_collectives
        # "auto" starts as gloo (what any grid can run on) until a grid says otherwise
        _set_cpu_collectives("gloo" if _AUTO else cpu_collectives)
        _keep_sigterm()
        jax.distributed.initialize(
            cluster_detection_method="mpi4py",
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout,
        )
    elif distributed:  # the script joined jax.distributed itself: its collectives stand
        _COLLECTIVES = jax.config.jax_cpu_collectives_implementation or "local"
    if distributed and abort_on_exception:
        install_abort_hook()
    if distributed:  # Gloo reports each connection on stdout; AXONN_SHOW_GLOO=1 keeps them
        from axonn_jax.runtime.console import drop_gloo_lines

        drop_gloo_lines()
    if not jax.distributed.is_initialized():
        return ProcessInfo(0, 1, distributed)
    # from jax.distributed, not jax.process_index(): that would start the backends before
    # a grid can choose their collectives
    from jax._src.distributed import global_state

    return ProcessInfo(global_state.process_id, global_state.num_processes, distributed)


def _keep_sigterm() -> None:
    """Leave SIGTERM ending the process, as the batch system means it (``scancel``, a job past
    its time limit, ``timeout``): JAX's preemption service, which ``jax.distributed`` starts
    by default, catches it for checkpoints at a sync point this framework does not take, so a
    stuck job ran on until SIGKILL. Set ``JAX_ENABLE_PREEMPTION_SERVICE=1`` to keep JAX's."""
    import jax

    if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ:
        jax.config.update("jax_enable_preemption_service", False)


_COLLECTIVES: str | None = None  # "gloo", "mpi" or "local" once chosen; None while "auto" waits
_AUTO = False  # the choice is (or was) "auto"
_FIRST_GRID: Grid | None = None  # the grid that chose "local"


def cpu_collectives() -> str | None:
    """The CPU collectives of this job: "gloo", "mpi", "local", or ``None`` (one process,
    or "auto" before a grid or a backend decided)."""
    return _COLLECTIVES


def _set_cpu_collectives(choice: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", None if choice == "local" else choice)


def _settle_collectives(grid: Grid) -> None:
    """Choose the CPU collectives for ``grid`` ("auto"), or check ``grid`` against the choice.

    The choice is collective: "local" only if every process's grid keeps its stages
    inside processes and no process has started its backends yet (they hold gloo then).
    """
    global _COLLECTIVES, _FIRST_GRID
    from jax._src import xla_bridge

    from axonn_jax.runtime.collectives import world
    from axonn_jax.runtime.mesh import stages_stay_in_processes

    processes = _INFO.process_count
    local = stages_stay_in_processes(grid, _devices_per_process(), processes)
    if _COLLECTIVES is None:  # "auto", undecided
        started = xla_bridge.backends_are_initialized()
        votes = world().allgather((local, started))
        _COLLECTIVES = "local" if all(ok and not up for ok, up in votes) else "gloo"
        if _COLLECTIVES == "local":
            _FIRST_GRID = grid
            _set_cpu_collectives("local")
        elif local and any(up for _, up in votes):
            _warn_gloo_for_local(grid)
    elif _COLLECTIVES == "local" and not local:
        why = (f"chosen for {_FIRST_GRID}, whose stages each fit in one process" if _AUTO
               else "cpu_collectives='local'")  # fmt: skip
        raise RuntimeError(
            f"{grid} puts the devices of a pipeline stage on several processes ({processes} "
            f"processes, {_devices_per_process()} devices each): XLA would have to run collectives "
            f"across processes, but this job's CPU backend has process-local collectives only "
            f"({why}). Remedy: axonn_jax.init(cpu_collectives='gloo') at the top of the script "
            "(every grid works; collectives inside a process become slower), or a grid whose "
            "stages each fit in one process."
        )


def _devices_per_process() -> int:
    """This process's device count, read without starting JAX's backends when they are not up.

    Before the backends start, the CPU count comes from ``jax_num_cpu_devices`` or
    ``XLA_FLAGS=--xla_force_host_platform_device_count`` (1 without either): the
    collectives chosen here only matter for CPU devices.
    """
    import re

    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return jax.local_device_count()
    if jax.config.jax_num_cpu_devices >= 0:
        return jax.config.jax_num_cpu_devices
    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 1


def _warn_gloo_for_local(grid: Grid) -> None:
    if _INFO is not None and not _INFO.is_main:
        return
    warnings.warn(
        f"{grid} keeps every collective inside one process, but JAX's CPU backend started "
        "before axonn_jax knew the grid, with gloo collectives: gloo carries even "
        "process-local collectives over TCP (a pipeline step about 5x slower on 2 cores). "
        "Remedy: axonn_jax.init(grid=grid) at the top of the script, before any JAX array.",
        stacklevel=4,
    )


def process_info() -> ProcessInfo:
    """The current process's :class:`ProcessInfo` (initialising if needed)."""
    return _INFO if _INFO is not None else init()


def abort(message: str, exit_code: int = 1) -> None:
    """Print ``message`` tagged with this rank and end every process of the job."""
    rank = _INFO.process_index if _INFO else 0
    sys.stderr.write(f"[axonn_jax rank {rank}] {message}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if mpi_world_size() > 1:
        from mpi4py import MPI

        time.sleep(ABORT_GRACE_SECONDS)  # let the launcher forward the message first
        MPI.COMM_WORLD.Abort(exit_code)
    os._exit(exit_code)


def install_abort_hook() -> None:
    """Make an uncaught exception on any rank abort the whole MPI job."""
    previous = sys.excepthook
    if getattr(previous, "_axonn_abort_hook", False):
        return

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        abort(f"uncaught exception, aborting all ranks:\n{text}")

    hook._axonn_abort_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook

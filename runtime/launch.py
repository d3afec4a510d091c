"""Process bootstrap: one place that knows about MPI launch and abort.

A script written for one process runs unchanged under ``mpiexec -n N`` (or
``srun``): :func:`init` detects the MPI launch, initialises
``jax.distributed`` through mpi4py, selects the gloo collectives for CPU
devices, and installs an abort path so that an uncaught exception on any rank
ends the whole job (``MPI_Abort``) instead of leaving the other ranks blocked in
a collective. In a single process it does nothing.

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


def init(
    *,
    cpu_collectives: str = "gloo",
    initialization_timeout: int = 300,
    heartbeat_timeout: int = 100,
    abort_on_exception: bool = True,
) -> ProcessInfo:
    """Initialise the job once; later calls return the same :class:`ProcessInfo`.

    Args:
        cpu_collectives: cross-process collectives for CPU devices ("gloo" or "mpi").
        initialization_timeout: seconds to wait for all processes to join.
        heartbeat_timeout: seconds after which jax.distributed declares a silent
            process dead.
        abort_on_exception: install the abort-on-uncaught-exception hook.
    """
    global _INFO
    if _INFO is not None:
        return _INFO
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
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        jax.distributed.initialize(
            cluster_detection_method="mpi4py",
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout,
        )
    if distributed and abort_on_exception:
        install_abort_hook()
    if distributed:  # Gloo reports each connection on stdout; AXONN_SHOW_GLOO=1 keeps them
        from axonn_jax.runtime.console import drop_gloo_lines

        drop_gloo_lines()
    _INFO = ProcessInfo(jax.process_index(), jax.process_count(), distributed)
    return _INFO


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

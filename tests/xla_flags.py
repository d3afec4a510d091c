"""XLA flags of the test processes: pytest's own and every mpiexec rank's.

The tests compile hundreds of small programs, so compile time dominates the
suite. ``--xla_backend_optimization_level=0`` lowers only the LLVM code
generation effort of XLA:CPU (the HLO passes, hence the collectives and their
order that the tests inspect, are unchanged) and halves it. The reference and
the partitioned runs compile with the same flags. Set
``AXONN_TEST_FULL_XLA_OPT=1`` to test at XLA's default level.
"""

import os


def codegen_flags() -> str:
    """The flags of :func:`xla_flags` less the device count: for a process that sets its own
    (examples/train_gpt.py counts the devices its grid needs); empty at XLA's default level."""
    return "" if os.environ.get("AXONN_TEST_FULL_XLA_OPT") == "1" else "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a test process with ``devices`` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {codegen_flags()}".strip()

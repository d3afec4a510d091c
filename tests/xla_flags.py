"""XLA flags of the test processes: pytest's own and every mpiexec rank's.

The tests compile hundreds of small programs, so compile time dominates the
suite. ``--xla_backend_optimization_level=0`` lowers only the LLVM code
generation effort of XLA:CPU (the HLO passes, hence the collectives and their
order that the tests inspect, are unchanged) and halves it. The reference and
the partitioned runs compile with the same flags. Set
``AXONN_TEST_FULL_XLA_OPT=1`` to test at XLA's default level.
"""

import os


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a test process with ``devices`` simulated CPU devices."""
    flags = f"--xla_force_host_platform_device_count={devices}"
    if os.environ.get("AXONN_TEST_FULL_XLA_OPT") != "1":
        flags += " --xla_backend_optimization_level=0"
    return flags

"""Under mpiexec: the 4D kernels equal the unsharded computation across processes.

Usage: mpiexec -n P python kernel_equivalence.py GRID [GRID ...]   (GRID like x=2,z=2)
Every rank checks; rank 0 prints one "OK case grid error" line per case.
"""

import sys

import axonn_jax
from axonn_jax import Grid
from kernel_cases import CASES, max_scaled_error, run_case

TOLERANCE = 1e-6

info = axonn_jax.init()
import jax  # noqa: E402

assert info.distributed and jax.process_count() > 1, "expected a multi-process launch"
for text in sys.argv[1:]:
    grid = Grid.parse(text)
    for case in sorted(CASES):
        reference, sharded = run_case(case, grid)
        errors = max_scaled_error(reference, sharded)
        worst = max(errors.values())
        assert worst <= TOLERANCE, f"rank {info.process_index}: {case} on {grid}: {errors}"
        if info.is_main:
            print(f"OK {case} {text} {worst:.2e}", flush=True)

"""Under mpiexec: an optimizer combining stages (one stage per process) equals plain optax.

Usage: mpiexec -n 2 python stage_update_equivalence.py GRID OPTIMIZER [OPTIMIZER ...]
(OPTIMIZER: a key of ``stage_update_cases.OPTIMIZERS``; several run one after the other
in the same job). Each rank prints "OK rank R ..." per optimizer or its failures, and
exits non-zero on failure.
"""

import sys

import axonn_jax
from stage_update_cases import run

info = axonn_jax.init()
import jax  # noqa: E402

assert info.distributed and jax.process_count() > 1, "expected a multi-process launch"
grid = axonn_jax.Grid.parse(sys.argv[1])
for name in sys.argv[2:]:
    failures = run(grid, name)
    if failures:
        print(f"FAIL rank {info.process_index} {name}:\n  " + "\n  ".join(failures), flush=True)
        raise SystemExit(1)
    print(f"OK rank {info.process_index} {name} {grid}", flush=True)

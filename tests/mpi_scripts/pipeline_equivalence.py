"""Under mpiexec: pipelined training equals the plain single-device computation.

Usage: mpiexec -n P python pipeline_equivalence.py MODEL GRID [SCHEDULES [offload]]
(GRID like pipeline=2,data=2; SCHEDULES like message,1f1b; "offload" keeps the
AdamW state and master weights in host memory). Every rank checks
the gradients and parameters it holds; each rank prints "OK rank R ..." or the
failures, and exits non-zero on failure.
"""

import sys

import axonn_jax  # initialises jax.distributed from the MPI launch
from pipeline_cases import run_case

info = axonn_jax.init()
import jax  # noqa: E402

assert info.distributed and jax.process_count() > 1, "expected a multi-process launch"
model, grid = sys.argv[1], axonn_jax.Grid.parse(sys.argv[2])
schedules = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ("message",)
offload = len(sys.argv) > 4 and sys.argv[4] == "offload"
failures = run_case(model, grid, schedules=schedules, offload=offload)
if failures:
    print(f"FAIL rank {info.process_index}:\n  " + "\n  ".join(failures), flush=True)
    sys.exit(1)
print(f"OK rank {info.process_index} {model} {sys.argv[2]} {','.join(schedules)}", flush=True)

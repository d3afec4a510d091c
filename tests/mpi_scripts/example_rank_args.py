"""Under mpiexec -n 2: the example launched with other arguments on the last rank.

Usage: mpiexec -n 2 python example_rank_args.py OUT FLAG VALUE_RANK0 VALUE_LAST [ARGS...]

Rank 0 runs ``examples/train_gpt.py ARGS FLAG VALUE_RANK0 --out OUT``, the last rank
``FLAG VALUE_LAST``. Each rank prints ``RAISED <rank>: <message>`` (to stdout, which the
example keeps on every rank here) and exits 3 when the example refuses; ``FINISHED``
otherwise.
"""

import importlib.util
import sys
from pathlib import Path

from mpi4py import MPI

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
out, flag, first, last, *rest = sys.argv[1:]
spec = importlib.util.spec_from_file_location(
    "train_gpt", Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
argv = [*rest, flag, last if rank == size - 1 else first, "--out", out,
        "--all-ranks"]
try:
    example.main(argv)
except ValueError as err:
    print(f"RAISED {rank}: {err}", flush=True)
    sys.exit(3)
print(f"FINISHED {rank}", flush=True)

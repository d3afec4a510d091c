"""Under mpiexec: pipelined training equals the plain single-device computation.

Usage: mpiexec -n P python pipeline_equivalence.py MODEL GRID [--schedules message,1f1b] [--trajectory-schedule zb]
[--offload] [--references FILE] [--and MODEL GRID [options] ...]

The grid is announced to ``axonn_jax.init`` first, so a grid whose stages each fit in
one process runs with in-process CPU collectives ("local") and any other with gloo;
the OK line names the choice.

GRID is like pipeline=2,data=2; ``--offload`` keeps the AdamW state and master
weights in host memory; ``--references`` reads the plain Flax/optax results
written by ``pipeline_cases.save_references`` instead of computing them on every
rank. ``--and`` starts another case, run after the previous one in the same job
(one launch and one ``jax.distributed`` start for several cases; every grid of a
job has the same size, and the first one chooses the collectives). Every rank
checks the gradients and parameters it holds; each rank prints "OK rank R ..."
per case or the failures, and exits non-zero on failure.
"""

import argparse
import sys

import axonn_jax
from axonn_jax.runtime import launch
from pipeline_cases import load_references, run_case

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("grid", type=axonn_jax.Grid.parse)
parser.add_argument("--schedules", default="message", type=lambda s: tuple(s.split(",")))
parser.add_argument("--offload", action="store_true")
parser.add_argument("--trajectory-schedule", default="message", help="the schedule of the 5 AdamW steps")
parser.add_argument("--references")


def split_cases(argv: list[str]) -> list[list[str]]:
    """The command line's cases: the arguments between ``--and`` separators."""
    cases = [[]]
    for arg in argv:
        if arg == "--and":
            cases.append([])
        else:
            cases[-1].append(arg)
    return cases


cases = [parser.parse_args(argv) for argv in split_cases(sys.argv[1:])]
info = axonn_jax.init(grid=cases[0].grid)  # the (first) grid chooses the CPU collectives
assert info.distributed and info.process_count > 1, "expected a multi-process launch"
for args in cases:
    refs = load_references(args.references) if args.references else None
    failures = run_case(args.model, args.grid, schedules=args.schedules, offload=args.offload,
                        refs=refs, trajectory_schedule=args.trajectory_schedule)  # fmt: skip
    if failures:
        print(f"FAIL rank {info.process_index} {args.model} {args.grid}:\n  " + "\n  ".join(failures), flush=True)
        raise SystemExit(1)
    print(f"OK rank {info.process_index} {args.model} {args.grid} {','.join(args.schedules)} "
          f"collectives={launch.cpu_collectives()}", flush=True)  # fmt: skip

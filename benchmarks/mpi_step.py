"""One pipelined training step in one process vs the same grid split over MPI processes.

The example's GPT (4 layers, hidden 128, 16 sequences of 64 tokens, 4
microbatches, AdamW) on ``--grid pipeline=2,x=2,z=2``, timed in three
configurations launched one after another in rotating order, ``--rounds``
times:

* ``one process``: 8 simulated CPU devices in one process;
* ``mpiexec -n 2``: 4 devices per process, one pipeline stage each, with the
  CPU collectives ``axonn_jax.init(grid=...)`` chooses (``local``: each
  stage's tensor-parallel collectives stay in its process, XLA's in-process
  implementation; the activations cross over MPI);
* ``mpiexec -n 2, gloo``: the same, forced to gloo collectives (what every MPI
  job used before): XLA:CPU then carries even process-local collectives over
  gloo's TCP pairs.

Each launch compiles, warms up ``--warmup`` steps and times ``--steps``
steps (median); the figure is the median over rounds of each MPI
configuration's step time over the one-process step time of the same round.
The losses of the timed steps must agree with the one-process run (bit for bit
with in-process collectives, to 1e-5 with gloo, whose sums run in another
order). The stage tasks' median duration comes from the last step's trace.

    .venv/bin/python benchmarks/mpi_step.py [--rounds 3] [--steps 10] [--grid pipeline=2,x=2,z=2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from mpi_launch import PREFIX, is_worker, relaunch, rotated  # noqa: E402

FLAG = "AXONN_MPI_STEP_WORKER"
#: (label, processes, cpu_collectives)
CONFIGS = (("one process", 1, "auto"), ("mpiexec -n 2", 2, "auto"), ("mpiexec -n 2, gloo", 2, "gloo"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="pipeline=2,x=2,z=2")
    p.add_argument("--rounds", type=int, default=3, help="launches of each configuration")
    p.add_argument("--steps", type=int, default=10, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--collectives", default="auto", help=argparse.SUPPRESS)  # worker side
    p.add_argument("--out", default=None, help="write the markdown table here too")
    return p.parse_args(argv)


def worker(args) -> None:
    """One configuration: every rank trains; rank 0 prints the step times and losses."""
    import axonn_jax

    grid = axonn_jax.Grid.parse(args.grid)
    info = axonn_jax.init(grid=grid, cpu_collectives=args.collectives)
    import jax
    import numpy as np
    import optax

    from axonn_jax.models import GPT, GPTConfig, next_token_loss, window_inputs
    from axonn_jax.runtime import launch

    batch, seq, microbatches = 16, 64, 4
    config = GPTConfig(vocab_size=256, num_layers=args.layers, hidden=args.hidden, num_heads=4,
                       max_seq_len=seq)  # fmt: skip
    pm = axonn_jax.partition(GPT(config), grid, np.zeros((batch // microbatches, seq), np.int32))
    step = pm.train_step(next_token_loss, optax.adamw(1e-3), inputs=window_inputs,
                         microbatches=microbatches)  # fmt: skip
    params, opt_state = step.init(pm.init(jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, 256, (args.warmup + args.steps, batch, seq + 1))
    times, losses = [], []
    for i, window in enumerate(tokens.astype(np.int32)):
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, window)
        loss = float(loss)  # the step's end: the loss is on the host
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            losses.append(loss)
    rows = step.value_and_grad.trace() if grid.pipeline > 1 else None  # collective
    if info.is_main:
        tasks = [end - begin for _, _, _, _, begin, end, _ in rows or ()]
        print(PREFIX + json.dumps({
            "step_s": statistics.median(times), "losses": losses,
            "task_s": statistics.median(tasks) if tasks else None,
            "collectives": launch.cpu_collectives() or "in-process (one process)",
        }), flush=True)  # fmt: skip


# --------------------------------------------------------------------- launcher side


def table(result: dict) -> str:
    """The markdown table of a :func:`main` result."""
    lines = [f"`{result['grid']}`, GPT {result['layers']}L/{result['hidden']}H, median of "
             f"{result['rounds']} launches × {result['steps']} steps (load average "
             f"{result['load'][0]:.1f}):", "",
             "| configuration | CPU collectives | step time / one process (rounds) | step | "
             "stage task | loss difference |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for c in result["configs"]:
        task = "–" if c["task_s"] is None else f"({c['task_s'] * 1e3:.1f} ms)"
        rounds = " / ".join(f"{x:.2f}" for x in c["ratios"])
        lines.append(f"| {c['label']} | {c['collectives']} | **{c['ratio']:.2f}** ({rounds}) | "
                     f"({c['step_s'] * 1e3:.0f} ms) | {task} | {c['loss_diff']:.1e} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if is_worker(FLAG):
        worker(args)
        return {}
    from axonn_jax.partitioner.grid import Grid

    given = argv if argv is not None else sys.argv[1:]
    size = Grid.parse(args.grid).size
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in CONFIGS}
    for label, processes, collectives in rotated(CONFIGS, args.rounds):
        runs[label].append(relaunch(__file__, processes, [*given, "--collectives", collectives], FLAG,
                                    timeout=1200, devices_per_process=size // processes))  # fmt: skip
    base = runs[CONFIGS[0][0]]
    configs = []
    for label, _, _ in CONFIGS:
        ratios = [run["step_s"] / one["step_s"] for run, one in zip(runs[label], base)]
        diff = max(abs(a - b) for run, one in zip(runs[label], base)
                   for a, b in zip(run["losses"], one["losses"]))  # fmt: skip
        tasks = [run["task_s"] for run in runs[label] if run["task_s"] is not None]
        configs.append({"label": label, "collectives": runs[label][0]["collectives"],
                        "ratio": statistics.median(ratios), "ratios": ratios,
                        "step_s": statistics.median(run["step_s"] for run in runs[label]),
                        "task_s": statistics.median(tasks) if tasks else None, "loss_diff": diff})  # fmt: skip
    result = {"grid": args.grid, "layers": args.layers, "hidden": args.hidden, "rounds": args.rounds,
              "steps": args.steps, "configs": configs, "load": os.getloadavg()}  # fmt: skip
    result["table"] = table(result)
    print(result["table"])
    if args.out:
        Path(args.out).write_text(result["table"] + "\n")
    return result


if __name__ == "__main__":
    main()

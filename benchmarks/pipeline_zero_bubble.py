"""W filling the idle time in one process: zero-bubble schedules vs the fused backward.

One process drives 2 simulated CPU devices with ``Grid(pipeline=2)``, the
compute-bound dense tower of ``pipeline_async.py`` (each stage program on one
core). Each round runs one training step per schedule (``message``: fused
backward; ``zb``: message-driven, B first and W when nothing else is ready;
``zb-h1``: static), in a rotating order; the figure is the median over rounds
of ``message`` step time / each schedule's step time (above 1: faster), with
the idle fraction per stage from the last step's trace. All three return the
same loss and gradients (checked to the pipeline tests' bounds).

    .venv/bin/python benchmarks/pipeline_zero_bubble.py [--rounds 10] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

SCHEDULES = ("message", "zb", "zb-h1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="dense layers (half per stage)")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--rows", type=int, default=512, help="rows per microbatch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    from pipeline_async import pipelined_mlp

    args = parse_args(argv)
    pm, params, x, loss = pipelined_mlp(args)  # first: it sets XLA_FLAGS
    import jax
    import numpy as np

    from axonn_jax.runtime.pipeline import timeline

    m = args.microbatches
    steps = {s: pm.value_and_grad(loss, inputs=lambda b: (b,), microbatches=m, schedule=s) for s in SCHEDULES}
    results = {}
    for s, step in steps.items():  # compile and warm up
        for _ in range(2):
            results[s] = step(params, x)
    for s in SCHEDULES[1:]:  # the same numbers (B + W vs the fused backward)
        np.testing.assert_allclose(float(results[s][0]), float(results["message"][0]), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(results[s][1]), jax.tree.leaves(results["message"][1])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    idle = {}
    for r in range(args.rounds):
        for s in SCHEDULES[r % 3:] + SCHEDULES[: r % 3]:
            start = time.perf_counter()
            jax.block_until_ready(steps[s](params, x))
            times[s].append(time.perf_counter() - start)
    for s in SCHEDULES:
        idle[s] = timeline.idle_fractions(steps[s].trace())
    speedup = {s: statistics.median(b / a for a, b in zip(times[s], times["message"])) for s in SCHEDULES}
    result = {"speedup": speedup, "median_s": {s: statistics.median(t) for s, t in times.items()},
              "idle": idle, "microbatches": m, "layers": args.layers, "width": args.width,
              "rows": args.rows, "rounds": args.rounds}  # fmt: skip
    result["table"] = table(result)
    print(result["table"])
    return result


def table(r: dict) -> str:
    lines = [f"One process, 2 CPU devices, `Grid(pipeline=2)`, dense tower {r['layers']}×{r['width']}, "
             f"{r['microbatches']} microbatches of {r['rows']} rows; median of {r['rounds']} rotating "
             "rounds:", "",
             "| schedule | message step time / this one | step time | idle stage 0 / 1 |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for s in SCHEDULES:
        per_stage = {int(k): v for k, v in r["idle"][s].items()}
        cells = " / ".join(f"{per_stage[k]:.2f}" for k in sorted(per_stage))
        lines.append(f"| {s} | {r['speedup'][s]:.2f} | ({r['median_s'][s] * 1e3:.1f} ms) | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

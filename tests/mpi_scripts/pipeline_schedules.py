"""Under mpiexec -n 2: the message-driven queue against static 1F1B with a slow stage.

Every task is padded to TASK seconds and stage 1's first task stalls for STALL
seconds (the ``delay`` hook), so the comparison is about the order of work,
not about this machine's noise (the stall dwarfs a tiny model's compute). Rank 0 prints one JSON line per schedule
summary: makespan, idle fraction per stage, how many forwards stage 0 ran
before its first backward, and stage 0's peak number of microbatches in flight.
"""

import json

import axonn_jax
from pipeline_cases import build

from axonn_jax.runtime.pipeline import timeline as trace

info = axonn_jax.init()
assert info.distributed and info.process_count == 2
M, LIMIT, TASK, STALL = 8, 6, 0.2, 2.0


def delay(stage, kind, mb):
    return TASK + (STALL if stage == 1 and mb == 0 else 0.0)


case = build("gpt")
pm = axonn_jax.partition(case.model, axonn_jax.Grid(pipeline=2), *case.inputs(case.batch(1)))
import jax  # noqa: E402

params = pm.init(jax.random.key(0))
batch = case.batch(M)
summary = {"limit": LIMIT}
for schedule in ("message", "1f1b"):
    step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=M, schedule=schedule,
                             limit=LIMIT, delay=delay)  # fmt: skip
    step(params, batch)  # compile
    step(params, batch)
    rows = step.trace()
    if info.is_main:
        stage0 = sorted((r for r in rows if r[1] == 0), key=lambda r: r[4])
        first_b = next(i for i, r in enumerate(stage0) if r[2] == "B")
        summary[schedule] = {
            "makespan": max(r[5] for r in rows) - min(r[4] for r in rows),
            "idle": {str(k): v for k, v in trace.idle_fractions(rows).items()},
            "forwards_before_first_backward": first_b,
            "order0": [f"{r[2]}{r[3]}" for r in stage0],
        }
    peak = step.last_result.peak_in_flight
    if 0 in peak and info.is_main:
        summary[schedule]["peak_in_flight"] = peak[0]
if info.is_main:
    print(json.dumps(summary), flush=True)

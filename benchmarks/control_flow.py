"""Control flow partitioned: repeated work, warnings and errors of scan / while / cond models.

For each model of ``tests/control_flow_cases.py`` × grid: the redundancy of
one loss-and-gradient step (``pm.report().compute``: devices × per-device
FLOPs / plain FLOPs, counted on the traced programs), the plan's warnings and
replicated fallbacks, and the largest difference of the loss and of any
gradient leaf from the plain model (relative to the leaf's largest entry plus
10% of the model's largest, as ``benchmarks/redundancy.py``). Then the
pipeline stages of the scan-over-layers transformer, with the scan cut
between iterations (now) and kept whole (before): FLOP share per stage.

Run (8 simulated CPU devices)::

    .venv/bin/python benchmarks/control_flow.py
    .venv/bin/python benchmarks/control_flow.py --models scan_gpt --grids x=4,data=2
    .venv/bin/python benchmarks/control_flow.py --models lstm,gru --batch 64 --pipelines ""
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()  # fmt: skip
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODELS = ("scan_gpt", "scan_gpt_nnx", "loop_gpt", "lstm", "gru", "fori_refiner",
          "while_normalised", "cond_switch", "scan_dense")  # fmt: skip
GRIDS = ("x=2,y=2,z=2", "x=4,data=2", "z=2,data=4", "y=2,z=2,data=2", "x=2,z=2,data=2")
PIPELINES = ("pipeline=2,x=2,z=2", "pipeline=4,z=2")


def row(name: str, grid_text: str, batch: int | None = None) -> dict:
    import axonn_jax
    from control_flow_cases import BATCH, build
    from partition_cases import reference_apply

    case = build(name, batch or BATCH)
    params, apply = reference_apply(case)

    def loss(p, fn):
        return case.loss(fn(p, *case.args), *case.args)

    want_loss, want = jax.jit(jax.value_and_grad(lambda p: loss(p, apply)))(params)
    pm = axonn_jax.partition(case.model, axonn_jax.Grid.parse(grid_text), *case.args)
    got_loss, got = jax.jit(jax.value_and_grad(lambda p: loss(p, pm.apply)))(pm.shard(params))
    got = pm.gather(got)
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want))
    errors = [abs(float(got_loss) - float(want_loss)) / max(1.0, abs(float(want_loss)))]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        w = np.asarray(w)
        errors.append(float(np.max(np.abs(np.asarray(g) - w))) / (float(np.max(np.abs(w))) + 0.1 * scale))
    return dict(model=name, grid=grid_text, redundancy=pm.report().compute.redundancy,
                warnings=len(pm.plan.warnings), fallbacks=len(pm.plan.fallbacks), max_err=max(errors))  # fmt: skip


def stage_shares(name: str, grid_text: str) -> dict:
    """FLOP share per stage with the scan cut between iterations, and kept whole."""
    import axonn_jax
    from control_flow_cases import build

    from axonn_jax.partitioner.stages import plan_stages
    from axonn_jax.partitioner.trace import inline_calls, trace_model

    case = build(name)
    grid = axonn_jax.Grid.parse(grid_text)
    pm = axonn_jax.partition(case.model, grid, *case.args)
    traced = trace_model(case.model, *case.args)
    try:
        whole = plan_stages(traced, inline_calls(traced.jaxpr).jaxpr, grid.stages)
        before = _shares(whole)
    except ValueError as err:  # not enough boundaries to cut
        before = str(err).split(":")[1].strip().split(",")[0]
    return dict(model=name, grid=grid_text, after=_shares(pm.plan.stages), before=before,
                cuts=pm.plan.scan_cuts, redundancy=pm.report().compute.redundancy,
                fallbacks=len(pm.plan.fallbacks))  # fmt: skip


def _shares(stages) -> list[float]:
    stages = getattr(stages, "stages", stages)  # plan_stages gives a StagePlan
    total = sum(s.flops for s in stages)
    return [round(s.flops / total, 3) for s in stages]


def table(rows: list[dict]) -> str:
    lines = ["| model | grid | redundancy | warnings | fallbacks | max rel. error |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | `{r['grid']}` | {r['redundancy']:.3f} | {r['warnings']} | {r['fallbacks']} "
              f"| {r['max_err']:.1e} |" for r in rows]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--grids", default=";".join(GRIDS), help="';'-separated grids")
    parser.add_argument("--pipelines", default=";".join(PIPELINES), help="';'-separated grids")
    parser.add_argument("--batch", type=int, default=None,
                        help="rows of the language models' token batch (default: the test cases' 8)")
    ns = parser.parse_args(argv)
    rows = []
    for name in filter(None, ns.models.split(",")):
        for grid in filter(None, ns.grids.split(";")):
            rows.append(row(name, grid, ns.batch))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    stages = [stage_shares(name, grid) for name in ("scan_gpt", "scan_gpt_nnx")
              for grid in ns.pipelines.split(";") if grid]  # fmt: skip
    print(table(rows))
    for s in stages:
        print(f"{s['model']} {s['grid']}: FLOP share per stage {s['after']} (scan kept whole: "
              f"{s['before']}); cuts {s['cuts']}; redundancy {s['redundancy']:.3f}, "
              f"{s['fallbacks']} fallbacks")
    return {"rows": rows, "stages": stages, "table": table(rows)}


if __name__ == "__main__":
    main()

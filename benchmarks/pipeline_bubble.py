"""Pipeline bubble: measured idle fraction of GPipe / 1F1B / message-driven / ZB-H1 / zero-bubble message-driven / ZB-V vs theory.

Launches itself under ``mpiexec -n P`` (pipeline=P; for each ``--virtual``
value V each process runs V interleaved stages, P·V in all, V=1: one stage;
``2v``: two stages per rank in the V-shaped placement, rank r holding stages r
and 2P − 1 − r)
and, for each microbatch count, runs one step per schedule after a compile
step; the idle fraction of each pipeline rank comes from the dispatch queue's
trace (first task start → last task end). Theory: (p − 1)/(v·m + p − 1).

Two modes, both reported:
* ``uniform``: every task is padded with a fixed sleep (``--task-ms``) that
  dwarfs the tiny model's compute, so each stage's work is equal and the
  measurement isolates the schedule (what the formula assumes, with
  forward = backward = one unit and the last stage's fused task = two units;
  with virtual stages each stage's task is 1/V of that, so a rank's work per
  microbatch stays the same; the zero-bubble schedules split each stage's
  backward time between B and W in the ratio of the two programs' FLOPs
  (``BackwardSplit.flops``; matmul layers ≈ 1:1, dx = dy·Wᵀ and dW = xᵀ·dy),
  or ``--w-share`` of it to W if given, so each rank's work per microbatch is
  unchanged);
* ``compute``: the model's own compute only (on a shared 2-core machine with
  several processes this is dominated by noise; reported as measured).

    .venv/bin/python benchmarks/pipeline_bubble.py [--stages 4] [--microbatches 4,8,16]
    .venv/bin/python benchmarks/pipeline_bubble.py --stages 4 --virtual 1,2,2v --microbatches 16 --modes uniform
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from mpi_launch import PREFIX, is_worker, relaunch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("gpipe", "1f1b", "message", "zb-h1", "zb", "zb-v")
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "message": "message-driven", "zb-h1": "ZB-H1",
          "zb": "zero-bubble message-driven", "zb-v": "ZB-V"}  # fmt: skip
#: schedules that run on the V-shaped placement only
V_ONLY = ("zb-v",)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks (processes)")
    p.add_argument("--virtual", default="1,2,2v",
                   help="stages per rank, a list: V (interleaved) or 2v (V-shaped placement)")
    p.add_argument("--microbatches", default="4,8,16")
    p.add_argument("--task-ms", type=float, default=40.0)
    p.add_argument("--modes", default="uniform,compute")
    p.add_argument("--w-share", type=float, default=None,
                   help="zero bubble: W's share of the backward (default: from the B and W programs' FLOPs)")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--out", default=None, help="write the markdown table here too")
    return p.parse_args(argv)


def worker(args) -> None:
    """Runs on every rank under mpiexec; rank 0 prints JSON results."""
    sys.path.insert(0, str(ROOT / "tests"))
    import axonn_jax
    from axonn_jax.runtime.pipeline import timeline as trace
    from axonn_jax.runtime.pipeline.schedules import splits_weights
    from axonn_jax.runtime.pipeline.tasks import TaskKind

    info = axonn_jax.init()
    import jax
    from pipeline_cases import build

    case = build("gpt")
    results = []
    for item in args.virtual.split(","):
        virtual, placement = int(item.rstrip("v")), "v" if item.endswith("v") else "interleaved"
        grid = axonn_jax.Grid(pipeline=args.stages, virtual=virtual, placement=placement)
        pm = axonn_jax.partition(case.model, grid, *case.inputs(case.batch(1)))
        params = pm.init(jax.random.key(0))
        task = args.task_ms / 1e3 / virtual  # one stage's share of its rank's work
        shares: dict[int, float] = {}  # stage → W's share of its backward, from FLOPs

        def w_share(stage: int, shares=shares) -> float:
            return args.w_share if args.w_share is not None else shares.get(stage, 0.5)

        for mode in args.modes.split(","):
            for m in map(int, args.microbatches.split(",")):
                for schedule in args.schedules.split(","):
                    if schedule in V_ONLY and placement != "v":
                        continue
                    split = splits_weights(schedule)

                    def delay(stage, kind, mb, task=task, last=grid.stages - 1, mode=mode, split=split,
                              w_share=w_share):  # fmt: skip
                        if mode != "uniform":
                            return 0.0
                        w = w_share(stage) if split else 0.0
                        if kind is TaskKind.WEIGHTS:
                            return w * task
                        if kind is TaskKind.BACKWARD:
                            return (1 - w) * task
                        return (2 - w) * task if stage == last else task  # the last: F + B

                    step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=m,
                                             schedule=schedule, delay=delay)  # fmt: skip
                    step(params, case.batch(m))  # compile and warm up
                    if split and not shares and args.w_share is None:
                        shares.update(w_shares(step.stage_programs(case.inputs(case.batch(1)))))
                    step(params, case.batch(m))
                    rows = step.trace()
                    if info.is_main:
                        idle = trace.idle_fractions(rows, pipeline=grid.placements)  # per rank
                        results.append({"mode": mode, "m": m, "v": virtual, "placement": placement,
                                        "schedule": schedule,
                                        "idle_mean": sum(idle.values()) / len(idle), "idle": idle,
                                        "theory": trace.bubble_theory(args.stages, m, virtual),
                                        "floor": trace.zero_bubble_floor(args.stages, m, virtual),
                                        "theory_v1": trace.bubble_theory(args.stages, m),
                                        "w_share": dict(shares) if split else {}})  # fmt: skip
    if info.is_main:
        print(PREFIX + json.dumps(results), flush=True)


def w_shares(programs) -> dict[int, float]:
    """Stage → W's share of its backward, ``W / (B + W)`` FLOPs of the split programs of this
    process's stages (the others are split where they run)."""
    shares = {}
    for stage, program in enumerate(programs):
        if program.backward_split is not None:
            b, w = program.backward_split.flops()
            shares[stage] = w / (b + w) if b + w else 0.5
    return shares


def table(results, stages: int) -> str:
    names = [s for s in SCHEDULES if any(r["schedule"] == s for r in results)]
    lines = [f"Pipeline bubble, pipeline={stages} (one process per rank; `virtual` stages per "
             "rank), idle fraction per rank averaged over ranks, from the dispatch-queue trace:", "",
             "| mode | virtual | microbatches | " + " | ".join(LABELS[s] for s in names)
             + " | theory (p−1)/(v·m+p−1) | zero-bubble floor |",
             "| --- | --- | --- | " + "--- | " * len(names) + "--- | --- |"]  # fmt: skip
    def virtual(r) -> str:  # "2", or "2 V" for the V-shaped placement
        return f"{r.get('v', 1)}" + (" V" if r.get("placement") == "v" else "")

    keyed = {(r["mode"], virtual(r), r["m"], r["schedule"]): r for r in results}
    for mode, v, m in sorted({(r["mode"], virtual(r), r["m"]) for r in results},
                             key=lambda t: (t[0] != "uniform", t[1], t[2])):  # fmt: skip
        cells = [f"{keyed[(mode, v, m, s)]['idle_mean']:.3f}" if (mode, v, m, s) in keyed else "—"
                 for s in names]  # fmt: skip
        first = next(keyed[(mode, v, m, s)] for s in names if (mode, v, m, s) in keyed)
        floor = f"{first['floor']:.3f}" if "floor" in first else "—"
        lines.append(f"| {mode} | {v} | {m} | " + " | ".join(cells) + f" | {first['theory']:.3f} | {floor} |")
    shares = {(virtual(r), int(s)): w for r in results for s, w in r.get("w_share", {}).items()}
    if shares:
        lines += ["", "Zero bubble, uniform mode: W's share of each backward (rank 0's stages, from the B "
                  "and W programs' FLOPs; virtual 2 V: rank 0 holds the first and the last stage): "
                  + ", ".join(f"virtual={v} stage {s}: {w:.2f}" for (v, s), w in sorted(shares.items()))]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if is_worker("AXONN_BUBBLE_WORKER"):
        worker(args)
        return {}
    given = argv if argv is not None else sys.argv[1:]
    results = relaunch(__file__, args.stages, given, "AXONN_BUBBLE_WORKER", timeout=3000)
    text = table(results, args.stages)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return {"results": results, "table": text}


if __name__ == "__main__":
    main()

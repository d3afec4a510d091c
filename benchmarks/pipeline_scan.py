"""A transformer written as one ``nn.scan`` over stacked layers vs the same layers unrolled, pipelined.

The same GPT (``--layers`` pre-norm blocks, hidden ``--hidden``, 4 heads, vocabulary
256, 16 sequences of 64 tokens, 4 microbatches, AdamW), its blocks written two ways:
a Python loop of blocks (one parameter leaf per layer) and one ``nn.scan`` (each
parameter stacked over the layers: the way MaxText-style JAX code writes a stack).
Each is trained on ``pipeline=2`` under ``mpiexec -n 2`` (one stage per process: the
scan is cut between iterations, each stage is given its rows of every stacked
parameter, and the two processes exchange their rows of the stacked gradients), and,
as the baseline of what the scan itself costs, on one device without a pipeline (XLA
runs a scan slower than the unrolled loop, on CPU). Launched in rotating order,
``--rounds`` times; each launch compiles, warms up ``--warmup`` steps and times
``--steps`` (median).

The figure: the scan's step time over the unrolled model's, per round, on the
pipeline and on one device; a pipeline that adds nothing of its own for scans keeps
the first ratio at the second.

    .venv/bin/python benchmarks/pipeline_scan.py [--rounds 3] [--steps 8] [--layers 8] [--hidden 256]
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

FLAG = "AXONN_PIPELINE_SCAN_WORKER"
#: (label, model, processes, grid)
CONFIGS = (("unrolled, pipeline=2, mpiexec -n 2", "unrolled", 2, "pipeline=2"),
           ("scan, pipeline=2, mpiexec -n 2", "scan", 2, "pipeline=2"),
           ("unrolled, one device", "unrolled", 1, "data=1"),
           ("scan, one device", "scan", 1, "data=1"))  # fmt: skip
BATCH, SEQ, VOCAB, MICROBATCHES = 16, 64, 256, 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="launches of each configuration")
    p.add_argument("--steps", type=int, default=8, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--model", default="scan", help=argparse.SUPPRESS)  # worker side
    p.add_argument("--grid", default="pipeline=2", help=argparse.SUPPRESS)  # worker side
    p.add_argument("--out", default=None, help="write the markdown table here too")
    return p.parse_args(argv)


def gpt(layers: int, hidden: int, scanned: bool):
    """The GPT of the comparison, its blocks as one ``nn.scan`` or as a loop."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(hidden)(nn.gelu(nn.Dense(4 * hidden)(h))), None

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(VOCAB, hidden)(tokens)
            if scanned:
                stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers)
                x, _ = stack(name="blocks")(x, None)
            else:
                for i in range(layers):
                    x, _ = Block(name=f"block_{i}")(x, None)
            return nn.Dense(VOCAB)(nn.LayerNorm()(x))

    return GPT()


def worker(args) -> None:
    """One configuration: every rank trains; rank 0 prints the step times."""
    import axonn_jax

    grid = axonn_jax.Grid.parse(args.grid)
    info = axonn_jax.init(grid=grid)
    import jax
    import numpy as np
    import optax

    def loss_fn(logits, tokens):
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    model = gpt(args.layers, args.hidden, args.model == "scan")
    pm = axonn_jax.partition(model, grid, np.zeros((BATCH // MICROBATCHES, SEQ), np.int32))
    step = pm.train_step(loss_fn, optax.adamw(1e-3), microbatches=MICROBATCHES)
    params, opt_state = step.init(pm.init(jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, VOCAB, (args.warmup + args.steps, BATCH, SEQ))
    times = []
    for i, batch in enumerate(tokens.astype(np.int32)):
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)  # the step's end: the loss is on the host
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    if info.is_main:
        print(PREFIX + json.dumps({"step_s": statistics.median(times)}), flush=True)


def table(result: dict) -> str:
    """The markdown table of a :func:`main` result."""
    lines = [f"GPT {result['layers']}L/{result['hidden']}H, {MICROBATCHES} microbatches, AdamW; median of "
             f"{result['rounds']} launches × {result['steps']} steps (load average {result['load'][0]:.1f}):", "",
             "| where | scan step time / unrolled (rounds) | unrolled step | scan step |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for row in result["rows"]:
        rounds = " / ".join(f"{x:.2f}" for x in row["ratios"])
        lines.append(f"| {row['where']} | **{row['ratio']:.2f}** ({rounds}) | ({row['unrolled_s'] * 1e3:.0f} ms) | "
                     f"({row['scan_s'] * 1e3:.0f} ms) |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if is_worker(FLAG):
        worker(args)
        return {}
    given = argv if argv is not None else sys.argv[1:]
    runs: dict[str, list[float]] = {label: [] for label, *_ in CONFIGS}
    for label, model, processes, grid in rotated(CONFIGS, args.rounds):
        out = relaunch(__file__, processes, [*given, "--model", model, "--grid", grid], FLAG,
                       timeout=1200, devices_per_process=1)  # fmt: skip
        runs[label].append(out["step_s"])
    rows = []
    for where, unrolled, scan in (("pipeline=2, mpiexec -n 2", CONFIGS[0][0], CONFIGS[1][0]),
                                  ("one device, no pipeline", CONFIGS[2][0], CONFIGS[3][0])):  # fmt: skip
        ratios = [s / u for s, u in zip(runs[scan], runs[unrolled])]
        rows.append({"where": where, "ratio": statistics.median(ratios), "ratios": ratios,
                     "unrolled_s": statistics.median(runs[unrolled]), "scan_s": statistics.median(runs[scan])})  # fmt: skip
    result = {"layers": args.layers, "hidden": args.hidden, "rounds": args.rounds, "steps": args.steps,
              "rows": rows, "load": os.getloadavg()}  # fmt: skip
    result["table"] = table(result)
    print(result["table"])
    if args.out:
        Path(args.out).write_text(result["table"] + "\n")
    return result


if __name__ == "__main__":
    main()

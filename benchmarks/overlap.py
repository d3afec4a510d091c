"""Effect of each communication-overlap option (OAG, ORS, OAR) on a GPT train step.

For the settings none / oag / ors / oar / all, one jitted AdamW step each on
the same grid and devices. Reported per setting:

* step time relative to ``none``, from interleaved rounds (median);
* the compiled program's structure: asynchronous collective pairs
  (``-start``/``-done``) by kind, and how many have a matmul scheduled inside
  (GPU; XLA's CPU backend runs collectives synchronously and has none);
* the step-1 loss, which must be identical in every setting.

On CPU the devices are simulated (``--devices``, default 8): XLA:CPU removes
the ordering barriers before it schedules, so ratios there measure noise,
not overlap. A GPU effect needs several GPUs in one process.

    .venv/bin/python benchmarks/overlap.py [--grid x=2,y=2,z=2 --layers 4 --hidden 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

SETTINGS = ("none", "oag", "ors", "oar", "all")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default="x=2,y=2,z=2")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU only)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--steps", type=int, default=3, help="steps per setting per round")
    ap.add_argument("--json", help="write the results here")
    return ap.parse_args(argv)


def measure(args) -> dict:
    import jax
    import numpy as np
    import optax

    import axonn_jax
    from axonn_jax.models import GPT, GPTConfig, next_token_loss
    from axonn_jax.runtime.hlo import async_windows

    grid = axonn_jax.Grid.parse(args.grid)
    model = GPT(GPTConfig(vocab_size=args.vocab, num_layers=args.layers, hidden=args.hidden,
                          num_heads=args.heads, max_seq_len=args.seq))  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    optimizer = optax.adamw(1e-3)
    runs = {}
    params0 = None
    for name in SETTINGS:
        pm = axonn_jax.partition(model, grid, tokens, overlap=name)
        if params0 is None:
            params0 = pm.init(jax.random.key(0), tokens)

        def loss_fn(p, pm=pm):
            return next_token_loss(pm.apply(p, tokens), tokens)

        @jax.jit
        def step(p, s, loss_fn=loss_fn):
            loss, grads = jax.value_and_grad(loss_fn)(p)
            updates, s = optimizer.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        compiled = step.lower(params0, optimizer.init(params0)).compile()
        windows = async_windows(compiled.as_text())
        pairs = Counter(w.kind for w in windows)
        overlapped = Counter(w.kind for w in windows if w.matmuls_inside)
        _, _, loss = compiled(params0, optimizer.init(params0))
        runs[name] = dict(step=compiled, loss=float(loss), times=[],
                          async_pairs=dict(pairs), with_matmul_inside=dict(overlapped))  # fmt: skip
    for _ in range(args.rounds):
        for name in SETTINGS:
            run = runs[name]
            p, s = params0, optimizer.init(params0)
            jax.block_until_ready(run["step"](p, s))
            start = time.perf_counter()
            for _ in range(args.steps):
                p, s, loss = run["step"](p, s)
            jax.block_until_ready(loss)
            run["times"].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(runs["none"]["times"])
    rows = []
    for name in SETTINGS:
        run = runs[name]
        rows.append(dict(setting=name, step_time_vs_none=statistics.median(run["times"]) / base,
                         loss=run["loss"], loss_equal=run["loss"] == runs["none"]["loss"],
                         async_pairs=run["async_pairs"],
                         with_matmul_inside=run["with_matmul_inside"]))  # fmt: skip
    return dict(backend=jax.default_backend(), devices=len(jax.devices()), grid=str(grid),
                model=f"GPT {args.layers}x{args.hidden}", rows=rows)  # fmt: skip


def markdown(result: dict) -> str:
    lines = [f"{result['model']} on {result['grid']} ({result['devices']} {result['backend']} devices)",
             "", "| setting | step time vs none | async pairs (with a matmul inside) | loss equal |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for r in result["rows"]:
        pairs = ", ".join(f"{k} {v} ({r['with_matmul_inside'].get(k, 0)})"
                          for k, v in sorted(r["async_pairs"].items())) or "none (synchronous)"  # fmt: skip
        lines.append(f"| {r['setting']} | {r['step_time_vs_none']:.3f} | {pairs} | {r['loss_equal']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    result = measure(args)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["loss_equal"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())

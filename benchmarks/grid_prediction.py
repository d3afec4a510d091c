"""Predicted vs measured step time over every 8-device grid of a GPT, on this machine.

1. Profile this machine's 8 (simulated) devices with the built-in micro-benchmark
   (collective bandwidth and latency by group shape, GEMM rate).
2. For every grid with x·y·z·data = 8 (pipeline 1) that divides the model,
   measure the step time of a ``pm.apply``-based jitted AdamW train step:
   rounds over all grids in a new random order each, a few steps per grid
   and round; the measurement is the best step (other processes on the
   machine only ever add time, and the rounds give every grid its chances
   at quiet moments). The median is reported too.
3. Predict each grid's step time (float32, no recompute, as measured) with
   the profile, and report Spearman's rank correlation and whether the
   predicted best grid is among the measured three fastest.

    .venv/bin/python benchmarks/grid_prediction.py [--rounds 5] [--out runs/grid_prediction.md]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

DEVICES = 8


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def build_steps(args, grids):
    """One compiled AdamW train step per grid (lowered in turn, compiled two at a time)."""
    import concurrent.futures

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import axonn_jax
    from axonn_jax.partitioner.grid import BATCH_AXES
    from axonn_jax.models import GPT, GPTConfig, next_token_loss

    config = GPTConfig(vocab_size=args.vocab, num_layers=args.layers, hidden=args.hidden,
                       num_heads=args.heads, max_seq_len=args.seq)  # fmt: skip
    model = GPT(config)
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    full = jax.tree.map(np.asarray, model.init(jax.random.key(0), tokens)["params"])
    optimizer = optax.adamw(1e-3)
    lowered = {}
    for grid in grids:
        pm = axonn_jax.partition(model, grid, jax.ShapeDtypeStruct(tokens.shape, jnp.int32))
        params = pm.shard(full)
        state = optimizer.init(params)
        batch = jax.device_put(tokens, NamedSharding(pm.mesh, P(BATCH_AXES)))

        def train_step(p, s, t, pm=pm):
            loss, grads = jax.value_and_grad(lambda q: next_token_loss(pm.apply(q, t), t))(p)
            updates, s = optimizer.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        lowered[grid] = (jax.jit(train_step).lower(params, state, batch), params, state, batch)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        compiled = dict(zip(lowered, pool.map(lambda lo: lo[0].compile(), lowered.values())))
    steps = {}
    for grid, (_, params, state, batch) in lowered.items():
        out = compiled[grid](params, state, batch)  # first run: warm-up
        jax.block_until_ready(out)
        steps[grid] = [compiled[grid], out[0], out[1], batch]
    return steps


def measure(steps, rounds: int, per_round: int) -> tuple[dict, dict]:
    """Per grid: (best, median) step seconds over all rounds, grids shuffled in each round."""
    import jax

    samples: dict = {g: [] for g in steps}
    order = list(steps)
    rng = random.Random(0)
    for r in range(rounds):
        rng.shuffle(order)
        for grid in order:
            compiled, params, state, batch = steps[grid]
            for _ in range(per_round):
                t0 = time.perf_counter()
                params, state, loss = compiled(params, state, batch)
                jax.block_until_ready(loss)
                samples[grid].append(time.perf_counter() - t0)
            steps[grid][1:3] = [params, state]
        print(f"  round {r + 1}/{rounds} done", flush=True)
    return ({g: min(v) for g, v in samples.items()},
            {g: statistics.median(v) for g, v in samples.items()})  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--profile", help="use this machine profile JSON instead of measuring one")
    ap.add_argument("--out", default="runs/grid_prediction.md")
    a = ap.parse_args(argv)

    import jax

    from axonn_jax.perf import machines
    from axonn_jax.perf.microbench import measure_machine
    from axonn_jax.perf.options import Options
    from axonn_jax.perf.spec import gpt_spec
    from axonn_jax.perf.step import predict
    from axonn_jax.search import grids as all_grids

    if len(jax.devices()) != DEVICES:
        sys.exit(f"needs {DEVICES} devices, found {len(jax.devices())}")
    t_start = time.perf_counter()
    if a.profile:
        machine = machines.load(a.profile)
    else:
        print("profiling this machine ...", flush=True)
        machine = measure_machine(jax.devices())
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        machines.save(machine, str(Path(a.out).with_suffix(".machine.json")))
    spec = gpt_spec(layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq,
                    batch=a.batch, vocab=a.vocab)  # fmt: skip
    candidates = list(all_grids(DEVICES, pipeline=False))
    grids = [g for g in candidates if not spec.problems(g)]
    options = Options(precision="fp32", recompute=False)
    predicted = {g: predict(spec, g, machine, options) for g in grids}
    print(f"compiling {len(grids)} grids ...", flush=True)
    t_compile = time.perf_counter()
    steps = build_steps(a, grids)
    t_compile = time.perf_counter() - t_compile
    print(f"measuring ({t_compile:.0f} s to compile) ...", flush=True)
    measured, medians = measure(steps, a.rounds, a.per_round)
    rho_median = spearman([predicted[g].step_seconds for g in grids], [medians[g] for g in grids])

    order = sorted(grids, key=lambda g: measured[g])
    rho = spearman([predicted[g].step_seconds for g in grids], [measured[g] for g in grids])
    best_predicted = min(grids, key=lambda g: predicted[g].step_seconds)
    rank_of_best = order.index(best_predicted) + 1
    lines = [
        f"# Predicted vs measured step time, {len(grids)} grids of {DEVICES} devices",
        "",
        f"Model: {spec.name}, {spec.num_params:,} parameters, float32, AdamW, no recompute. "
        f"Machine: {machine.name} ({machine.source}). Measured: best of {a.rounds} rounds × "
        f"{a.per_round} steps per grid, grids in a new random order each round (other processes "
        "on the machine only ever add time; the median is shown too).",
        "",
        f"**Spearman rank correlation: {rho:.3f}** (against the medians: {rho_median:.3f}); "
        f"predicted best {_g(best_predicted)} is measured #{rank_of_best} "
        f"({'in' if rank_of_best <= 3 else 'not in'} the measured top 3).",
        "",
        "| measured rank | grid (x,y,z,data) | measured ms | median ms | predicted ms "
        "| predicted rank | predicted compute ms | predicted comm ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    pred_order = sorted(grids, key=lambda g: predicted[g].step_seconds)
    for i, g in enumerate(order, 1):
        p = predicted[g]
        lines.append(
            f"| {i} | {_g(g)} | {measured[g] * 1e3:.1f} | {medians[g] * 1e3:.1f} | "
            f"{p.step_seconds * 1e3:.1f} | "
            f"{pred_order.index(g) + 1} | {p.compute_seconds * 1e3:.1f} | {p.comm_seconds * 1e3:.1f} |"
        )
    skipped = [g for g in candidates if g not in grids]
    if skipped:
        lines += ["", f"Not run (do not divide the model): {', '.join(_g(g) for g in skipped)}."]
    lines += ["", f"Compile {t_compile:.0f} s; total benchmark time "
              f"{time.perf_counter() - t_start:.0f} s."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)
    return {"spearman": rho, "spearman_median": rho_median, "best_rank": rank_of_best,
            "grids": len(grids)}  # fmt: skip


def _g(grid) -> str:
    return f"({grid.x},{grid.y},{grid.z},{grid.data})"


if __name__ == "__main__":
    main()

"""Stages overlap in one process: the asynchronous dispatch queue vs one task at a time.

One process drives 2 simulated CPU devices with ``Grid(pipeline=2)`` (one
stage per device). The model is compute-bound: a stack of dense layers whose
matrices are small enough that XLA:CPU runs each stage program on one core
(checked here: the process's CPU time per wall second while a single stage
computes), so two stages can keep the machine's two cores busy together.

Each round runs one training step (``pm.value_and_grad``, ``--microbatches``
microbatches, message-driven) with asynchronous dispatch and one with
``asynchronous=False`` (each task waited for before the next is picked: the
same tasks one after another), alternating which goes first; the figure is the
median over rounds of serial time / asynchronous time. The trace of the last
asynchronous step gives the time both stages computed at once.

    .venv/bin/python benchmarks/pipeline_async.py [--rounds 10] [--timeline runs/async.png]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="dense layers (half per stage)")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--rows", type=int, default=512, help="rows per microbatch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--timeline", default=None, help="write the async step's timeline PNG here")
    return p.parse_args(argv)


def _model(layers: int, width: int):
    import flax.linen as nn
    import jax.numpy as jnp

    class Tower(nn.Module):
        """Dense + tanh layers with a residual: compute in matmuls, nothing to gather."""

        @nn.compact
        def __call__(self, x):
            for i in range(layers):
                x = x + jnp.tanh(nn.Dense(width, name=f"dense_{i}")(x))
            return x

    return Tower()


def _cores_used(fn) -> float:
    """CPU seconds of this process per wall second while ``fn()`` runs."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return cpu / wall


def pipelined_mlp(args):
    """``(pm, params, batch, loss)``: the benchmark's MLP on ``Grid(pipeline=2)``, its batch of
    ``microbatches`` microbatches and a mean-squared loss (jax imported after XLA_FLAGS is set)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import axonn_jax

    rows = args.rows * args.microbatches
    x = np.random.default_rng(0).standard_normal((rows, args.width)).astype(np.float32)
    pm = axonn_jax.partition(_model(args.layers, args.width), axonn_jax.Grid(pipeline=DEVICES), x[: args.rows])

    def loss(out, batch):
        return jnp.mean((out - batch) ** 2)

    return pm, pm.init(jax.random.key(0)), x, loss


def main(argv=None) -> dict:
    args = parse_args(argv)
    pm, params, x, loss = pipelined_mlp(args)  # first: it sets XLA_FLAGS
    import jax
    import numpy as np

    from axonn_jax.runtime.pipeline import timeline

    m = args.microbatches
    steps = {mode: pm.value_and_grad(loss, inputs=lambda b: (b,), microbatches=m,
                                     asynchronous=mode == "async")
             for mode in ("async", "serial")}  # fmt: skip
    results = {}
    for mode, step in steps.items():  # compile and warm up
        for _ in range(2):
            results[mode] = step(params, x)
    np.testing.assert_array_equal(np.asarray(results["async"][0]), np.asarray(results["serial"][0]))
    for a, b in zip(jax.tree.leaves(results["async"][1]), jax.tree.leaves(results["serial"][1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same results, bit for bit

    # one task at a time: how many cores does one stage program keep busy?
    one_stage = _cores_used(lambda: [jax.block_until_ready(steps["serial"](params, x)) for _ in range(2)])

    times: dict[str, list[float]] = {"async": [], "serial": []}
    for r in range(args.rounds):
        order = ("async", "serial") if r % 2 == 0 else ("serial", "async")
        for mode in order:
            start = time.perf_counter()
            jax.block_until_ready(steps[mode](params, x))
            times[mode].append(time.perf_counter() - start)
    ratios = [s / a for s, a in zip(times["serial"], times["async"])]
    rows = steps["async"].trace()
    serial_rows = steps["serial"].trace()
    if args.timeline:
        timeline.plot_timeline(args.timeline, rows, "one process, pipeline=2, asynchronous dispatch")
    span = max(r[5] for r in rows) - min(r[4] for r in rows)
    result = {
        "speedup": statistics.median(ratios),
        "ratios": ratios,
        "async_s": statistics.median(times["async"]),
        "serial_s": statistics.median(times["serial"]),
        "overlap_s": timeline.concurrent_seconds(rows),
        "span_s": span,
        "serial_overlap_s": timeline.concurrent_seconds(serial_rows),
        "idle": timeline.idle_fractions(rows),
        "serial_idle": timeline.idle_fractions(serial_rows),
        "cores_serial": one_stage,
        "microbatches": m, "layers": args.layers, "width": args.width, "rows": args.rows,
        "rounds": args.rounds,
    }  # fmt: skip
    print(table(result))
    return result


def table(r: dict) -> str:
    """The markdown report of :func:`main`'s result (also after a JSON round trip)."""

    def idle(key: str) -> str:
        per_stage = {int(stage): value for stage, value in r[key].items()}
        return " / ".join(f"{per_stage[s]:.2f}" for s in sorted(per_stage))

    return "\n".join([
        f"One process, 2 CPU devices, `Grid(pipeline=2)`, dense tower {r['layers']}×{r['width']}, "
        f"{r['microbatches']} microbatches of {r['rows']} rows, message-driven; median of "
        f"{r['rounds']} alternating rounds:", "",
        "| dispatch | step time | stages computing at once | idle stage 0 / 1 |",
        "| --- | --- | --- | --- |",
        f"| one task at a time (`asynchronous=False`) | ({r['serial_s'] * 1e3:.1f} ms) | "
        f"{r['serial_overlap_s'] * 1e3:.1f} ms | {idle('serial_idle')} |",
        f"| asynchronous | ({r['async_s'] * 1e3:.1f} ms) | {r['overlap_s'] * 1e3:.1f} ms of "
        f"{r['span_s'] * 1e3:.1f} ms | {idle('idle')} |", "",
        f"**Speedup {r['speedup']:.2f}×** (serial / asynchronous step time, ideal "
        f"{2 * r['microbatches'] / (r['microbatches'] + 1):.2f}×); the serial step kept "
        f"{r['cores_serial']:.2f} cores busy on average.",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

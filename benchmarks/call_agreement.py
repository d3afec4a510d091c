"""The cost of the call agreement on a pipelined train step: with it ÷ without it.

Every pipelined call first agrees on its inputs across processes
(``runtime/agreement.py``: one bounded 1 KiB allgather per call). This
times a pipelined step with the agreement on and patched out, in blocks of
``--steps`` steps that alternate (the order flips every block), ``--blocks``
blocks each; the figure is the median block's step time with it over the
median without it, in one process (8 devices: the agreement returns at once)
and under ``mpiexec -n 2`` (4 devices each, one stage each). Model: a 4-layer
MLP of width 128 on ``pipeline=2,x=2,z=2``, batch 32, 4 microbatches, SGD.

    .venv/bin/python benchmarks/call_agreement.py [--blocks 10] [--steps 20]
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
from mpi_launch import PREFIX, is_worker, relaunch  # noqa: E402

FLAG = "AXONN_CALL_AGREEMENT_WORKER"
#: (label, processes)
CONFIGS = (("one process", 1), ("mpiexec -n 2", 2))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=10, help="blocks of steps with and without, each")
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    return p.parse_args(argv)


def worker(args) -> None:
    """One configuration: every rank trains, alternating blocks; rank 0 prints the medians."""
    import axonn_jax

    grid = axonn_jax.Grid(pipeline=2, x=2, z=2)
    info = axonn_jax.init(grid=grid)
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from axonn_jax.runtime.pipeline import training

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(4):
                x = nn.gelu(nn.Dense(128, name=f"dense_{i}")(x))
            return nn.Dense(8, name="out")(x)

    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((32, 8)).astype(np.float32))
    pm = axonn_jax.partition(Net(), grid, batch[0])
    step = pm.train_step(lambda out, b: jnp.mean((out - b[1]) ** 2), optax.sgd(0.01), microbatches=4,
                         inputs=lambda b: b[:1])  # fmt: skip
    params, opt_state = step.init(pm.init(jax.random.key(0)))
    for _ in range(5):  # compile and warm up
        params, opt_state, loss = step(params, opt_state, batch)
    agree = training.agree_on_call
    times: dict[str, list[float]] = {"on": [], "off": []}
    for k in range(args.blocks):
        for mode in ("on", "off") if k % 2 == 0 else ("off", "on"):
            training.agree_on_call = agree if mode == "on" else (lambda *a, **kw: None)
            start = time.perf_counter()
            for _ in range(args.steps):
                params, opt_state, loss = step(params, opt_state, batch)
            float(loss)  # the block's end: the loss is on the host
            times[mode].append((time.perf_counter() - start) / args.steps)
    training.agree_on_call = agree
    if info.is_main:
        print(PREFIX + json.dumps({"on_s": statistics.median(times["on"]),
                                   "off_s": statistics.median(times["off"])}), flush=True)  # fmt: skip


# --------------------------------------------------------------------- launcher side


def table(result: dict) -> str:
    """The markdown table of a :func:`main` result."""
    lines = [f"`pipeline=2,x=2,z=2`, a 4×128 MLP, 4 microbatches; median of {result['blocks']} "
             f"alternating blocks × {result['steps']} steps (load average {result['load'][0]:.1f}):", "",
             "| configuration | step with the agreement / without | with | without |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for c in result["configs"]:
        lines.append(f"| {c['label']} | **{c['ratio']:.2f}** | ({c['on_s'] * 1e3:.1f} ms) | "
                     f"({c['off_s'] * 1e3:.1f} ms) |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if is_worker(FLAG):
        worker(args)
        return {}
    given = argv if argv is not None else sys.argv[1:]
    configs = []
    for label, processes in CONFIGS:
        run = relaunch(__file__, processes, list(given), FLAG, timeout=1200, devices_per_process=8 // processes)
        configs.append({"label": label, "ratio": run["on_s"] / run["off_s"], **run})
    result = {"blocks": args.blocks, "steps": args.steps, "configs": configs, "load": os.getloadavg()}
    result["table"] = table(result)
    print(result["table"])
    return result


if __name__ == "__main__":
    main()

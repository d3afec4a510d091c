"""Device-resident model state per parameter, with and without host offload.

GPT on 8 simulated CPU devices (grid x=2, z=2, data=2), or on the GPUs of the
machine with ``JAX_PLATFORMS=cuda`` and a ``--grid`` of their number, AdamW, the user's own
jitted step (donating parameters and state). For each configuration:

* parameters θ, master weights and optimizer state: live arrays on one device,
  split by memory kind (``device`` / ``pinned_host``);
* gradients ∇θ: output bytes of the compiled gradient program;
* buffers: temporaries of the compiled update program (streaming buckets);
* the whole step: ``memory_analysis()`` of the compiled step, arguments split
  into device and host memory;
* step time: median over interleaved rounds, as a ratio to fp32 on the device
  measured in the same run.

    .venv/bin/python benchmarks/memory_offload.py [--layers 8 --hidden 256 --steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

CONFIGS = {
    "fp32, on device": dict(precision="fp32"),
    "bf16, on device": dict(precision="bf16"),
    "bf16, offload, update on host": dict(precision="bf16", offload=True, update_on="host"),
    "bf16, offload, streamed buckets": dict(precision="bf16", offload=True, update_on="device"),
    "bf16, offload, streamed, prefetch": dict(precision="bf16", offload=True, update_on="device", prefetch=True),
}
#: ``--configs`` names: fp32 on device (the baseline) always runs.
SHORT = dict(zip(("fp32", "bf16", "host", "streamed", "prefetch"), CONFIGS))


def measure(layers: int, hidden: int, batch: int, seq: int, steps: int, bucket_bytes: int, grid: str,
            dtype: str = "float32", configs: tuple[str, ...] = tuple(SHORT)) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import axonn_jax
    from axonn_jax.runtime.memory import MeasuredMemory, array_bytes, compiled_bytes, local_param_count
    from axonn_jax.models import GPT, GPTConfig, next_token_loss
    from axonn_jax.runtime.master_optimizer import MasterOptimizer
    from axonn_jax.runtime.precision import as_planned

    config = GPTConfig(vocab_size=256, num_layers=layers, hidden=hidden,
                       num_heads=max(1, hidden // 64), max_seq_len=seq, dtype=getattr(jnp, dtype))  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, 256, (batch, seq)).astype(np.int32)
    pm = axonn_jax.partition(GPT(config), axonn_jax.Grid.parse(grid), tokens)
    initial = pm.init(jax.random.key(0))
    n = local_param_count(initial, pm.param_shardings)
    loss_of = lambda p, t: next_token_loss(pm.apply(as_planned(p, pm.plan), t), t)  # noqa: E731

    results, runs, reports = {}, {}, {}
    chosen = {SHORT[c] for c in ("fp32", *configs)}
    for name, options in CONFIGS.items():
        if name not in chosen:
            continue
        opt = MasterOptimizer(optax.adamw(1e-3), pm.param_shardings, bucket_bytes=bucket_bytes, **options)
        params, state = opt.init(initial)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, state, t, opt=opt):
            loss, grads = jax.value_and_grad(loss_of)(params, t)
            params, state = opt.update(grads, state, params)
            return params, state, loss

        update = jax.jit(lambda g, s, p, opt=opt: opt.update(g, s, p), donate_argnums=(1, 2))
        grads_shape = jax.eval_shape(jax.grad(loss_of), params, tokens)
        grad_program = compiled_bytes(jax.jit(jax.grad(loss_of)).lower(params, tokens).compile())
        update_program = compiled_bytes(update.lower(grads_shape, state, params).compile())
        step_program = compiled_bytes(step.lower(params, state, tokens).compile())
        for _ in range(2):  # run, so the live arrays are the step's outputs
            params, state, loss = step(params, state, tokens)
        master = array_bytes(state.master) if state.master is not None else array_bytes([])
        inner = array_bytes(state.inner)
        live = {"params": array_bytes(params), "master": master, "optimizer": inner}
        row = {
            "params": live["params"].device / n,
            "grads": grad_program["outputs"].device / n,
            "master+opt device": (master.device + inner.device) / n,
            "buffers": update_program["temp"].device / n,
            "host": (live["params"].host + master.host + inner.host) / n,
            "step args device": step_program["arguments"].device / n,
            "step args host": step_program["arguments"].host / n,
            "step temp": step_program["temp"].device / n,
        }
        row["model state device"] = row["params"] + row["grads"] + row["master+opt device"] + row["buffers"]
        report = MeasuredMemory.measure(opt, params, state, extra={"grads": grad_program["outputs"],
                                                                 "buffers": update_program["temp"]})
        row["planned model state device"] = report.model_state_per_param("device", "planned")
        results[name] = row
        reports[name] = report
        runs[name] = [step, params, state, []]

    for i in range(steps + 2):  # interleaved rounds; the first two are warm-up
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            step, params, state, times = runs[name]
            t0 = time.perf_counter()
            params, state, loss = step(params, state, tokens)
            loss.block_until_ready()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            runs[name][1:3] = [params, state]
    base = statistics.median(runs["fp32, on device"][3])
    same_precision = statistics.median(runs.get("bf16, on device", runs["fp32, on device"])[3])
    for name in runs:
        results[name]["step ms"] = statistics.median(runs[name][3]) * 1e3
        results[name]["time ratio"] = statistics.median(runs[name][3]) / base
        results[name]["time vs bf16 on device"] = statistics.median(runs[name][3]) / same_precision
    return {"results": results, "reports": reports, "params": config.num_params(), "per_device": n,
            "grid": grid}


def table(result: dict) -> str:
    cols = ["params", "grads", "master+opt device", "buffers", "model state device",
            "planned model state device", "host", "step args device", "step args host",
            "time ratio", "time vs bf16 on device"]  # fmt: skip
    lines = ["| configuration | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for name, row in result["results"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bucket-bytes", type=int, default=128 * 1024)
    ap.add_argument("--grid", default="x=2,z=2,data=2")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's compute dtype (parameters are stored as each configuration says)")
    ap.add_argument("--configs", default=",".join(SHORT),
                    help=f"comma-separated configurations out of {', '.join(SHORT)} (fp32 always runs; "
                         "'time vs bf16 on device' is against fp32 when bf16 does not run)")
    a = ap.parse_args(argv)
    configs = tuple(c for c in a.configs.split(",") if c)
    if unknown := [c for c in configs if c not in SHORT]:
        ap.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(SHORT)}")
    result = measure(a.layers, a.hidden, a.batch, a.seq, a.steps, a.bucket_bytes, a.grid, a.dtype, configs)
    print(f"GPT {a.layers}L/{a.hidden}H, {result['params']:,} parameters, {result['per_device']:,} "
          f"per device on {a.grid}; bytes per parameter per device; time ratio = median step "
          f"time / fp32-on-device (median of {a.steps} interleaved steps)")  # fmt: skip
    print(table(result))
    print("median step ms: " + "; ".join(f"{name} {row['step ms']:.1f}" for name, row in result["results"].items()))
    rows = result["results"]
    for name in ("bf16, offload, streamed buckets", "bf16, offload, streamed, prefetch"):
        if name in rows:
            print(f"{name}: {result['reports'][name]}")
    offloaded_rows = [rows[n] for n in ("bf16, offload, update on host", "bf16, offload, streamed buckets")
                      if n in rows]  # fmt: skip
    if not offloaded_rows:
        return result
    fp32 = rows["fp32, on device"]
    base, persistent = fp32["model state device"], fp32["model state device"] - fp32["buffers"]
    offloaded = max(row["model state device"] for row in offloaded_rows)
    planned = max(row["planned model state device"] for row in offloaded_rows)
    print(f"device model state, fp32 on device: {base:.2f} B/param measured ({persistent:.2f} for "
          f"θ+∇θ+m+v without the update's temporaries); bf16 offloaded: {offloaded:.2f} measured, "
          f"{planned:.2f} planned (with the streamed update's bucket buffers). Cut: "
          f"{base / offloaded:.2f}x measured, {persistent / offloaded:.2f}x on θ+∇θ+m+v, "
          f"{persistent / planned:.2f}x with planned buckets")  # fmt: skip
    return result


if __name__ == "__main__":
    main()

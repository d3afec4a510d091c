"""Model FLOPs utilisation (MFU) of a GPT train step on the GPUs of this machine.

FLOPs of one step from the model (``GPTConfig.flops_per_token``, the IPDPS'22
count, here without activation recompute since none is done)
and, as a cross-check, from XLA's cost analysis of the compiled step; divided
by the median step time and by ``--peak-tflops`` × the number of GPUs. Two
steps on the same devices, interleaved: axonn_jax on ``Grid(data=n)`` and the
plain ``jax.jit`` step with the batch split over the same devices (GSPMD data
parallelism); their step-time ratio is reported too.

Without a GPU it returns ``{"skipped": "no GPU here ..."}``; ``--allow-cpu``
runs the same measurement on CPU devices (to test this script).

    .venv/bin/python benchmarks/gpu_mfu.py --peak-tflops 989 [--layers 12 --hidden 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak dense TFLOP/s of one device in --dtype (MFU needs it)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="sequences per device")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--allow-cpu", action="store_true", help="measure on CPU devices too")
    return ap.parse_args(argv)


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import axonn_jax
    from axonn_jax.partitioner.grid import BATCH_AXES
    from axonn_jax.models import GPT, GPTConfig, next_token_loss

    devices = jax.devices()
    n = len(devices)
    config = GPTConfig(vocab_size=args.vocab, num_layers=args.layers, hidden=args.hidden,
                       num_heads=args.heads, max_seq_len=args.seq,
                       dtype=getattr(jnp, args.dtype))  # fmt: skip
    model = GPT(config)
    batch = args.batch * n
    tokens = np.random.default_rng(0).integers(0, args.vocab, (batch, args.seq)).astype(np.int32)
    abstract = jax.ShapeDtypeStruct(tokens.shape, jnp.int32)
    pm = axonn_jax.partition(model, axonn_jax.Grid(data=n), abstract)
    optimizer = optax.adamw(1e-4)

    def make(apply, params, batch_sharding):
        def step(p, s, t):
            loss, grads = jax.value_and_grad(lambda q: next_token_loss(apply(q, t), t))(p)
            updates, s = optimizer.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        state = optimizer.init(params)
        t = jax.device_put(tokens, batch_sharding)
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, t).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return [compiled, params, state, t, float(cost.get("flops", 0.0)) * n]

    ours = pm.init(jax.random.key(0))
    mesh = Mesh(np.asarray(devices), ("data",))
    plain_params = jax.device_put(jax.tree.map(np.asarray, pm.gather(ours)), NamedSharding(mesh, P()))
    runs = {"axonn": make(pm.apply, ours, NamedSharding(pm.mesh, P(BATCH_AXES))),
            "plain": make(lambda p, t: model.apply({"params": p}, t), plain_params,
                          NamedSharding(mesh, P("data")))}  # fmt: skip
    times: dict = {name: [] for name in runs}
    for i in range(args.steps + 2):
        for name in ("axonn", "plain") if i % 2 == 0 else ("plain", "axonn"):
            compiled, p, s, t, _ = runs[name]
            t0 = time.perf_counter()
            p, s, loss = compiled(p, s, t)
            jax.block_until_ready(loss)
            if i >= 2:  # the first two rounds warm up
                times[name].append(time.perf_counter() - t0)
            runs[name][1:3] = [p, s]
    model_flops = config.flops_per_token(args.seq, activation_recompute=False) * batch * args.seq
    result = {"device": devices[0].device_kind, "devices": n, "platform": devices[0].platform,
              "params": config.num_params(), "model_flops": model_flops,
              "peak_tflops": args.peak_tflops, "dtype": args.dtype}  # fmt: skip
    for name, (_, _, _, _, xla_flops) in runs.items():
        step_s = statistics.median(times[name])
        row = {"step_s": step_s, "xla_flops": xla_flops,
               "tflops_per_device": model_flops / step_s / n / 1e12}  # fmt: skip
        if args.peak_tflops:
            row["mfu"] = row["tflops_per_device"] / args.peak_tflops
        result[name] = row
    result["ratio"] = result["axonn"]["step_s"] / result["plain"]["step_s"]
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax

    platform = jax.devices()[0].platform
    if platform != "gpu" and not args.allow_cpu:
        print(f"no GPU here (JAX platform {platform!r}); MFU not measured")
        return {"skipped": f"no GPU here (JAX platform {platform})"}
    r = measure(args)
    for name in ("axonn", "plain"):
        row = r[name]
        mfu = f"MFU {row['mfu']:.1%}" if "mfu" in row else "MFU needs --peak-tflops"
        print(f"{name:6s} {row['tflops_per_device']:.1f} TFLOP/s per device ({mfu}); model FLOPs "
              f"{r['model_flops']:.3g}, XLA cost analysis {row['xla_flops']:.3g}")  # fmt: skip
    print(f"step time axonn_jax / plain jax.jit: {r['ratio']:.3f} on {r['devices']}× {r['device']}")
    return r


if __name__ == "__main__":
    main()

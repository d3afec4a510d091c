"""Overhead of axonn_jax on one device: pm.apply train step vs the plain Flax/optax step.

Both train steps are the user's own ``jax.jit``-ed code (AdamW, next-token
loss) on the same GPT and the same batches, timed alternately in the same
process; reports the median step time of each and their ratio (goal ≤ 1.01).

    .venv/bin/python benchmarks/partition_overhead.py [--steps 30] [--hidden 256]
"""

from __future__ import annotations

import argparse
import statistics
import time


def measure(steps: int, hidden: int, layers: int, batch: int, seq: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import axonn_jax
    from axonn_jax.models import GPT, GPTConfig, next_token_loss

    config = GPTConfig(vocab_size=256, num_layers=layers, hidden=hidden,
                       num_heads=max(1, hidden // 64), max_seq_len=seq)  # fmt: skip
    model = GPT(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, seq)), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    pm = axonn_jax.partition(model, axonn_jax.Grid(), tokens)
    pm_params = pm.shard(jax.tree.map(np.asarray, params))
    optimizer = optax.adamw(1e-3)

    def make_step(apply):
        @jax.jit
        def step(p, s, t):
            loss, grads = jax.value_and_grad(lambda q: next_token_loss(apply(q, t), t))(p)
            updates, s = optimizer.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        return step

    plain = make_step(lambda p, t: model.apply({"params": p}, t))
    ours = make_step(pm.apply)
    states = {"plain": [params, optimizer.init(params)], "axonn": [pm_params, optimizer.init(pm_params)]}
    steps_fn = {"plain": plain, "axonn": ours}
    times = {"plain": [], "axonn": []}
    for i in range(steps + 3):
        for name in ("plain", "axonn") if i % 2 == 0 else ("axonn", "plain"):
            p, s = states[name]
            t0 = time.perf_counter()
            p, s, loss = steps_fn[name](p, s, tokens)
            loss.block_until_ready()
            if i >= 3:  # skip compilation and warm-up
                times[name].append(time.perf_counter() - t0)
            states[name] = [p, s]
    plain_t, ours_t = statistics.median(times["plain"]), statistics.median(times["axonn"])
    return {"plain_s": plain_t, "axonn_s": ours_t, "ratio": ours_t / plain_t,
            "params": config.num_params(), "steps": steps}  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args(argv)
    result = measure(a.steps, a.hidden, a.layers, a.batch, a.seq)
    print(f"grid all-1, GPT {a.layers}L/{a.hidden}H ({result['params']:,} params), "
          f"median of {a.steps} steps: plain {result['plain_s']*1e3:.2f} ms, "
          f"axonn_jax {result['axonn_s']*1e3:.2f} ms, ratio {result['ratio']:.3f}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()

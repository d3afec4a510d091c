"""Cost of ``pm.report()`` next to ``partition()``, and the report next to XLA's numbers.

1. A large GPT (default: the ~87B of ``planning_time.py``) for 1,024 GPUs from
   abstract shapes: seconds of ``partition()`` and of the first
   ``pm.report()``, and their ratio (both measured in this run).
2. ``--compare``: a small GPT on 8 simulated CPU devices, per grid: wire bytes
   of the report vs the compiled train step's HLO (the loss's scalar
   all-reduce included on the HLO side), and bytes kept for backward vs
   ``memory_analysis().temp_size_in_bytes`` of the compiled step.

    .venv/bin/python benchmarks/report_time.py [--layers 48] [--compare]
"""

from __future__ import annotations

import argparse
import os
import time

GRIDS = ["x=2,y=2,z=2", "x=4,z=2", "y=2,z=2,data=2", "z=8", "data=8"]


def main(argv=None) -> dict:
    from planning_time import add_model_arguments, plan_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--compare", action="store_true", help="also compare with compiled programs")
    a = ap.parse_args(argv)
    if a.compare:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    pm, config, grid, partition_s = plan_model(a)
    t1 = time.perf_counter()
    report = pm.report()
    t2 = time.perf_counter()
    result = {"partition_s": partition_s, "report_s": t2 - t1, "ratio": (t2 - t1) / partition_s}
    comm, mem = report.communication, report.memory
    print(f"GPT {a.layers}L/{a.hidden}H ({config.num_params() / 1e9:.1f}B params) on {grid}: "
          f"partition {result['partition_s']:.1f} s, report {result['report_s']:.1f} s "
          f"(report / partition = {result['ratio']:.2f}); per device and step "
          f"{comm.wire_bytes / 2**30:.1f} GiB on the wire in {comm.count} collectives, "
          f"{mem.activations / 2**30:.1f} GiB activations kept")  # fmt: skip
    if a.compare:
        result["compare"] = [_compare(g) for g in GRIDS]
    return result


def _compare(grid_text: str) -> dict:
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import axonn_jax
    from axonn_jax.partitioner.grid import BATCH_AXES
    from axonn_jax.models import GPT, GPTConfig, next_token_loss
    from axonn_jax.runtime.hlo import collectives

    config = GPTConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=4, max_seq_len=16)
    tokens = np.random.default_rng(0).integers(0, 64, (8, 16)).astype(np.int32)
    pm = axonn_jax.partition(GPT(config), axonn_jax.Grid.parse(grid_text), tokens)
    report = pm.report()
    params = pm.init(jax.random.key(0))
    optimizer = optax.adamw(1e-2)

    def step(p, s, t):
        loss, g = jax.value_and_grad(lambda q: next_token_loss(pm.apply(q, t), t))(p)
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    batch = jax.device_put(tokens, NamedSharding(pm.mesh, P(BATCH_AXES)))
    compiled = jax.jit(step).lower(params, optimizer.init(params), batch).compile()
    hlo_wire = sum(op.wire_bytes for op in collectives(compiled.as_text()) if not op.trivial)
    kept = report.memory.activations + report.memory.gathered_weights
    temp = compiled.memory_analysis().temp_size_in_bytes
    row = {"grid": grid_text, "report_wire": report.communication.wire_bytes,
           "hlo_wire": hlo_wire, "kept": kept, "xla_temp": temp}  # fmt: skip
    print(f"  {grid_text:16s} wire bytes: report {row['report_wire']:>10,.0f}  HLO "
          f"{hlo_wire:>10,.0f} (incl. loss mean)  kept for backward {kept:>9,}  "
          f"XLA temp {temp:>9,}")  # fmt: skip
    return row


if __name__ == "__main__":
    main()

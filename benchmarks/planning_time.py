"""Planning time: partition a large GPT for a large grid from abstract shapes only.

Default: 48 layers, hidden 12288, 96 heads, sequence 2048, vocabulary 51200
(~87B parameters) for 1,024 GPUs as Grid(x=8, y=4, z=4, data=8). Nothing is
allocated: the example input is a ShapeDtypeStruct.

    .venv/bin/python benchmarks/planning_time.py [--layers 48] [--hidden 12288]
"""

from __future__ import annotations

import argparse
import time


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The large GPT (87.6B parameters) and 1,024-device grid these benchmarks plan."""
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=51200)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--grid", default="x=8,y=4,z=4,data=8")


def plan_model(a: argparse.Namespace):
    """``(pm, config, grid, seconds of partition())`` for the model of ``add_model_arguments``."""
    import jax
    import jax.numpy as jnp

    import axonn_jax
    from axonn_jax.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=a.vocab, num_layers=a.layers, hidden=a.hidden,
                       num_heads=a.heads, max_seq_len=a.seq)  # fmt: skip
    grid = axonn_jax.Grid.parse(a.grid)
    tokens = jax.ShapeDtypeStruct((a.batch, a.seq), jnp.int32)
    t0 = time.perf_counter()
    pm = axonn_jax.partition(GPT(config), grid, tokens)
    return pm, config, grid, time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    a = ap.parse_args(argv)
    pm, config, grid, seconds = plan_model(a)
    plan = pm.plan
    result = {"seconds": seconds, "params": config.num_params(), "gpus": grid.size,
              "bytes_per_device": plan.param_bytes_per_device,
              "warnings": len(plan.warnings)}  # fmt: skip
    print(f"planned GPT {a.layers}L/{a.hidden}H ({config.num_params()/1e9:.1f}B params) for "
          f"{grid} ({grid.size} GPUs) in {seconds:.1f} s; fp32 params per device "
          f"{plan.param_bytes_per_device/2**30:.2f} GiB of {plan.total_param_bytes/2**30:.0f} GiB; "
          f"{len(plan.warnings)} warnings")  # fmt: skip
    return result


if __name__ == "__main__":
    main()

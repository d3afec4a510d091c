"""Checkpoint cost: axonn_jax.checkpoint against orbax's standard PyTree checkpoint.

Saves the parameters and AdamW state of a GPT laid out on x=2, y=2, z=2
(8 simulated CPU devices) to a temporary directory, alternating in the same
process between

* ``axonn_jax`` asynchronous save: time until ``save()`` returns (training
  could go on from here) and until the step is committed;
* ``orbax`` baseline: ``CheckpointManager`` with ``StandardSave`` of the same
  pytree (synchronous), and its ``StandardRestore`` onto the same shardings;
* ``axonn_jax`` restore onto the same shardings.

Reports medians and the ratios against the orbax baseline.

    .venv/bin/python benchmarks/checkpoint_save.py [--repeats 5] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def measure(repeats: int, hidden: int, layers: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp

    import axonn_jax
    from axonn_jax.checkpoint import Checkpointer
    from axonn_jax.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=256, num_layers=layers, hidden=hidden,
                          num_heads=max(1, hidden // 64), max_seq_len=64))  # fmt: skip
    pm = axonn_jax.partition(model, axonn_jax.Grid(x=2, y=2, z=2), jnp.zeros((8, 64), jnp.int32))
    optimizer = optax.adamw(1e-3)
    params = pm.init(jax.random.key(0))
    opt_state = optimizer.init(params)
    state = {"params": params, "opt_state": opt_state}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in ("returns", "committed", "orbax_save", "restore", "orbax_restore")}  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        ours = Checkpointer(Path(root) / "axonn", max_to_keep=2)
        theirs = ocp.CheckpointManager(Path(root) / "orbax",
                                       options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False))  # fmt: skip
        for step in range(repeats + 1):  # step 0 warms up both
            t0 = time.perf_counter()
            ours.save(step, params, opt_state)
            t1 = time.perf_counter()
            ours.wait()
            t2 = time.perf_counter()
            theirs.save(step, args=ocp.args.StandardSave(state), force=True)
            t3 = time.perf_counter()
            ours.restore(step, params=pm.param_shardings, optimizer=optimizer)
            t4 = time.perf_counter()
            restored = theirs.restore(step, args=ocp.args.StandardRestore(abstract))
            jax.block_until_ready(restored)
            t5 = time.perf_counter()
            if step:
                for key, value in zip(times, (t1 - t0, t2 - t0, t3 - t2, t4 - t3, t5 - t4)):
                    times[key].append(value)
        ours.close()
        theirs.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(
        bytes=nbytes,
        **med,
        returns_vs_orbax=med["returns"] / med["orbax_save"],
        committed_vs_orbax=med["committed"] / med["orbax_save"],
        restore_vs_orbax=med["restore"] / med["orbax_restore"],
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    result = measure(args.repeats, args.hidden, args.layers)
    print(f"state {result['bytes'] / 1e6:.1f} MB (params + AdamW), median of {args.repeats}:")
    print(f"  axonn_jax save() returns  {result['returns'] * 1e3:8.1f} ms  "
          f"({result['returns_vs_orbax']:.2f}× orbax synchronous save)")  # fmt: skip
    print(f"  axonn_jax save committed  {result['committed'] * 1e3:8.1f} ms  "
          f"({result['committed_vs_orbax']:.2f}× orbax)")  # fmt: skip
    print(f"  orbax StandardSave        {result['orbax_save'] * 1e3:8.1f} ms")
    print(f"  axonn_jax restore         {result['restore'] * 1e3:8.1f} ms  "
          f"({result['restore_vs_orbax']:.2f}× orbax)")  # fmt: skip
    print(f"  orbax StandardRestore     {result['orbax_restore'] * 1e3:8.1f} ms")
    return result


if __name__ == "__main__":
    main()

"""Checkpoint cost: axonn_jax.checkpoint against orbax's standard PyTree checkpoint.

Saves the parameters and AdamW state of a GPT laid out on x=2, y=2, z=2
(8 simulated CPU devices) to a temporary directory, alternating in the same
process between

* ``axonn_jax``: ``Checkpointer.save`` (asynchronous), timed until ``save()``
  returns (training could go on from here) and until the step is committed;
  then ``restore`` onto the same shardings, until the arrays are ready;
* ``orbax`` baseline, configured alike: ``CheckpointManager`` with asynchronous
  checkpointing and ``StandardSave`` of the same pytree, timed the same two
  ways, and ``StandardRestore`` onto the same shardings until ready.

Reports medians and like-for-like ratios (returns / returns, committed /
committed, restore / restore); which library goes first alternates.

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
    keys = ("returns", "committed", "restore", "orbax_returns", "orbax_committed", "orbax_restore")
    times: dict[str, list[float]] = {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as root:
        ours = Checkpointer(Path(root) / "axonn", max_to_keep=2)
        theirs = ocp.CheckpointManager(Path(root) / "orbax",
                                       options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True))  # fmt: skip

        def axonn(step):
            t0 = time.perf_counter()
            ours.save(step, params, opt_state)
            t1 = time.perf_counter()
            ours.wait()
            t2 = time.perf_counter()
            restored = ours.restore(step, params=pm.param_shardings, optimizer=optimizer)
            jax.block_until_ready((restored.params, restored.opt_state))
            return t1 - t0, t2 - t0, time.perf_counter() - t2

        def orbax(step):
            t0 = time.perf_counter()
            theirs.save(step, args=ocp.args.StandardSave(state), force=True)
            t1 = time.perf_counter()
            theirs.wait_until_finished()
            t2 = time.perf_counter()
            jax.block_until_ready(theirs.restore(step, args=ocp.args.StandardRestore(abstract)))
            return t1 - t0, t2 - t0, time.perf_counter() - t2

        for step in range(repeats + 1):  # step 0 warms up both
            first, second = (axonn, orbax) if step % 2 else (orbax, axonn)
            measured = {first: first(step), second: second(step)}
            if step:
                for key, value in zip(keys, (*measured[axonn], *measured[orbax])):
                    times[key].append(value)
        ours.close()
        theirs.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(
        bytes=nbytes,
        **med,
        returns_vs_orbax=med["returns"] / med["orbax_returns"],
        committed_vs_orbax=med["committed"] / med["orbax_committed"],
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
    print(f"state {result['bytes'] / 1e6:.1f} MB (params + AdamW), median of {args.repeats}, "
          "both asynchronous:")  # fmt: skip
    for what, key in (("save() returns", "returns"), ("save committed", "committed"),
                      ("restore (ready)", "restore")):  # fmt: skip
        print(f"  {what:16} axonn_jax {result[key] * 1e3:8.1f} ms  orbax {result['orbax_' + key] * 1e3:8.1f} ms"
              f"  ratio {result[key + '_vs_orbax']:.2f}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()

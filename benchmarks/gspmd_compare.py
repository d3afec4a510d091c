"""axonn_jax 4D grids vs JAX's automatic sharding (GSPMD): collectives, memory, step time.

The same GPT, the same batch and the same jitted AdamW train step (parameters
and optimizer state donated, in/out shardings pinned to the layout) on 8
simulated CPU devices, three ways:

* **axonn_jax** on several 4D grids (``pm.apply`` inside the user's ``jax.jit``);
* **GSPMD Megatron**: plain ``jax.jit`` with hand-written 1D tensor-parallel
  specs (:func:`gspmd_specs.megatron_specs`) on a ``(dp, tp)`` mesh, batch split
  over ``dp`` only; ``tp=1, dp=8`` is pure data parallelism, the baseline;
* **GSPMD FSDP**: every parameter split over 8 on its largest dim, batch split
  over 8 (:func:`gspmd_specs.fsdp_specs`).

Per approach: collectives of the compiled step (count and per-device ring wire
bytes by kind, from the HLO via ``runtime/hlo.py``), per-device memory
(``memory_analysis()`` of the compiled step, and parameter / optimizer-state
bytes of the live sharded arrays), and the median step time over rounds in
which the approaches run interleaved (new random order each round), as a ratio
to the baseline measured in the same run. Sanity check: every approach's loss
at step 1 equals the single-device Flax loss (relative difference ≤ 1e-5).

    .venv/bin/python benchmarks/gspmd_compare.py [--layers 4 --hidden 256 --rounds 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEVICES = 8
GRIDS = ("data=8", "x=2,y=2,z=2", "x=2,z=2,data=2", "x=4,z=2", "z=8", "x=8", "x=2,data=4", "x=4,data=2")  # the last two: Megatron tp=2,dp=4 and tp=4,dp=2 split alike
#: (tp, dp) of the Megatron-style GSPMD runs; (1, 8) is the baseline and always runs.
MEGATRON = ((8, 1), (4, 2), (2, 4))
BASELINE = "GSPMD DP dp=8"
LOSS_RTOL = 1e-5
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass
class Approach:
    """One way to lay the model out: a mesh, parameter and batch shardings, an apply."""

    name: str
    family: str  # "axonn", "megatron", "fsdp"
    place: Callable[[Any], Any]  # full numpy params -> sharded params
    batch_sharding: Any
    apply: Callable[[Any, Any], Any]  # (params, tokens) -> logits


def axonn_approach(model, grid_text: str, tokens) -> Approach:
    """axonn_jax on ``grid_text``: the plan's layouts, batch split over (data, z)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import axonn_jax
    from axonn_jax.partitioner.grid import BATCH_AXES

    grid = axonn_jax.Grid.parse(grid_text)
    pm = axonn_jax.partition(model, grid, jax.ShapeDtypeStruct(tokens.shape, jnp.int32))
    return Approach(f"axonn {grid_text}", "axonn", pm.shard,
                    NamedSharding(pm.mesh, P(BATCH_AXES)), pm.apply)  # fmt: skip


def gspmd_approach(model, name: str, family: str, mesh, specs, batch_spec) -> Approach:
    """Plain ``model.apply`` under ``jax.jit``, parameters placed with ``specs`` on ``mesh``."""
    import jax
    from jax.sharding import NamedSharding

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return Approach(
        name, family,
        lambda full: jax.device_put(full, shardings),
        NamedSharding(mesh, batch_spec),
        lambda p, t: model.apply({"params": p}, t),
    )  # fmt: skip


def megatron_approach(model, params, tp: int, dp: int) -> Approach:
    """Megatron-style 1D tensor parallelism over ``tp`` × data parallelism over ``dp``."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from gspmd_specs import megatron_specs

    mesh = Mesh(np.asarray(jax.devices()[: tp * dp]).reshape(dp, tp), ("dp", "tp"))
    name = BASELINE if tp == 1 else f"GSPMD Megatron tp={tp},dp={dp}"
    family = "dp" if tp == 1 else "megatron"
    return gspmd_approach(model, name, family, mesh, megatron_specs(params, "tp", tp), P("dp"))


def fsdp_approach(model, params, n: int) -> Approach:
    """Fully sharded data parallelism over ``n`` devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from gspmd_specs import fsdp_specs

    mesh = Mesh(np.asarray(jax.devices()[:n]), ("fsdp",))
    return gspmd_approach(model, f"GSPMD FSDP fsdp={n}", "fsdp", mesh,
                          fsdp_specs(params, "fsdp", n), P("fsdp"))  # fmt: skip


def collective_summary(hlo_text: str) -> dict[str, dict[str, float]]:
    """Per collective kind: ``count`` and per-device ``wire_bytes`` (non-trivial ops only).

    Example:
        >>> text = "%a = f32[8]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%r"
        >>> collective_summary(text)["all-reduce"]
        {'count': 1, 'wire_bytes': 32.0}
    """
    from axonn_jax.runtime.hlo import collectives

    out = {kind: {"count": 0, "wire_bytes": 0.0} for kind in KINDS}
    for op in collectives(hlo_text):
        if not op.trivial:
            out[op.kind]["count"] += 1
            out[op.kind]["wire_bytes"] += op.wire_bytes
    return out


def per_device_bytes(tree) -> int:
    """Largest per-device byte count of the live arrays of ``tree``."""
    import jax

    totals: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return max(totals.values()) if totals else 0


def build(approach: Approach, full, tokens, optimizer, loss_fn) -> dict:
    """Place, compile and run one step of ``approach``; returns its numbers and run state."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params = approach.place(full)
    mesh = approach.batch_sharding.mesh
    replicated = NamedSharding(mesh, P())
    p_shard = jax.tree.map(lambda x: x.sharding, params)
    s_shard = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params),
                                    p_shard, transform_non_params=lambda _: replicated)  # fmt: skip
    state = jax.jit(optimizer.init, out_shardings=s_shard)(params)
    batch = jax.device_put(tokens, approach.batch_sharding)

    def train_step(p, s, t):
        loss, grads = jax.value_and_grad(lambda q: loss_fn(approach.apply(q, t), t))(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    t0 = time.perf_counter()
    compiled = (
        jax.jit(train_step, in_shardings=(p_shard, s_shard, approach.batch_sharding),
                out_shardings=(p_shard, s_shard, replicated), donate_argnums=(0, 1))  # fmt: skip
        .lower(params, state, batch)
        .compile()
    )
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    memory = {
        "params": per_device_bytes(params),
        "opt_state": per_device_bytes(state),
        "argument": mem.argument_size_in_bytes,
        "output": mem.output_size_in_bytes,
        "alias": mem.alias_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
    }
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    comm = collective_summary(compiled.as_text())
    params, state, loss = compiled(params, state, batch)  # step 1 (also the warm-up)
    return {
        "name": approach.name,
        "family": approach.family,
        "collectives": comm,
        "count": sum(c["count"] for c in comm.values()),
        "wire_bytes": sum(c["wire_bytes"] for c in comm.values()),
        "memory": memory,
        "loss1": float(loss),
        "compile_s": compile_s,
        "_run": [compiled, params, state, batch],
    }


def time_steps(rows: list[dict], rounds: int, per_round: int, seed: int = 0) -> None:
    """Adds ``step_s`` (median) to every row: ``rounds`` rounds, approaches in a new random order each."""
    import jax

    samples = {row["name"]: [] for row in rows}
    order = list(rows)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for row in order:
            compiled, params, state, batch = row["_run"]
            for _ in range(per_round):
                t0 = time.perf_counter()
                params, state, loss = compiled(params, state, batch)
                jax.block_until_ready(loss)
                samples[row["name"]].append(time.perf_counter() - t0)
            row["_run"][1:3] = [params, state]
    for row in rows:
        row["step_s"] = statistics.median(samples[row["name"]])
        row["steps_timed"] = len(samples[row["name"]])


def measure(args) -> dict:
    """Builds every approach, checks the step-1 losses, times the steps; JSON-able result."""
    import jax
    import numpy as np
    import optax

    from axonn_jax.models import GPT, GPTConfig, next_token_loss

    if len(jax.devices()) < DEVICES:
        raise RuntimeError(f"needs {DEVICES} devices, found {len(jax.devices())}; set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}")  # fmt: skip
    config = GPTConfig(vocab_size=args.vocab, num_layers=args.layers, hidden=args.hidden,
                       num_heads=args.heads, max_seq_len=args.seq)  # fmt: skip
    model = GPT(config)
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    full = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0), tokens)["params"])
    reference = float(jax.jit(lambda p, t: next_token_loss(model.apply({"params": p}, t), t))(full, tokens))
    optimizer = optax.adamw(1e-3)

    approaches = [megatron_approach(model, full, 1, DEVICES)]
    approaches += [axonn_approach(model, g, tokens) for g in args.grids]
    approaches += [megatron_approach(model, full, tp, dp) for tp, dp in args.megatron]
    if args.fsdp:
        approaches.append(fsdp_approach(model, full, DEVICES))
    rows = []
    for approach in approaches:
        print(f"  compiling {approach.name} ...", flush=True)
        rows.append(build(approach, full, tokens, optimizer, next_token_loss))
    for row in rows:
        row["loss_rel_err"] = abs(row["loss1"] - reference) / abs(reference)
    bad = [r["name"] for r in rows if r["loss_rel_err"] > LOSS_RTOL]
    if bad:
        raise AssertionError(f"step-1 loss differs from the single-device loss {reference:.6f} "
                             f"(rtol {LOSS_RTOL}) for: {', '.join(bad)}")  # fmt: skip
    time_steps(rows, args.rounds, args.per_round)
    base = next(r for r in rows if r["name"] == BASELINE)
    for row in rows:
        row["step_ratio"] = row["step_s"] / base["step_s"]
        row["wire_ratio"] = row["wire_bytes"] / base["wire_bytes"] if base["wire_bytes"] else float("nan")
        row["peak_ratio"] = row["memory"]["peak"] / base["memory"]["peak"]
        del row["_run"]
    result = {
        "model": f"GPT {args.layers}L/{args.hidden}H/{args.heads} heads, vocab {args.vocab}, "
                 f"seq {args.seq}, batch {args.batch}",
        "params": config.num_params(),
        "hidden": args.hidden,
        "baseline": BASELINE,
        "reference_loss": reference,
        "rounds": args.rounds,
        "per_round": args.per_round,
        "rows": rows,
    }  # fmt: skip
    result["table"] = markdown(result)
    return result


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown(result: dict) -> str:
    """The three tables (collectives, memory, step time) and the loss check."""
    rows = result["rows"]
    used = [k for k in KINDS if any(r["collectives"][k]["count"] for r in rows)]
    lines = [
        f"Model: {result['model']} ({result['params']:,} parameters, float32), AdamW, "
        f"8 simulated CPU devices. Baseline: {result['baseline']} (parameters replicated, "
        "batch split over 8).",
        "",
        "**Collectives per step** (from the compiled HLO; per device: count / MiB sent with "
        "ring algorithms):",
        "",
        "| approach | " + " | ".join(used) + " | total count | total MiB | vs baseline |",
        "| --- |" + " --- |" * (len(used) + 3),
    ]
    for r in rows:
        cells = [f"{r['collectives'][k]['count']} / {_mib(r['collectives'][k]['wire_bytes'])}"
                 for k in used]  # fmt: skip
        lines.append(f"| {r['name']} | " + " | ".join(cells)
                     + f" | {r['count']} | {_mib(r['wire_bytes'])} | {r['wire_ratio']:.2f} |")  # fmt: skip
    lines += [
        "",
        "**Memory per device** (MiB; params / optimizer state: live sharded arrays; "
        "arguments, temporaries, peak = arguments + outputs − donated + temporaries: "
        "`memory_analysis()` of the compiled step):",
        "",
        "| approach | params | optimizer state | arguments | temporaries | peak | peak vs baseline |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r["memory"]
        lines.append(f"| {r['name']} | {_mib(m['params'])} | {_mib(m['opt_state'])} | "
                     f"{_mib(m['argument'])} | {_mib(m['temp'])} | {_mib(m['peak'])} | "
                     f"{r['peak_ratio']:.2f} |")  # fmt: skip
    lines += [
        "",
        f"**Step time**, median of {result['rounds']} rounds × {result['per_round']} steps, "
        "approaches interleaved in a new random order each round, as a ratio to the baseline "
        "(absolute medians on this machine in parentheses; 8 devices simulated on the host's "
        "CPU cores, so this measures overheads, not interconnects):",
        "",
        "| approach | step time / baseline | loss at step 1, relative difference to single device |",
        "| --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: r["step_ratio"]):
        lines.append(f"| {r['name']} | {r['step_ratio']:.2f} ({r['step_s'] * 1e3:.1f} ms) | "
                     f"{r['loss_rel_err']:.1e} |")  # fmt: skip
    return "\n".join(lines)


def _grids(text: str) -> list[str]:
    return [g.strip() for g in text.split(";") if g.strip()]


def _megatron(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        tp, _, dp = item.partition("x")
        pairs.append((int(tp), int(dp)))
        if pairs[-1][0] * pairs[-1][1] != DEVICES:
            raise SystemExit(f"--megatron {item}: tp·dp must be {DEVICES}")
    return pairs


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--grids", type=_grids, default=list(GRIDS),
                    help="axonn_jax grids separated by ';' (default: %(default)s)")
    ap.add_argument("--megatron", type=_megatron, default=list(MEGATRON),
                    help="GSPMD tensor×data sizes, e.g. '8x1,4x2,2x4' (tp=1,dp=8 always runs)")
    ap.add_argument("--no-fsdp", dest="fsdp", action="store_false")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = measure(args)
    print(result["table"])
    return result


if __name__ == "__main__":
    main()

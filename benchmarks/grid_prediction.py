"""Predicted vs measured step time over every 8-device grid, for a GPT, a wide MLP and a CNN.

1. Profile this machine's 8 (simulated) devices with the built-in micro-benchmark
   (collective bandwidth and latency by group shape, GEMM rate), once.
2. For each model and every grid with x·y·z·data = 8 (pipeline 1) that
   divides it, measure the step time of a ``pm.apply``-based jitted AdamW
   train step: rounds over all grids in a new random order each, a few steps
   per grid and round. A round's figure for a grid is its best step there
   (the first step after another grid's may pay for the switch); the
   measurement is the median of those over the rounds (robust to the rounds
   another process disturbed, where the best single step is an extreme value
   of 8 device threads on a few cores). The best step and the median of all
   steps are reported too.
3. Predict each grid's step time (float32, no recompute, as measured) with
   the profile, and report per model Spearman's rank correlation and the
   measured rank of the planner's pick (the target: #1): as ``axonn-jax plan
   --check K`` picks, the analytical model's top ``--check`` grids and those
   predicted within ``--within`` of its first (its near ties,
   :func:`axonn_jax.compiled_check.to_check`) reordered by
   the step time their compiled programs imply (XLA's FLOPs, bytes accessed
   and collectives priced with the same profile,
   :mod:`axonn_jax.perf.compiled`); the analytical first and the compiled
   estimate's own ranking are reported too. And the planner's timed pick, as
   ``axonn-jax plan --check K --trial STEPS`` picks: the same grids, each run ``--trial`` steps here by
   :func:`axonn_jax.compiled_check.check_compiled` (its own train step and
   timing, after the measurement below and apart from it), the fastest
   first. With how sure
   the measurement is of its own ranking: resampling the rounds (the same
   rounds for every grid: a round is one stretch of time), the share of
   resamples in which each grid is the fastest. Grids the measurement cannot
   tell apart from the fastest (a share of at least 5 %) are listed as tied.
4. With ``--runs N`` the measurement is repeated in N processes, each
   compiling every grid anew: which grid is fastest changes from one process
   to the next here, by more than between the rounds of one process (where the
   buffers and threads of a compiled step land). The rounds of all processes
   are pooled, and the resampling draws processes first, then rounds in each.

Writes markdown (``--out``) and the same numbers as JSON (``--out`` with
``.json``); the machine profile goes next to them.

    .venv/bin/python benchmarks/grid_prediction.py [--models gpt,mlp,cnn] [--rounds 2] [--per-round 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

DEVICES = 8
#: a grid fastest in at least this share of the resampled rounds is tied with the measured best
TIE_SHARE = 0.05


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the benchmark: the Flax model, one step's batch, its loss, its spec."""

    name: str
    model: object
    batch: np.ndarray
    loss: Callable  # loss(outputs, batch)
    spec: object  # a ModelSpec, or a traced model's PerGridSpec (its for_grid: each grid's)


def make_case(name: str, a) -> Case:
    """``gpt`` (the flags' GPT), ``mlp`` (wide: ``--mlp-width`` × 3 layers) or ``cnn``."""
    import jax
    import jax.numpy as jnp

    from axonn_jax.compiled_check import squares_loss
    from axonn_jax.models import CNN, GPT, MLP, GPTConfig, next_token_loss
    from axonn_jax.perf.spec import gpt_spec
    from axonn_jax.perf.traced import PerGridSpec

    rng = np.random.default_rng(0)
    if name == "gpt":
        config = GPTConfig(vocab_size=a.vocab, num_layers=a.layers, hidden=a.hidden,
                           num_heads=a.heads, max_seq_len=a.seq)  # fmt: skip
        tokens = rng.integers(0, a.vocab, (a.batch, a.seq)).astype(np.int32)
        spec = gpt_spec(layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq, batch=a.batch,
                        vocab=a.vocab)  # fmt: skip
        return Case(name, GPT(config), tokens, next_token_loss, spec)
    if name == "mlp":
        model = MLP(features=(a.mlp_width,) * 3 + (a.mlp_in,))
        x = rng.standard_normal((a.mlp_batch, a.mlp_in)).astype(np.float32)
    elif name == "cnn":
        model = CNN(channels=(32, 64), num_classes=16)
        x = rng.standard_normal((a.cnn_batch, 32, 32, 8)).astype(np.float32)
    else:
        raise ValueError(f"unknown model {name!r}; choose from gpt, mlp, cnn")
    spec = PerGridSpec(model, jax.ShapeDtypeStruct(x.shape, jnp.float32), name=f"{name} ({type(model).__name__})")
    return Case(name, model, x, squares_loss, spec)


def build_steps(case: Case, grids, threads: int):
    """One compiled AdamW train step per grid (lowered in turn, compiled ``threads`` at a time),
    and what XLA reports of each program (:func:`~axonn_jax.compiled_check.program_cost`)."""
    import concurrent.futures

    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import axonn_jax
    from axonn_jax.compiled_check import program_cost
    from axonn_jax.partitioner.grid import BATCH_AXES

    model, batch_np = case.model, case.batch
    full = jax.tree.map(np.asarray, model.init(jax.random.key(0), batch_np)["params"])
    optimizer = optax.adamw(1e-3)
    lowered = {}
    for grid in grids:
        pm = axonn_jax.partition(model, grid, jax.ShapeDtypeStruct(batch_np.shape, batch_np.dtype))
        params = pm.shard(full)
        state = optimizer.init(params)
        batch = jax.device_put(batch_np, NamedSharding(pm.mesh, P(BATCH_AXES)))

        def train_step(p, s, b, pm=pm):
            loss, grads = jax.value_and_grad(lambda q: case.loss(pm.apply(q, b), b))(p)
            updates, s = optimizer.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        lowered[grid] = (jax.jit(train_step).lower(params, state, batch), params, state, batch)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        compiled = dict(zip(lowered, pool.map(lambda lo: lo[0].compile(), lowered.values())))
    steps = {}
    for grid, (_, params, state, batch) in lowered.items():
        out = compiled[grid](params, state, batch)  # first run: warm-up
        jax.block_until_ready(out)
        steps[grid] = [compiled[grid], out[0], out[1], batch]
    return steps, {grid: program_cost(c, DEVICES) for grid, c in compiled.items()}


def measure(steps, rounds: int, per_round: int) -> dict:
    """Per grid: its step seconds, a list per round (``per_round`` steps), grids shuffled in each round."""
    import jax

    samples: dict = {g: [] for g in steps}
    order = list(steps)
    rng = random.Random(0)
    for r in range(rounds):
        rng.shuffle(order)
        for grid in order:
            compiled, params, state, batch = steps[grid]
            times = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                params, state, loss = compiled(params, state, batch)
                jax.block_until_ready(loss)
                times.append(time.perf_counter() - t0)
            samples[grid].append(times)
            steps[grid][1:3] = [params, state]
        print(f"  round {r + 1}/{rounds} done", flush=True)
    return samples


def _runs(samples) -> list[dict]:
    """``samples`` of one process (grid → rounds) or of several (a list of those)."""
    return [samples] if isinstance(samples, dict) else list(samples)


def round_medians(samples) -> dict:
    """Per grid: the median over rounds (of every process) of its best step in each round."""
    runs = _runs(samples)
    return {g: statistics.median(min(times) for run in runs for times in run[g]) for g in runs[0]}


def fastest_shares(samples, resamples: int = 2000, seed: int = 0) -> dict:
    """Per grid: the share of resamples in which its :func:`round_medians` figure is the least.

    A resample draws processes with replacement, then rounds with replacement
    within each drawn process (the same rounds for every grid: a round is one
    stretch of time). ``samples``: one process's grid → rounds, or a list of them.

    >>> fastest_shares({"a": [[1.0, 1.1], [1.2], [1.0]], "b": [[3.0], [1.3], [3.0]]}, resamples=200)
    {'a': 1.0, 'b': 0.0}
    """
    runs = _runs(samples)
    grids = list(runs[0])
    bests = [np.array([[min(times) for times in run[g]] for g in grids]) for run in runs]  # grids × rounds
    rng = np.random.default_rng(seed)
    counts = np.zeros(len(grids), int)
    for _ in range(resamples):
        drawn = [bests[i] for i in rng.integers(0, len(runs), size=len(runs))]
        pooled = np.concatenate([b[:, rng.integers(0, b.shape[1], size=b.shape[1])] for b in drawn], axis=1)
        counts[np.argmin(np.median(pooled, axis=1))] += 1
    return {g: float(c) / resamples for g, c in zip(grids, counts)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt,mlp,cnn", help="comma-separated: gpt, mlp, cnn")
    ap.add_argument("--layers", type=int, default=1, help="GPT blocks")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="GPT sequences per step")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--mlp-width", type=int, default=1024, help="the wide MLP's hidden width")
    ap.add_argument("--mlp-in", type=int, default=256, help="the MLP's input (and output) width")
    ap.add_argument("--mlp-batch", type=int, default=64)
    ap.add_argument("--cnn-batch", type=int, default=32, help="32×32×8 images per step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(2, (os.cpu_count() or 2) // 2),
                    help="compilations at a time (default half the cores)")  # fmt: skip
    ap.add_argument("--grids", help="only these grids, ';'-separated (e.g. 'x=2,y=2,z=2;data=8'; a smoke run)")
    ap.add_argument("--profile", help="use this machine profile JSON instead of measuring one")
    ap.add_argument("--check", type=int, default=3,
                    help="the planner's pick: its top K reordered by compiled step time (default 3, "
                         "axonn-jax plan --check's)")  # fmt: skip
    ap.add_argument("--within", type=float, default=0.1,
                    help="... and those predicted within this share of the first's step time (default "
                         "0.1, axonn-jax plan --check's --within)")  # fmt: skip
    ap.add_argument("--trial", type=int, default=10,
                    help="the planner's timed pick: its top K each run this many steps (plan --check K "
                         "--trial STEPS; default 10, 0: none)")  # fmt: skip
    ap.add_argument("--runs", type=int, default=1,
                    help="measure in this many processes, each compiling anew (default 1: this one)")  # fmt: skip
    ap.add_argument("--out", default="runs/grid_prediction.md")
    ap.add_argument("--samples-out", help=argparse.SUPPRESS)  # a --runs child: measure only, write here
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error(f"--runs must be >= 1, got {a.runs}")
    if a.trial < 0:
        ap.error(f"--trial must be >= 0, got {a.trial}")
    if a.samples_out:
        return measure_only(a)

    import jax

    from axonn_jax.perf import machines
    from axonn_jax.perf.microbench import measure_machine

    if len(jax.devices()) != DEVICES:
        sys.exit(f"needs {DEVICES} devices, found {len(jax.devices())}")
    t_start = time.perf_counter()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.profile:
        machine = machines.load(a.profile)
    else:
        print("profiling this machine ...", flush=True)
        machine = measure_machine(jax.devices())
        machines.save(machine, str(out.with_suffix(".machine.json")))
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    children = measure_in_processes(argv if argv is not None else sys.argv[1:], a.runs) if a.runs > 1 else None
    results = {name: run_model(make_case(name, a), machine, a, children and [c[name] for c in children])
               for name in names}  # fmt: skip
    total = time.perf_counter() - t_start
    where = (f"in {a.runs} processes (each compiling every grid anew), " if a.runs > 1 else "")
    lines = [f"# Predicted vs measured step time over the grids of {DEVICES} devices", "",
             f"Machine: {machine.name} ({machine.source}). Measured {where}{a.rounds} rounds × "
             f"{a.per_round} steps per grid, grids in a new random order each round; a grid's figure is "
             "the median over rounds of its best step in each round (the best step and the median of "
             "all steps are shown too); \"fastest in\": the share of 2,000 resamples "
             + ("(processes, then rounds in each) " if a.runs > 1 else "of the rounds ")
             + f"in which the grid's figure is the least (≥ {TIE_SHARE:.0%}: tied with the measured best). "
             "Predicted: float32, AdamW, no recompute, one microbatch, as measured.", "",
             f"The planner's pick: the analytical top {a.check} and those predicted within "
             f"{a.within:.0%} of the first, reordered by the step time their "
             "compiled programs imply (`axonn-jax plan --check`)"
             + (f"; its timed pick: the same each run {a.trial} steps here by the planner, twice "
                f"(`axonn-jax plan --check {a.check} --within {a.within:g} --trial {a.trial}`), after the measurement "
                "and apart from it." if a.trial else "."), "",
             "| model | grids | the planner's pick | its measured rank | fastest in | tied for the fastest "
             "| timed pick (measured rank, fastest in) "
             "| Spearman ρ analytical | ρ against medians | analytical first (measured rank) "
             "| ρ compiled | compiled first (measured rank) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, r in results.items():
        timed = (f"{r['trial_pick']} (#{r['trial_pick_rank']}, {r['trial_pick_share']:.0%})"
                 if r.get("trial_pick") else "-")  # fmt: skip
        lines.append(f"| {name} | {r['grids']} | {r['pick']} | #{r['best_rank']} | "
                     f"{r['predicted_best_share']:.0%} | {', '.join(r['tied'])} | {timed} | {r['spearman']:.3f} | "
                     f"{r['spearman_median']:.3f} | {r['analytical_first']} (#{r['analytical_first_rank']}) | "
                     f"{r['spearman_compiled']:.3f} | {r['compiled_first']} (#{r['compiled_first_rank']}) |")  # fmt: skip
    for r in results.values():
        lines += ["", r["markdown"]]
    lines += ["", f"Total benchmark time {total:.0f} s."]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    summary = {name: {k: v for k, v in r.items() if k != "markdown"} for name, r in results.items()}
    out.with_suffix(".json").write_text(json.dumps({"machine": machine.name, "seconds": total,
                                                    "models": summary}, indent=1))  # fmt: skip
    print(text)
    first = next(iter(results.values()))
    return {"spearman": first["spearman"], "spearman_median": first["spearman_median"],
            "best_rank": first["best_rank"], "grids": first["grids"], "models": summary,
            "markdown": text}  # fmt: skip


def runnable_grids(case: Case, a) -> tuple[list, list]:
    """The 8-device grids without a pipeline (``--grids``: only those) that divide ``case``'s
    model, and those that do not (the grid's spec's ``problems``)."""
    from axonn_jax.partitioner.grid import Grid
    from axonn_jax.search import grids as all_grids

    candidates = list(all_grids(DEVICES, pipeline=False))
    if a.grids:
        wanted = {Grid.parse(g) for g in a.grids.split(";")}
        candidates = [g for g in candidates if g in wanted]
    runnable = [g for g in candidates if not case.spec.for_grid(g).problems(g)]
    return runnable, [g for g in candidates if g not in runnable]


def measure_model(case: Case, grids, a) -> dict:
    """Compile ``grids``' steps in this process and time them: samples and seconds spent."""
    print(f"{case.name}: compiling {len(grids)} grids ...", flush=True)
    t_compile = time.perf_counter()
    steps, costs = build_steps(case, grids, a.threads)
    t_compile = time.perf_counter() - t_compile
    print(f"{case.name}: measuring ({t_compile:.0f} s to compile) ...", flush=True)
    t_measure = time.perf_counter()
    samples = measure(steps, a.rounds, a.per_round)
    return {"samples": samples, "costs": costs, "compile_seconds": t_compile,
            "measure_seconds": time.perf_counter() - t_measure}  # fmt: skip


def measure_only(a) -> dict:
    """A ``--runs`` child: measure every model's grids, write their samples to ``--samples-out``."""
    out = {}
    for name in (n.strip() for n in a.models.split(",") if n.strip()):
        case = make_case(name, a)
        grids, _ = runnable_grids(case, a)
        m = measure_model(case, grids, a)
        out[name] = {**m, "samples": {_g(g): rounds for g, rounds in m["samples"].items()},
                     "costs": {_g(g): dataclasses.asdict(c) for g, c in m["costs"].items()}}  # fmt: skip
    Path(a.samples_out).write_text(json.dumps(out))
    return out


def measure_in_processes(argv: list[str], runs: int) -> list[dict]:
    """Run this script ``runs`` times as a measuring child (one after the other); their samples."""
    script = Path(__file__).resolve()
    base = [x for i, x in enumerate(argv) if not x.startswith("--runs")
            and not (i and argv[i - 1] == "--runs")]  # fmt: skip
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(runs):
            path = Path(tmp) / f"run{r}.json"
            print(f"measuring process {r + 1}/{runs} ...", flush=True)
            subprocess.run([sys.executable, str(script), *base, "--samples-out", str(path)], check=True)
            out.append(json.loads(path.read_text()))
    return out


def run_model(case: Case, machine, a, children: list[dict] | None = None) -> dict:
    """Profile-based predictions and measurements of every grid that divides ``case``'s model.

    ``children``: the ``--runs`` processes' measurements of this model (else it is measured here).
    """
    from axonn_jax.compiled_check import to_check
    from axonn_jax.partitioner.grid import Grid
    from axonn_jax.perf.compiled import ProgramCollective, ProgramCost
    from axonn_jax.perf.options import Options
    from axonn_jax.perf.step import predict

    spec = case.spec.for_grid(Grid())  # the model's name and size (a traced model: its one-device plan)
    grids, skipped = runnable_grids(case, a)
    options = Options(precision="fp32", recompute=False)
    predicted = {g: predict(case.spec.for_grid(g), g, machine, options) for g in grids}
    if children is None:
        children = [measure_model(case, grids, a)]
    else:
        by_name = {_g(g): g for g in grids}
        cost = lambda d: ProgramCost(d["flops"], d["bytes_accessed"],  # noqa: E731
                                     tuple(ProgramCollective(**c) for c in d["collectives"]))  # fmt: skip
        children = [{**c, "samples": {by_name[k]: v for k, v in c["samples"].items()},
                     "costs": {by_name[k]: cost(v) for k, v in c["costs"].items()}} for c in children]  # fmt: skip
    runs = [c["samples"] for c in children]
    compiled = {g: c.time(machine).total for g, c in children[0]["costs"].items()}  # the same program in each
    t_compile = sum(c["compile_seconds"] for c in children)
    t_measure = sum(c["measure_seconds"] for c in children)
    measured = round_medians(runs)
    best = {g: min(min(times) for run in runs for times in run[g]) for g in grids}
    medians = {g: statistics.median(t for run in runs for times in run[g] for t in times) for g in grids}
    shares = fastest_shares(runs)
    per_run_best = [_g(min(grids, key=round_medians(run).__getitem__)) for run in runs]
    rho_median = spearman([predicted[g].step_seconds for g in grids], [medians[g] for g in grids])
    order = sorted(grids, key=lambda g: measured[g])
    rho = spearman([predicted[g].step_seconds for g in grids], [measured[g] for g in grids])
    pred_order = sorted(grids, key=lambda g: predicted[g].step_seconds)
    candidates = [p.grid for p in to_check([predicted[g] for g in pred_order], a.check, a.within)]
    pick = min(candidates, key=compiled.__getitem__)  # axonn-jax plan --check's first
    trial = timed_pick(case, [predicted[g] for g in candidates], machine, a.trial) if a.trial else {}
    rank_of_pick, rank_of_first = order.index(pick) + 1, order.index(pred_order[0]) + 1
    compiled_order = sorted(grids, key=compiled.__getitem__)
    rho_compiled = spearman([compiled[g] for g in grids], [measured[g] for g in grids])
    tied = [g for g in order if shares[g] >= TIE_SHARE]
    lines = [
        f"### {case.name}: {len(grids)} grids",
        "",
        f"Model: {spec.name}, {spec.num_params:,} parameters.",
        "",
        f"**The planner's pick (the analytical top {a.check} and {max(0, len(candidates) - a.check)} near ties, "
        f"reordered by their compiled step time), "
        f"{_g(pick)}, is measured #{rank_of_pick}**"
        f"{' (the measured best)' if rank_of_pick == 1 else f'; measured best {_g(order[0])}'}; fastest in "
        f"{shares[pick]:.0%} of the resamples (measured best: {shares[order[0]]:.0%}); tied for the "
        f"fastest (≥ {TIE_SHARE:.0%}): {', '.join(map(_g, tied))}. "
        f"Spearman rank correlation of the analytical model: {rho:.3f} (against the medians of all "
        f"steps: {rho_median:.3f}), its first {_g(pred_order[0])} measured #{rank_of_first}; of the "
        f"compiled estimate over every grid: {rho_compiled:.3f}, its first {_g(compiled_order[0])} "
        f"measured #{order.index(compiled_order[0]) + 1}."
        + (f" The fastest in each process: {', '.join(per_run_best)}." if len(runs) > 1 else "")
        + (f" **The planner's timed pick (the same {len(candidates)}, each run {a.trial} steps by "
           f"`check_compiled`), {_g(trial['pick'])}, is measured #{order.index(trial['pick']) + 1}**, "
           f"fastest in {shares[trial['pick']]:.0%} of the resamples; the planner measured "
           + ", ".join(f"{_g(g)} {ms:.1f} ms" for g, ms in trial["ms"].items()) + "." if trial else ""),
        "",
        "| measured rank | grid (x,y,z,data) | measured ms | fastest in | best step ms | median step ms "
        "| predicted ms | predicted rank | predicted compute ms | predicted comm ms | compiled ms "
        "| compiled rank |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, g in enumerate(order, 1):
        p = predicted[g]
        lines.append(
            f"| {i} | {_g(g)} | {measured[g] * 1e3:.1f} | {shares[g]:.0%} | {best[g] * 1e3:.1f} | "
            f"{medians[g] * 1e3:.1f} | {p.step_seconds * 1e3:.1f} | "
            f"{pred_order.index(g) + 1} | {p.compute_seconds * 1e3:.1f} | {p.comm_seconds * 1e3:.1f} | "
            f"{compiled[g] * 1e3:.1f} | {compiled_order.index(g) + 1} |"
        )
    if skipped:
        lines += ["", f"Not run (do not divide the model): {', '.join(_g(g) for g in skipped)}."]
    lines += ["", f"Compile {t_compile:.0f} s, measure {t_measure:.0f} s."]
    return {"spearman": rho, "spearman_median": rho_median, "best_rank": rank_of_pick,
            "pick": _g(pick), "analytical_first": _g(pred_order[0]), "analytical_first_rank": rank_of_first,
            "spearman_compiled": rho_compiled, "compiled_first": _g(compiled_order[0]), "check": a.check, "checked": [_g(g) for g in candidates],
            "compiled_first_rank": order.index(compiled_order[0]) + 1,
            "predicted_best": _g(pick), "measured_best": _g(order[0]), "grids": len(grids),
            "predicted_best_share": shares[pick], "tied": [_g(g) for g in tied],
            **({"trial_pick": _g(trial["pick"]), "trial_pick_rank": order.index(trial["pick"]) + 1,
                "trial_pick_share": shares[trial["pick"]], "trial_steps": a.trial,
                "trial_ms": {_g(g): ms for g, ms in trial["ms"].items()}} if trial else {}),
            "runs": len(runs), "measured_best_per_run": per_run_best,
            "measured_ms": {_g(g): measured[g] * 1e3 for g in grids},
            "predicted_ms": {_g(g): predicted[g].step_seconds * 1e3 for g in grids},
            "compiled_ms": {_g(g): compiled[g] * 1e3 for g in grids},
            "compile_seconds": t_compile, "measure_seconds": t_measure,
            "markdown": "\n".join(lines)}  # fmt: skip


def timed_pick(case: Case, predictions, machine, steps: int) -> dict:
    """``axonn-jax plan --check K --trial steps``'s first of ``predictions`` (the analytical
    top K): each configuration's train step compiled and run ``steps`` steps here by
    :func:`~axonn_jax.compiled_check.check_compiled`, reordered by :func:`rerank`.
    ``{"pick": grid, "ms": {grid: measured ms}}``."""
    from axonn_jax.compiled_check import check_compiled, rerank

    print(f"{case.name}: the planner's trial of its {len(predictions)} candidates ...", flush=True)
    checks = check_compiled(case.model, (case.batch,), predictions, limit_bytes=float("inf"), machine=machine,
                            loss_fn=case.loss, trial_steps=steps)  # fmt: skip
    return {"pick": rerank(checks)[0].prediction.grid,
            "ms": {c.prediction.grid: c.measured * 1e3 for c in checks if c.measured is not None}}  # fmt: skip


def _g(grid) -> str:
    return f"({grid.x},{grid.y},{grid.z},{grid.data})"


if __name__ == "__main__":
    main()

"""Markdown for ``benchmarks/run.py``: one summary row set and one section per benchmark.

Every formatter takes the dict a benchmark's ``main()`` returned (after a JSON
round trip) and returns markdown; :data:`FORMATTERS` maps benchmark names to
``(summary, section)`` pairs. ``summary(result)`` gives ``(measure, value)``
rows of the combined table: ratios measured within one run, absolute times
only in parentheses.

Example:
    >>> summary, _ = FORMATTERS["partition_overhead"]
    >>> summary({"ratio": 1.004, "plain_s": 0.0123, "axonn_s": 0.01235, "steps": 30})
    [('train step on grid all-1, axonn_jax / plain jax.jit', '1.004 (12.3 ms plain)')]
"""

from __future__ import annotations

from typing import Callable

Rows = list[tuple[str, str]]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# ---------------------------------------------------------------- overhead, planning


def overhead_summary(r: dict) -> Rows:
    return [("train step on grid all-1, axonn_jax / plain jax.jit",
             f"{r['ratio']:.3f} ({_ms(r['plain_s'])} plain)")]  # fmt: skip


def overhead_section(r: dict) -> str:
    return (f"The user's jitted AdamW step with `pm.apply` on `Grid()` vs the same step with "
            f"`model.apply`, same GPT ({r.get('params', 0):,} parameters) and batches, run "
            f"alternately; median of {r['steps']} steps each: ratio **{r['ratio']:.3f}** "
            f"(axonn_jax {_ms(r['axonn_s'])}, plain {_ms(r['plain_s'])}).")  # fmt: skip


def planning_summary(r: dict) -> Rows:
    return [(f"plan a {r['params'] / 1e9:.0f}B-parameter GPT for {r['gpus']:,} GPUs (abstract shapes)",
             f"({r['seconds']:.1f} s)")]  # fmt: skip


def planning_section(r: dict) -> str:
    return (f"`partition()` of a {r['params'] / 1e9:.1f}B-parameter GPT for {r['gpus']:,} GPUs "
            f"from abstract shapes on this machine: {r['seconds']:.1f} s; fp32 parameters per "
            f"device {r['bytes_per_device'] / 2**30:.2f} GiB; {r['warnings']} plan warnings.")


def report_summary(r: dict) -> Rows:
    return [("`pm.report()` / `partition()` time, same model and grid", f"{r['ratio']:.2f}")]


def report_section(r: dict) -> str:
    return (f"Time of the first `pm.report()` (every collective and memory kind of a train step, "
            f"traced on an abstract mesh) relative to `partition()` of the same model and grid: "
            f"**{r['ratio']:.2f}** ({r['report_s']:.1f} s vs {r['partition_s']:.1f} s).")


# ---------------------------------------------------------------- GSPMD comparison


def _best(rows: list[dict], family: str, key) -> dict | None:
    chosen = [r for r in rows if r["family"] == family]
    return min(chosen, key=key) if chosen else None


def gspmd_summary(r: dict) -> Rows:
    rows = r["rows"]
    wire = lambda x: x["wire_bytes"]  # noqa: E731
    peak = lambda x: x["memory"]["peak"]  # noqa: E731
    step = lambda x: x["step_ratio"]  # noqa: E731
    out: Rows = []
    for label, key, fmt in (("collective bytes per device and step", wire, "{:.2f} MiB"),
                            ("peak memory per device", peak, "{:.2f} MiB"),
                            ("step time", step, None)):  # fmt: skip
        best = {f: _best(rows, f, key) for f in ("axonn", "megatron", "fsdp")}
        if best["axonn"] is None:
            continue
        ours = key(best["axonn"])
        parts = []
        for family, title in (("megatron", "GSPMD Megatron"), ("fsdp", "GSPMD FSDP")):
            if best[family] is not None and key(best[family]):
                parts.append(f"{ours / key(best[family]):.2f}× best {title} ({best[family]['name'].split()[-1]})")
        if fmt:  # bytes: absolute values are exact, not timings
            parts.append(fmt.format(ours / 2**20) + " for ours")
        else:
            parts.append(f"{ours:.2f}× {r['baseline']}")
        size = f", hidden {r['hidden']}" if "hidden" in r else ""
        out.append((f"{label}{size}: best axonn_jax grid ({best['axonn']['name'].split()[-1]}) vs GSPMD",
                    "; ".join(parts)))  # fmt: skip
    return out


def gspmd_section(r: dict) -> str:
    return r["table"]


# ---------------------------------------------------------------- others


def _checked(m: dict) -> str:
    """Which grids the planner's check compiled: its top K, and the near ties it added."""
    ties = len(m.get("checked", ())) - m.get("check", 3)
    return f"analytical top {m.get('check', 3)}" + (f" and {ties} near tie{'s' * (ties > 1)}" if ties > 0 else "")


def prediction_summary(r: dict) -> Rows:
    if "models" not in r:  # results from before the MLP and CNN
        return [(f"grid choice: Spearman ρ, predicted vs measured step time over {r['grids']} grids",
                 f"{r['spearman']:.2f} (predicted best is measured #{r['best_rank']})")]  # fmt: skip
    models = r["models"]
    if "pick" in next(iter(models.values())):
        rows = [(f"grid choice, {name}: the planner's pick ({_checked(m)} reordered by "
                 f"compiled step time), its measured rank over {m['grids']} grids",
                 f"#{m['best_rank']} ({_slowdown(m):.2f}× the best's time, fastest in "
                 f"{m['predicted_best_share']:.0%} of resamples, tied: {len(m['tied'])} grids; Spearman ρ "
                 f"analytical {m['spearman']:.2f}, compiled {m['spearman_compiled']:.2f})")
                for name, m in models.items()]  # fmt: skip
        return rows + [(f"grid choice, {name}: the planner's timed pick (the same {len(m.get('checked', ())) or m['check']}, each run "
                        f"{m['trial_steps']} steps: plan --check --trial), its measured rank",
                        f"#{m['trial_pick_rank']} ({_slowdown(m, m['trial_pick']):.2f}× the best's time, "
                        f"fastest in {m['trial_pick_share']:.0%} of resamples)")
                       for name, m in models.items() if "trial_pick" in m]  # fmt: skip
    return [(f"grid choice, {name}: Spearman ρ, predicted vs measured step time over {m['grids']} grids",
             f"{m['spearman']:.2f} (predicted best is measured #{m['best_rank']}"
             + (f", {_slowdown(m):.2f}× the best's time" if "measured_ms" in m else "")
             + (f", fastest in {m['predicted_best_share']:.0%} of resamples" if "tied" in m else "")
             + (f", tied: {len(m['tied'])} grids" if m.get("runs", 1) > 1 else "")
             + ")")
            for name, m in models.items()]  # fmt: skip


def _slowdown(m: dict, grid: str | None = None) -> float:
    """``grid``'s (default the predicted best's) measured time over the measured best's."""
    return m["measured_ms"][grid or m["predicted_best"]] / min(m["measured_ms"].values())


def prediction_section(r: dict) -> str:
    text = r.get("markdown", "")
    lines = [l for l in text.splitlines() if not l.startswith("# ")]  # its own title
    return "\n".join(lines).strip() or f"Spearman ρ {r['spearman']:.3f}."


def bubble_layout(x: dict) -> str:
    """A pipeline_bubble run's stages per rank: ``"2"``, or ``"2, V-shaped"`` for the V placement."""
    return f"{x.get('v', 1)}" + (", V-shaped" if x.get("placement") == "v" else "")


def _bubble_rows(r: dict, mode: str = "uniform") -> dict[str, dict[str, dict]]:
    """virtual (and placement) → schedule → the run with the most microbatches (uniform tasks)."""
    runs = [x for x in r["results"] if x["mode"] == mode]
    rows: dict[str, dict[str, dict]] = {}
    for v in sorted({bubble_layout(x) for x in runs}):
        mine = [x for x in runs if bubble_layout(x) == v]
        m = max(x["m"] for x in mine)
        rows[v] = {x["schedule"]: x for x in mine if x["m"] == m}
    return rows


def bubble_summary(r: dict) -> Rows:
    out = []
    for v, row in _bubble_rows(r).items():
        m, msg = row["message"]["m"], row["message"]
        if v == "1":
            out.append((f"pipeline bubble, {m} microbatches, uniform tasks: idle fraction "
                        "message-driven (GPipe, 1F1B; theory)",
                        f"{msg['idle_mean']:.2f} ({row['gpipe']['idle_mean']:.2f}, "
                        f"{row['1f1b']['idle_mean']:.2f}; {msg['theory']:.2f})"))  # fmt: skip
        else:
            out.append((f"pipeline bubble, virtual={v}, {m} microbatches: idle fraction "
                        "message-driven (theory; theory without virtual stages)",
                        f"{msg['idle_mean']:.2f} ({msg['theory']:.2f}; "
                        f"{msg.get('theory_v1', msg['theory']):.2f})"))  # fmt: skip
        if "zb" in row:
            zb = row["zb"]
            h1 = f"{row['zb-h1']['idle_mean']:.2f}, " if "zb-h1" in row else ""
            out.append((f"pipeline bubble, virtual={v}, {m} microbatches, zero bubble: idle fraction "
                        "message-driven zb (ZB-H1, floor)",
                        f"{zb['idle_mean']:.2f} ({h1}{zb.get('floor', float('nan')):.2f})"))  # fmt: skip
    return out


def bubble_section(r: dict) -> str:
    return r["table"]


def async_summary(r: dict) -> Rows:
    return [("pipeline=2 in one process (2 CPU devices): one task at a time / asynchronous "
             "dispatch, step time",
             f"{r['speedup']:.2f}× (ideal {2 * r['microbatches'] / (r['microbatches'] + 1):.2f}×; "
             f"stages computing at once {r['overlap_s'] / r['span_s']:.0%} of the step)")]  # fmt: skip


def zero_bubble_summary(r: dict) -> Rows:
    return [("pipeline=2 in one process (2 CPU devices): step time message-driven (fused backward) / "
             "zero-bubble message-driven (ZB-H1)",
             f"{r['speedup']['zb']:.2f}× ({r['speedup']['zb-h1']:.2f}×)")]  # fmt: skip


def hop_summary(r: dict) -> Rows:
    from pipeline_hop import label

    return [(f"pipeline hop of {label(x['bytes'])}, one way: MpiTransport / raw mpi4py Send/Recv",
             f"{x['ratio']:.2f} ({x['transport_s'] * 1e3:.3f} vs {x['raw_s'] * 1e3:.3f} ms)")
            for x in r["results"]]  # fmt: skip


def hop_section(r: dict) -> str:
    return ("Ping-pong between 2 processes (one CPU device each), float32 arrays; raw: "
            "`np.asarray` + `comm.Send`, `comm.Recv` + `jax.device_put` (waited for); transport: "
            "`expect` ahead, `send`, `arrived` / `wait` as the dispatch queue calls them, until "
            "the arrays are ready. Methods alternate within each round; medians of the one-way "
            "times (half a round trip):\n\n" + r["table"])


def mpi_step_summary(r: dict) -> Rows:
    return [(f"`{r['grid']}` step under {c['label']} / in one process ({c['collectives']} "
             "CPU collectives)", f"{c['ratio']:.2f}")
            for c in r["configs"][1:]]  # fmt: skip


def call_agreement_summary(r: dict) -> Rows:
    return [(f"pipelined step with the call agreement / without, {c['label']}", f"{c['ratio']:.2f}")
            for c in r["configs"]]  # fmt: skip


def pipeline_scan_summary(r: dict) -> Rows:
    return [(f"GPT {r['layers']}L/{r['hidden']}H written as one nn.scan / unrolled: step time on {row['where']}",
             f"{row['ratio']:.2f}") for row in r["rows"]]  # fmt: skip


def checkpoint_summary(r: dict) -> Rows:
    return [("checkpoint: save committed / orbax async save committed",
             f"{r['committed_vs_orbax']:.2f} (save() returns {r['returns_vs_orbax']:.2f}, "
             f"restore {r['restore_vs_orbax']:.2f})")]  # fmt: skip


def checkpoint_section(r: dict) -> str:
    return "\n".join([
        f"Parameters + AdamW state ({r['bytes'] / 1e6:.1f} MB) of a GPT on x=2,y=2,z=2; medians. "
        "Both sides asynchronous (orbax: `CheckpointManager` with async checkpointing, "
        "`StandardSave` / `StandardRestore` of the same pytree); restores timed until ready:",
        "",
        "| operation | axonn_jax | orbax | ratio |",
        "| --- | --- | --- | --- |",
        *(f"| {name} | {_ms(r[key])} | {_ms(r['orbax_' + key])} | {r[key + '_vs_orbax']:.2f} |"
          for name, key in (("`save()` returns", "returns"), ("save committed", "committed"),
                            ("restore", "restore"))),
    ])  # fmt: skip


def offload_summary(r: dict) -> Rows:
    rows = r["results"]
    base = rows.get("fp32, on device")
    streamed = rows.get("bf16, offload, streamed buckets")
    if not base or not streamed:
        return []
    return [("host offload: device model state, fp32 on device / bf16 offloaded (step time ratio)",
             f"{base['model state device'] / streamed['model state device']:.2f}× less "
             f"({streamed['time ratio']:.2f}× the fp32 step time)")]  # fmt: skip


def offload_section(r: dict) -> str:
    head = (f"Bytes per parameter per device on {r.get('grid', '?')} ({r.get('params', 0):,} "
            "parameters); time ratio = median step time / fp32 on device, same run:")
    return head + "\n\n" + r.get("table", "")


def mfu_summary(r: dict) -> Rows:
    if "skipped" in r:
        return [("GPU MFU", r["skipped"])]
    ours = r["axonn"]
    value = f"{ours['mfu']:.1%}" if "mfu" in ours else "needs --peak-tflops"
    return [(f"GPU MFU on {r['devices']}× {r['device']} ({r['dtype']})",
             f"{value} (axonn_jax / plain jax.jit step time {r['ratio']:.3f})")]  # fmt: skip


def mfu_section(r: dict) -> str:
    if "skipped" in r:
        return r["skipped"] + "."
    lines = [f"GPT ({r['params']:,} parameters, {r['dtype']}) on {r['devices']}× {r['device']}; "
             f"model FLOPs per step {r['model_flops']:.3g} (IPDPS'22 count, no recompute); "
             f"peak {r['peak_tflops'] or '?'} TFLOP/s per device.", "",
             "| step | TFLOP/s per device | MFU | XLA cost-analysis FLOPs / model FLOPs | (median) |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, title in (("axonn", "axonn_jax Grid(data=n)"), ("plain", "plain jax.jit, batch split")):
        row = r[name]
        mfu = f"{row['mfu']:.1%}" if "mfu" in row else "—"
        lines.append(f"| {title} | {row['tflops_per_device']:.3g} | {mfu} | "
                     f"{row['xla_flops'] / r['model_flops']:.2f} | ({_ms(row['step_s'])}) |")  # fmt: skip
    return "\n".join(lines)


def redundancy_summary(r: dict) -> Rows:
    if r.get("loss_rows"):
        models = dict.fromkeys(row["model"] for row in r["loss_rows"])
        return [(f"whole-step redundancy (loss included), {model}: loss planned (after gathered outputs)",
                 "; ".join(f"{row['planned']:.3f} ({row['gathered']:.3f}) {row['grid']}"
                           for row in r["loss_rows"] if row["model"] == model))
                for model in models]  # fmt: skip
    rows = r.get("rows") or []
    if not rows:
        return []
    worst = max(rows, key=lambda row: row["redundancy"])
    over = max(rows, key=lambda row: row["param_fraction"] - row["ideal_fraction"])
    return [(f"repeated work, {len(rows)} model × grid pairs: worst devices × per-device FLOPs "
             "/ plain FLOPs", f"{worst['redundancy']:.2f} ({worst['model']}, {worst['grid']})"),
            ("parameter share per device above 1/(x·y·z), worst",
             f"+{over['param_fraction'] - over['ideal_fraction']:.3f} ({over['model']}, {over['grid']})")]  # fmt: skip


def redundancy_section(r: dict) -> str:
    if r.get("loss_rows"):
        return ("Devices × per-device FLOPs / plain FLOPs of one loss-and-gradient step, counted on the "
                "traced programs (no compilation; pipelines: the stage programs the dispatch queue runs, "
                "one microbatch), with the loss after the model's gathered outputs and planned with the "
                "model (`pm.value_and_grad(loss)`; pipelines: with the last stage):\n\n" + r.get("table", ""))
    head = ("Compiled per-device program of `jax.jit(pm.value_and_grad(loss))` (loss included) "
            "vs the plain `jax.value_and_grad`, XLA's `cost_analysis()` FLOPs, same process; "
            "parameter bytes per device / total; loss and gradients vs the plain model:")
    return head + "\n\n" + r.get("table", "")


def balance_summary(r: dict) -> Rows:
    rows = [row for row in r.get("rows") or [] if not row.get("small")]
    if not rows:
        return []
    share = lambda row: max(row["after"]) * row["pipeline"]  # noqa: E731
    worst = max(rows, key=share)
    median = sorted(share(row) for row in rows)[len(rows) // 2]
    return [(f"automatic pipeline stages, {len(rows)} model × pipeline pairs at training sizes: "
             "largest FLOP share × stages (1.00 = even)",
             f"median {median:.2f}; worst {share(worst):.2f} ({worst['model']}, pipeline={worst['pipeline']})")]  # fmt: skip


def balance_section(r: dict) -> str:
    base = f" vs the partitioner of `{r['baseline']}` (before)" if r.get("baseline") else ""
    head = (f"Automatic pipeline stages{base}, planned from abstract shapes on `Grid(pipeline=p)`: "
            "each stage's share of the forward FLOPs (`partitioner.flops.equation_flops`), the "
            "largest share × p, and the modelled slowest stage (h100-node rates, one microbatch, "
            "forward + backward):")
    return head + "\n\n" + r.get("table", "")


FORMATTERS: dict[str, tuple[Callable[[dict], Rows], Callable[[dict], str]]] = {
    "redundancy": (redundancy_summary, redundancy_section),
    "partition_overhead": (overhead_summary, overhead_section),
    "planning_time": (planning_summary, planning_section),
    "report_time": (report_summary, report_section),
    "stage_balance": (balance_summary, balance_section),
    "gspmd_compare": (gspmd_summary, gspmd_section),
    "grid_prediction": (prediction_summary, prediction_section),
    "pipeline_bubble": (bubble_summary, bubble_section),
    "pipeline_async": (async_summary, lambda r: r["table"]),
    "pipeline_zero_bubble": (zero_bubble_summary, lambda r: r["table"]),
    "pipeline_hop": (hop_summary, hop_section),
    "mpi_step": (mpi_step_summary, lambda r: r["table"]),
    "call_agreement": (call_agreement_summary, lambda r: r["table"]),
    "pipeline_scan": (pipeline_scan_summary, lambda r: r["table"]),
    "checkpoint_save": (checkpoint_summary, checkpoint_section),
    "memory_offload": (offload_summary, offload_section),
    "gpu_mfu": (mfu_summary, mfu_section),
}

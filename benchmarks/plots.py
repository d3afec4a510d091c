"""PNG plots for ``benchmarks/run.py`` (matplotlib, headless).

Each function takes a benchmark's result dict and an output folder, writes one
figure and returns its path; :func:`plot_all` makes every plot it has data for.

Example::

    from plots import plot_all
    paths = plot_all({"gspmd_compare": result}, Path("benchmarks/results"))
"""

from __future__ import annotations

from pathlib import Path

KIND_COLOURS = {"all-gather": "#4c72b0", "all-reduce": "#dd8452", "reduce-scatter": "#55a868",
                "all-to-all": "#c44e52", "collective-permute": "#8172b3"}  # fmt: skip
FAMILY_COLOURS = {"axonn": "#4c72b0", "megatron": "#dd8452", "fsdp": "#55a868", "dp": "#8c8c8c"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _stacked_bars(names: list[str], parts: dict[str, tuple[list[float], str]], *,
                  xlabel: str, title: str, path: Path) -> Path:
    """Horizontal bars, one per name, stacked from ``{label: (MiB per name, colour)}``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    left = [0.0] * len(names)
    for label, (values, colour) in parts.items():
        ax.barh(names, values, left=left, color=colour, label=label)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def gspmd_collectives(result: dict, out: Path) -> Path:
    """Stacked bars: wire MiB per device and step by collective kind, per approach."""
    rows = result["rows"]
    parts = {kind: ([r["collectives"][kind]["wire_bytes"] / 2**20 for r in rows], colour)
             for kind, colour in KIND_COLOURS.items()}  # fmt: skip
    return _stacked_bars([r["name"] for r in rows],
                         {kind: part for kind, part in parts.items() if any(part[0])},
                         xlabel="MiB sent per device per train step (ring algorithms)",
                         title="Collective bytes: axonn_jax grids vs GSPMD",
                         path=out / "gspmd_collectives.png")  # fmt: skip


def gspmd_memory(result: dict, out: Path) -> Path:
    """Stacked bars per approach: params, optimizer state, temporaries (MiB per device)."""
    rows = result["rows"]
    parts = {label: ([r["memory"][key] / 2**20 for r in rows], colour)
             for label, key, colour in (("parameters", "params", "#4c72b0"),
                                        ("optimizer state", "opt_state", "#55a868"),
                                        ("temporaries (XLA)", "temp", "#c44e52"))}  # fmt: skip
    return _stacked_bars([r["name"] for r in rows], parts, xlabel="MiB per device",
                         title="Memory per device: axonn_jax grids vs GSPMD",
                         path=out / "gspmd_memory.png")  # fmt: skip


def gspmd_step_time(result: dict, out: Path) -> Path:
    """Bars: median step time as a ratio to the baseline, coloured by family."""
    plt = _pyplot()
    rows = sorted(result["rows"], key=lambda r: r["step_ratio"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    ax.barh([r["name"] for r in rows], [r["step_ratio"] for r in rows],
            color=[FAMILY_COLOURS.get(r["family"], "#8c8c8c") for r in rows])  # fmt: skip
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel(f"median step time / {result['baseline']} (8 simulated CPU devices)")
    ax.set_title("Step time ratio")
    return _save(fig, out / "gspmd_step_time.png")


def pipeline_bubble(result: dict, out: Path) -> Path | None:
    """Idle fraction vs microbatches per schedule (uniform tasks), with the theory curve;
    one line style per virtual-stage count."""
    runs = [r for r in result["results"] if r["mode"] == "uniform"]
    if not runs:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ms = sorted({r["m"] for r in runs})
    from sections import bubble_layout

    for v, style in zip(sorted({bubble_layout(r) for r in runs}), ("-", ":", "-.")):
        mine = [r for r in runs if bubble_layout(r) == v]
        tag = "" if v == "1" else f", virtual={v}"
        for schedule, label in (("gpipe", "GPipe"), ("1f1b", "1F1B"), ("message", "message-driven"),
                                ("zb-h1", "ZB-H1"), ("zb", "zero-bubble message-driven")):  # fmt: skip
            by_m = {r["m"]: r["idle_mean"] for r in mine if r["schedule"] == schedule}
            if not by_m:
                continue
            ax.plot(ms, [by_m.get(m) for m in ms], marker="o", linestyle=style, label=label + tag)
        theory = {r["m"]: r["theory"] for r in mine}
        ax.plot(ms, [theory.get(m) for m in ms], "k", linestyle="--" if v == "1" else style,
                label="theory (p−1)/(v·m+p−1)" + tag)  # fmt: skip
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("idle fraction (mean over ranks)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_ylim(0, 1)
    ax.set_title("Pipeline bubble, uniform tasks")
    ax.legend(fontsize=7)
    return _save(fig, out / "pipeline_bubble.png")


def plot_all(results: dict[str, dict], out: Path) -> list[Path]:
    """Every plot whose benchmark result is in ``results`` (name -> result dict)."""
    makers = {"gspmd_compare": (gspmd_collectives, gspmd_memory, gspmd_step_time),
              "pipeline_bubble": (pipeline_bubble,)}  # fmt: skip
    paths = []
    for name, functions in makers.items():
        if name in results:
            for fn in functions:
                path = fn(results[name], out)
                if path is not None:
                    paths.append(path)
    return paths

"""Soak: the GPT example for many steps under ``mpiexec``; is memory flat?

Launches ``mpiexec -n P python benchmarks/soak_worker.py ... -- <train_gpt.py
arguments>`` (the example, unchanged, with a per-step memory log per rank) and
meanwhile samples the resident set size of every rank from outside once per
``--interval`` seconds (psutil, or ``/proc/<pid>/status`` without it). Reports
per rank, from the in-process log:

* RSS and live JAX buffers (``jax.live_arrays()``: count and bytes on this
  rank's devices), mean over the first ``--window`` steps and over the last;
* the RSS slope after warm-up (least squares over steps ``window..end``) in
  KiB/step, and the growth it implies over those steps;

and, from the outside samples, RSS at mid-run and at the end with the slope
over the second half (the outside sampler does not see steps). Memory is called flat
when every rank grows by less than ``--tolerance-mib`` after warm-up and its
live-buffer count and bytes end where they were after warm-up. Exit status 1
when not flat.

    .venv/bin/python benchmarks/soak.py                      # 4 ranks, 500 steps, small GPT
    .venv/bin/python benchmarks/soak.py --steps 100 --procs 2 --grid pipeline=2
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SMALL_MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "8",
               "--microbatches", "2", "--sample-bytes", "8"]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=4, help="MPI ranks")
    p.add_argument("--grid", default="pipeline=2,data=2")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--window", type=int, default=50, help="steps in the first/last window")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between outside RSS samples")
    p.add_argument("--tolerance-mib", type=float, default=16.0,
                   help="largest RSS growth after warm-up still called flat")  # fmt: skip
    p.add_argument("--out", default="runs/soak", help="output directory")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the job is killed")
    p.add_argument("example_args", nargs="*", help="extra train_gpt.py arguments (after --)")
    args = p.parse_args(argv)
    if args.steps < 2 * args.window:
        p.error(f"--steps {args.steps} must be at least 2 × --window {args.window}")
    if args.procs < 1 or args.interval <= 0:
        p.error("--procs must be >= 1 and --interval > 0")
    return args


# --- outside sampling --------------------------------------------------------
def _children(pid: int) -> list[int]:
    """Every descendant process of ``pid``."""
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except ImportError:
        parents: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                parents.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [pid]
        while todo:
            for c in parents.get(todo.pop(), []):
                out.append(c)
                todo.append(c)
        return out
    except Exception:  # noqa: BLE001 - the process ended
        return []


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _is_worker(pid: int) -> bool:
    try:
        return "soak_worker.py" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


class Sampler(threading.Thread):
    """RSS of the workers under ``pid``, every ``interval`` seconds, until stopped."""

    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.rows: list[tuple[float, int, int]] = []  # (seconds, pid, rss KiB)
        self._stop_event = threading.Event()
        self._t0 = time.perf_counter()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            now = time.perf_counter() - self._t0
            for child in _children(self.pid):
                rss = _rss_kib(child) if _is_worker(child) else None
                if rss is not None:
                    self.rows.append((round(now, 2), child, rss))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


# --- analysis ----------------------------------------------------------------
def _slope(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.polyfit(x, y, 1)[0]) if len(x) > 1 else 0.0


def analyse_rank(rows: list[dict], window: int) -> dict:
    """First/last-window means, post-warm-up slope and live-buffer drift of one rank."""
    step = np.array([int(r["step"]) for r in rows])
    rss = np.array([int(r["rss_kib"]) for r in rows], dtype=float)
    count = np.array([int(r["live_arrays"]) for r in rows])
    nbytes = np.array([int(r["live_bytes"]) for r in rows])
    first, last, warm = slice(0, window), slice(len(rows) - window, len(rows)), step >= window
    slope = _slope(step[warm], rss[warm])
    return {
        "steps": len(rows),
        "rss_first_mib": rss[first].mean() / 1024,
        "rss_last_mib": rss[last].mean() / 1024,
        "rss_slope_kib_per_step": slope,
        "rss_growth_after_warmup_mib": slope * (step[-1] - window) / 1024,
        "live_arrays_first": int(count[first].max()),
        "live_arrays_last": int(count[last].max()),
        "live_arrays_after_warmup": int(count[window]),
        "live_mib_first": nbytes[first].max() / 2**20,
        "live_mib_last": nbytes[last].max() / 2**20,
        "live_mib_after_warmup": nbytes[window] / 2**20,
        "seconds_per_step_last": float(np.median(np.diff([float(r["seconds"]) for r in rows[last]]))),
    }


def analyse_outside(samples: list[tuple[float, int, int]]) -> dict[int, dict]:
    """Per worker pid: RSS at mid-run and over the last 10% of samples; slope over the second half.

    (The first half holds start-up and compilation; the outside sampler does not see steps.)
    """
    out = {}
    for pid in sorted({p for _, p, _ in samples}):
        t = np.array([s for s, p, _ in samples if p == pid])
        r = np.array([v for _, p, v in samples if p == pid], dtype=float)
        half, k = len(r) // 2, max(1, len(r) // 10)
        out[pid] = {"samples": len(r), "rss_mid_mib": r[half] / 1024,
                    "rss_last_mib": r[-k:].mean() / 1024,
                    "rss_slope_mib_per_min": _slope(t[half:], r[half:]) * 60 / 1024}  # fmt: skip
    return out


def verdict(ranks: dict[int, dict], tolerance_mib: float) -> tuple[bool, list[str]]:
    problems = []
    for rank, a in ranks.items():
        if a["rss_growth_after_warmup_mib"] > tolerance_mib:
            problems.append(f"rank {rank}: RSS grows {a['rss_slope_kib_per_step']:.0f} KiB/step "
                            f"({a['rss_growth_after_warmup_mib']:.0f} MiB after warm-up)")  # fmt: skip
        if (a["live_arrays_last"], a["live_mib_last"]) != (a["live_arrays_after_warmup"],
                                                          a["live_mib_after_warmup"]):  # fmt: skip
            problems.append(f"rank {rank}: live buffers {a['live_arrays_after_warmup']} → "
                            f"{a['live_arrays_last']} ({a['live_mib_after_warmup']:.2f} → "
                            f"{a['live_mib_last']:.2f} MiB)")  # fmt: skip
    return not problems, problems


def markdown(command: str, ranks: dict[int, dict], outside: dict[int, dict], flat: bool,
             problems: list[str], window: int, wall: float) -> str:  # fmt: skip
    lines = [f"command: `{command}` ({wall / 60:.1f} min)", "",
             f"| rank | RSS steps 0–{window - 1} MiB | RSS last {window} MiB | slope after warm-up "
             "KiB/step | growth after warm-up MiB | live buffers (after warm-up → last) | "
             "live MiB | s/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for rank, a in sorted(ranks.items()):
        lines.append(
            f"| {rank} | {a['rss_first_mib']:.1f} | {a['rss_last_mib']:.1f} | "
            f"{a['rss_slope_kib_per_step']:.1f} | {a['rss_growth_after_warmup_mib']:.1f} | "
            f"{a['live_arrays_after_warmup']} → {a['live_arrays_last']} | "
            f"{a['live_mib_after_warmup']:.2f} → {a['live_mib_last']:.2f} | "
            f"{a['seconds_per_step_last']:.2f} |"
        )
    lines += ["", "outside samples (per worker process):", "",
              "| pid | samples | RSS mid-run MiB | RSS last 10% MiB | slope, second half, MiB/min |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for pid, o in outside.items():
        lines.append(f"| {pid} | {o['samples']} | {o['rss_mid_mib']:.1f} | "
                     f"{o['rss_last_mib']:.1f} | {o['rss_slope_mib_per_min']:.2f} |")  # fmt: skip
    lines += ["", "memory flat: " + ("yes" if flat else "NO — " + "; ".join(problems))]
    return "\n".join(lines)


# --- driver --------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    example = ["--grid", args.grid, "--steps", str(args.steps), *SMALL_MODEL,
               "--out", str(out / "run"), "--fresh", *args.example_args]  # fmt: skip
    command = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.procs),
               sys.executable, str(ROOT / "benchmarks" / "soak_worker.py"),
               "--memory-dir", str(out / "memory"), "--", *example]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    shown = (f"mpiexec -n {args.procs} python benchmarks/soak_worker.py --memory-dir DIR -- "
             + " ".join(example))
    print(f"running: {shown}", flush=True)
    t0 = time.perf_counter()
    with (out / "job.log").open("w") as log:
        job = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = Sampler(job.pid, args.interval)
        sampler.start()
        try:
            code = job.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            code = job.wait()
        finally:
            sampler.stop()
    wall = time.perf_counter() - t0
    if code != 0:
        print(f"the job failed (exit {code}); see {out / 'job.log'}", file=sys.stderr)
        return 2
    with (out / "rss_samples.csv").open("w", newline="") as f:
        csv.writer(f).writerows([("seconds", "pid", "rss_kib"), *sampler.rows])
    ranks = {}
    for path in sorted((out / "memory").glob("rank*.csv")):
        with path.open() as f:
            ranks[int(path.stem[4:])] = analyse_rank(list(csv.DictReader(f)), args.window)
    outside = analyse_outside(sampler.rows)
    flat, problems = verdict(ranks, args.tolerance_mib)
    report = markdown(shown, ranks, outside, flat, problems, args.window, wall)
    (out / "summary.md").write_text(report + "\n")
    (out / "summary.json").write_text(json.dumps(
        {"command": shown, "wall_s": wall, "ranks": ranks,
         "outside": {str(k): v for k, v in outside.items()}, "flat": flat, "problems": problems},
        indent=2))  # fmt: skip
    print(report)
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())

"""Run every benchmark; write ``benchmarks/results/results.md`` and plots (``make bench``).

Each benchmark runs in its own process (its own number of simulated devices,
a time limit, and a crash cannot take the runner down) and hands back the dict
its ``main()`` returns, as JSON. The runner then writes one markdown document
— a summary table and a section per benchmark — plus PNG plots and the raw
``results.json``, and prints the markdown. A benchmark that is absent, fails,
times out or is skipped is reported as "not run: <reason>".

Every number that compares speed is a ratio of two measurements taken in the
same process; absolute times appear only in parentheses.

    .venv/bin/python benchmarks/run.py            # modest defaults (≈15 min on 2 CPU cores)
    .venv/bin/python benchmarks/run.py --quick    # a few minutes
    .venv/bin/python benchmarks/run.py --only gspmd_compare,pipeline_bubble --peak-tflops 989
    .venv/bin/python benchmarks/run.py --only pipeline_bubble --merge   # update one benchmark
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
CHILD = "--child"


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark script ``benchmarks/<name>.py`` whose ``main(argv)`` returns a dict.

    ``quick=None`` leaves it out of ``--quick`` runs. ``devices``: simulated
    CPU devices (``None``: the platform's own devices, GPUs included).
    ``markdown_flag``: a flag naming a file the benchmark writes its markdown
    report to; the runner points it at a temporary file and keeps the text.
    ``script``: the script's name when one script runs under two names (two
    sizes of one comparison), e.g. ``gspmd_compare_512`` runs ``gspmd_compare``.
    """

    name: str
    title: str
    args: tuple[str, ...] = ()
    quick: tuple[str, ...] | None = ()
    devices: int | None = 8
    timeout_s: int = 900
    markdown_flag: str | None = None
    script: str | None = None

    @property
    def module(self) -> str:
        """The script ``benchmarks/<module>.py`` this benchmark runs."""
        return self.script or self.name


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("partition_overhead", "Overhead on one device: axonn_jax vs plain jax.jit",
              ("--steps", "20"), ("--steps", "8", "--hidden", "128", "--layers", "2"),
              devices=1, timeout_s=600),  # fmt: skip
    Benchmark("planning_time", "Planning time for a large grid", (), ("--layers", "12"),
              devices=1, timeout_s=300),  # fmt: skip
    Benchmark("report_time", "Communication report cost", (), ("--layers", "12"),
              devices=1, timeout_s=300),  # fmt: skip
    # before: the last revision with the 25%-crossing filter and its own FLOP count
    Benchmark("stage_balance", "Pipeline stage balance by model kind", ("--baseline", "74591ed"),
              ("--models", "mlp,cnn,gpt"), devices=1, timeout_s=1800),  # fmt: skip
    Benchmark("gspmd_compare", "axonn_jax 4D grids vs GSPMD (Megatron TP, FSDP), hidden 256",
              ("--layers", "4", "--hidden", "256", "--rounds", "8"),
              ("--layers", "2", "--hidden", "128", "--grids", "data=8;x=2,y=2,z=2;z=8",
               "--megatron", "8x1", "--rounds", "3", "--per-round", "1"),
              timeout_s=1500),  # fmt: skip
    Benchmark("gspmd_compare_512", "axonn_jax 4D grids vs GSPMD (Megatron TP, FSDP), hidden 512",
              ("--layers", "4", "--hidden", "512", "--rounds", "8"), None, timeout_s=2400,
              script="gspmd_compare"),  # fmt: skip
    Benchmark("pipeline_bubble", "Pipeline bubble vs theory",
              ("--microbatches", "4,8,16", "--modes", "uniform,compute", "--task-ms", "100"),
              ("--microbatches", "4,8", "--modes", "uniform", "--virtual", "1"), devices=1,
              timeout_s=1200),  # fmt: skip
    Benchmark("pipeline_async", "Pipeline stages overlapping in one process",
              ("--rounds", "20"), ("--rounds", "4"), devices=2, timeout_s=600),  # fmt: skip
    Benchmark("pipeline_zero_bubble", "Zero-bubble schedules in one process: W filling the idle time",
              ("--rounds", "40"), ("--rounds", "2", "--layers", "4", "--rows", "64"), devices=2,
              timeout_s=600),  # fmt: skip
    Benchmark("pipeline_hop", "One pipeline hop: MpiTransport vs raw mpi4py",
              ("--rounds", "6", "--trips", "20"), ("--rounds", "2", "--trips", "10"),
              devices=1, timeout_s=600),  # fmt: skip
    Benchmark("mpi_step", "Pipelined step: one process vs mpiexec -n 2 (CPU collectives)",
              ("--rounds", "3", "--steps", "10"), ("--rounds", "1", "--steps", "4"),
              devices=1, timeout_s=1500),  # fmt: skip
    Benchmark("call_agreement", "The call agreement's cost on a pipelined step, one process and mpiexec -n 2",
              ("--blocks", "10", "--steps", "20"), ("--blocks", "2", "--steps", "5"), devices=1,
              timeout_s=900),  # fmt: skip
    Benchmark("pipeline_scan", "A scanned layer stack pipelined under mpiexec -n 2: scan vs unrolled",
              ("--rounds", "3", "--steps", "8"), ("--rounds", "1", "--steps", "2", "--layers", "2", "--hidden", "64"),
              devices=1, timeout_s=1800),  # fmt: skip
    Benchmark("grid_prediction", "Predicted vs measured step time over 8-device grids",
              ("--runs", "3", "--rounds", "8", "--per-round", "3"), None, timeout_s=2700,
              markdown_flag="--out"),  # fmt: skip
    Benchmark("checkpoint_save", "Checkpoint save and restore vs orbax",
              ("--repeats", "3"), ("--repeats", "2", "--hidden", "128", "--layers", "2"),
              timeout_s=600),  # fmt: skip
    Benchmark("memory_offload", "Device memory with host offload",
              ("--layers", "4", "--steps", "10"), ("--layers", "2", "--steps", "4"),
              timeout_s=900),  # fmt: skip
    Benchmark("gpu_mfu", "GPU model FLOPs utilisation", (), ("--steps", "5"), devices=None,
              timeout_s=900),  # fmt: skip
    Benchmark("redundancy", "Repeated work and parameter share per device (HF models × grids)",
              (), ("--models", "hf_gpt2,hf_wav2vec2", "--grids", "x=2,y=2,z=2;x=4,data=2"),
              timeout_s=1500),  # fmt: skip
    Benchmark("redundancy_loss", "Repeated work of the whole step, the loss planned with the model (GPT)",
              ("--planned-loss", "--grids", "x=4,data=2;x=2,y=2,z=2;pipeline=2,x=2,z=2;pipeline=2,x=4"),
              ("--planned-loss", "--grids", "x=4,data=2"), timeout_s=900, script="redundancy"),  # fmt: skip
)


@dataclasses.dataclass
class Outcome:
    """What one benchmark produced: its result dict, or why it did not run."""

    bench: Benchmark
    argv: list[str]
    result: dict | None = None
    reason: str | None = None
    seconds: float = 0.0

    @property
    def command(self) -> str:
        return shlex.join([".venv/bin/python", f"benchmarks/{self.bench.module}.py", *self.argv])


# ----------------------------------------------------------------------- child side


def jsonable(value):
    """``value`` with dict keys as strings, tuples as lists, unknown objects as ``str``."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    try:
        return jsonable(value.item())  # numpy / jax scalars
    except (AttributeError, TypeError, ValueError):
        return str(value)


def child_main(name: str, json_path: str, markdown_path: str, argv: list[str]) -> None:
    """Runs ``benchmarks/<name>.py``'s ``main(argv)`` and writes its dict to ``json_path``."""
    module = importlib.import_module(name)
    result = dict(module.main(argv) or {})
    if "table" not in result and hasattr(module, "table"):
        result["table"] = module.table(result)
    if markdown_path and Path(markdown_path).exists():
        result["markdown"] = Path(markdown_path).read_text()
    Path(json_path).write_text(json.dumps(jsonable(result)))


# ----------------------------------------------------------------------- parent side


def child_env(devices: int | None) -> dict[str, str]:
    """Environment of a benchmark process: ``devices`` simulated CPU devices, venv first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_child(command: list[str], env: dict, timeout_s: float, prefix: str) -> tuple[int | None, list[str]]:
    """Runs ``command`` in its own process group, echoing its output to stderr.

    Returns (exit code, last output lines); the exit code is ``None`` when the
    time limit killed it (the whole group: mpiexec and its ranks too).
    """
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, cwd=HERE.parent)  # fmt: skip
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=40)
    try:
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"[{prefix}] {line}", end="", file=sys.stderr, flush=True)
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            kill()
            proc.wait()
    return (None if killed.is_set() else proc.returncode), list(tail)


def _failure(tail: list[str]) -> str:
    lines = [l.strip() for l in tail if l.strip()]
    errors = [l for l in lines if "Error" in l or "error:" in l or l.startswith("benchmark failed")]
    return (errors or lines or ["no output"])[-1][:300]


def run_benchmark(bench: Benchmark, argv: list[str], workdir: Path) -> Outcome:
    """Runs one benchmark in a child process; never raises for the benchmark's own failures."""
    outcome = Outcome(bench, list(argv))
    if not (HERE / f"{bench.module}.py").exists():
        outcome.reason = f"benchmarks/{bench.module}.py is absent"
        return outcome
    json_path = workdir / f"{bench.name}.json"
    markdown_path = workdir / f"{bench.name}.md" if bench.markdown_flag else None
    if markdown_path:
        argv = [*argv, bench.markdown_flag, str(markdown_path)]
    command = [sys.executable, str(Path(__file__).resolve()), CHILD, bench.module, str(json_path),
               str(markdown_path or ""), *argv]  # fmt: skip
    t0 = time.perf_counter()
    code, tail = run_child(command, child_env(bench.devices), bench.timeout_s, bench.name)
    outcome.seconds = time.perf_counter() - t0
    if code is None:
        outcome.reason = f"timed out after {bench.timeout_s} s"
    elif code != 0 or not json_path.exists():
        outcome.reason = f"failed (exit {code}): {_failure(tail)}"
    else:
        outcome.result = json.loads(json_path.read_text())
    return outcome


# ----------------------------------------------------------------------- report


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _summary_rows(outcome: Outcome) -> list[tuple[str, str]]:
    from sections import FORMATTERS

    if outcome.result is None:
        return [(outcome.bench.title, f"not run: {outcome.reason}")]
    summary, _ = FORMATTERS.get(outcome.bench.module, (None, None))
    if summary is None:
        return [(outcome.bench.title, "see section")]
    try:
        return summary(outcome.result) or [(outcome.bench.title, "see section")]
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        return [(outcome.bench.title, f"result not understood ({type(e).__name__}: {e})")]


def _section(outcome: Outcome) -> str:
    from sections import FORMATTERS

    if outcome.result is None:
        body = f"not run: {outcome.reason}"
    else:
        _, section = FORMATTERS.get(outcome.bench.module, (None, None))
        try:
            body = section(outcome.result) if section else f"```\n{json.dumps(outcome.result, indent=1)}\n```"
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            body = f"result not understood ({type(e).__name__}: {e})"
    ran = f"{outcome.seconds:.0f} s; " if outcome.seconds else ""
    return f"## {outcome.bench.title}\n\n{body}\n\n*({ran}`{outcome.command}`)*\n"


def environment(command: str) -> dict:
    """Where and how the results were produced (recorded in results.json)."""
    try:
        jax_version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        jax_version = "?"
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    return {
        "command": command,
        "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "load": [round(x, 1) for x in load],
        "python": platform.python_version(),
        "jax": jax_version,
    }


def markdown(outcomes: list[Outcome], plots: list[Path], env: dict) -> str:
    """The combined results document."""
    load = ", ".join(str(x) for x in env["load"]) or "?"
    lines = [
        "# axonn_jax benchmarks",
        "",
        f"Produced by `{env['command']}` (finished {env['finished']}) on an {env['machine']} host "
        f"with {env['cores']} CPU cores (load average {load} at the end, other work included), "
        f"Python {env['python']}, jax {env['jax']}. Speed comparisons are ratios of two "
        "measurements taken in the same process (absolute times in parentheses); 8 devices are "
        "simulated on the host's CPU cores unless a section says otherwise. See docs/benchmarks.md.",
        *(["", "Since then: " + "; ".join(env["reruns"]) + "."] if env.get("reruns") else []),
        "",
        "## Summary",
        "",
        "| benchmark | measure | result |",
        "| --- | --- | --- |",
    ]
    for outcome in outcomes:
        for measure, value in _summary_rows(outcome):
            lines.append(f"| {outcome.bench.name} | {_cell(measure)} | {_cell(value)} |")
    lines.append("")
    lines += [_section(o) for o in outcomes]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)


def save(outcomes: list[Outcome], env: dict, out: Path) -> str:
    """Writes results.json, the plots and results.md into ``out``; returns the markdown."""
    from plots import plot_all

    runs = [{"name": o.bench.name, "argv": o.argv, "seconds": o.seconds, "result": o.result,
             "reason": o.reason} for o in outcomes]  # fmt: skip
    (out / "results.json").write_text(json.dumps({"environment": env, "runs": runs}, indent=1))
    results = {o.bench.name: o.result for o in outcomes if o.result is not None}
    text = markdown(outcomes, plot_all(results, out), env)
    (out / "results.md").write_text(text)
    return text


def load(out: Path) -> tuple[list[Outcome], dict]:
    """Outcomes and environment from ``out``/results.json (for ``--render``)."""
    data = json.loads((out / "results.json").read_text())
    known = {b.name: b for b in BENCHMARKS}
    outcomes = [Outcome(known.get(r["name"], Benchmark(r["name"], r["name"])), r["argv"],
                        r["result"], r["reason"], r["seconds"]) for r in data["runs"]]  # fmt: skip
    return outcomes, data["environment"]


# ----------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    names = [b.name for b in BENCHMARKS]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller settings, a few minutes")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(names)}")
    ap.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak TFLOP/s of one GPU for the MFU benchmark")  # fmt: skip
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for results.md and plots")
    ap.add_argument("--merge", action="store_true",
                    help="with --only: keep the other benchmarks' results from --out/results.json "
                         "and replace the ones run now")  # fmt: skip
    ap.add_argument("--render", action="store_true",
                    help="run nothing: remake results.md and plots from --out/results.json")  # fmt: skip
    args = ap.parse_args(argv)
    for flag in ("only", "skip"):
        unknown = [n for n in getattr(args, flag).split(",") if n and n not in names]
        if unknown:
            ap.error(f"--{flag}: unknown benchmark(s) {unknown}; known: {names}")
    return args


def plan_runs(args: argparse.Namespace) -> list[tuple[Benchmark, list[str], str | None]]:
    """(benchmark, argv, reason not to run) for every selected benchmark, in order.

    Benchmarks left out by ``--only`` / ``--skip`` are not listed; those that
    ``--quick`` leaves out are, with the reason.
    """
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    runs = []
    for bench in BENCHMARKS:
        left_out = args.quick and bench.quick is None
        argv = list(bench.args if left_out or not args.quick else bench.quick)
        if bench.name == "gpu_mfu" and args.peak_tflops:
            argv += ["--peak-tflops", str(args.peak_tflops)]
        if (only and bench.name not in only) or bench.name in skip:
            continue
        if left_out:
            runs.append((bench, argv, "skipped with --quick"))
        else:
            runs.append((bench, argv, None))
    return runs


def main(argv=None) -> str:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        outcomes, env = load(out)
        text = save(outcomes, env, out)
        print(text)
        return text
    given = sys.argv[1:] if argv is None else list(argv)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="axonn-bench-") as tmp:
        for bench, bench_argv, reason in plan_runs(args):
            if reason:
                outcomes.append(Outcome(bench, bench_argv, reason=reason))
                continue
            print(f"== {bench.name}: {' '.join(bench_argv)}", file=sys.stderr, flush=True)
            outcomes.append(run_benchmark(bench, bench_argv, Path(tmp)))
    env = environment(shlex.join([".venv/bin/python", "benchmarks/run.py", *given]))
    if args.merge:
        outcomes, env = merged(out, outcomes, env)
    text = save(outcomes, env, out)
    print(text)
    return text


def merged(out: Path, fresh: list[Outcome], env: dict) -> tuple[list[Outcome], dict]:
    """The previous run's outcomes with ``fresh`` ones in their place (registry order), and
    its environment with a note of what was re-run, by which command, when."""
    previous, base = load(out)
    by_name = {o.bench.name: o for o in previous} | {o.bench.name: o for o in fresh}
    order = [b.name for b in BENCHMARKS] + [n for n in by_name if n not in {b.name for b in BENCHMARKS}]
    names = ", ".join(o.bench.name for o in fresh)
    base = dict(base, reruns=[*base.get("reruns", []),
                              f"{names} re-run by `{env['command']}` (finished {env['finished']}, "
                              f"load average {', '.join(str(x) for x in env['load']) or '?'})"])  # fmt: skip
    return [by_name[n] for n in order if n in by_name], base


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    else:
        main()

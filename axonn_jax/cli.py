"""``axonn-jax``: plan grids for a model on a machine, and profile this machine.

Examples::

    axonn-jax plan --gpus 1024 --machine perlmutter \\
        --layers 42 --hidden 12288 --heads 96 --seq 2048 --batch 8192 --vocab 51200
    axonn-jax plan --gpus 64 --machine frontier --model mypkg.models:make --top 5 --json
    axonn-jax profile --devices 8 --out this-machine.json
    axonn-jax plan --gpus 8 --machine this-machine.json --layers 2 --hidden 256 ...
    axonn-jax machines

``--model module:factory`` imports ``module`` and calls ``factory()``, which
returns ``(flax_model, example_inputs)`` (a tuple of arrays or
``jax.ShapeDtypeStruct``, or a single one); the dims are read from the
partitioner's plan of that model (no devices are used).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
import traceback

GPT_FLAGS = ("layers", "hidden", "heads", "seq", "batch", "vocab")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from axonn_jax import __version__
    from axonn_jax.perf.options import SCHEDULES
    from axonn_jax.partitioner.grid import PLACEMENTS
    from axonn_jax.search import OFFLOAD_CHOICES, RECOMPUTE_CHOICES, UPDATE_ON_CHOICES

    ap = argparse.ArgumentParser(prog="axonn-jax", description="AxoNN for JAX: grid planner and tools")
    ap.add_argument("--version", action="version", version=f"axonn-jax {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="rank the (x, y, z, data, pipeline) grids for a model",
                          description="Rank every grid for N GPUs by predicted step time.")  # fmt: skip
    plan.add_argument("--gpus", type=int, required=True, help="number of GPUs (devices)")
    plan.add_argument("--machine", required=True,
                      help="built-in profile (see `axonn-jax machines`) or a profile JSON file")  # fmt: skip
    model = plan.add_argument_group("model (GPT flags, or --model)")
    for flag, what in zip(GPT_FLAGS, ("transformer blocks", "hidden size", "attention heads",
                                      "sequence length", "global batch in sequences",
                                      "vocabulary size")):  # fmt: skip
        model.add_argument(f"--{flag}", type=int, help=what)
    model.add_argument("--ffn", type=int, help="MLP hidden size (default 4 × hidden)")
    model.add_argument("--untied", action="store_true", help="untied output head")
    model.add_argument("--model", help="module:factory returning (flax model, example inputs)")
    plan.add_argument("--top", type=int, default=10, help="how many configurations (default 10)")
    plan.add_argument("--json", action="store_true", help="print JSON: one object per configuration")
    plan.add_argument("--precision", choices=("mixed", "fp32"), default="mixed",
                      help="mixed: bf16 weights and gradients, fp32 master + Adam (16 B/param, 12 "
                           "offloadable); fp32: 16 B/param (8 offloadable)")  # fmt: skip
    plan.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="auto",
                      help="activation checkpointing of every block (auto: searched, default)")  # fmt: skip
    plan.add_argument("--no-recompute", action="store_true", help="the same as --recompute off")
    plan.add_argument("--offload", choices=OFFLOAD_CHOICES, default="auto",
                      help="optimizer state in host memory (auto: whichever is faster and fits)")  # fmt: skip
    plan.add_argument("--update-on", choices=UPDATE_ON_CHOICES, default="auto",
                      help="where an offloaded update runs: host, or device (the host state streamed "
                           "through it in buckets); auto: both are priced")  # fmt: skip
    plan.add_argument("--no-pipeline", action="store_true", help="only grids with pipeline = 1")
    plan.add_argument("--microbatches", type=int, help="fix the microbatches (default: searched)")
    plan.add_argument("--virtual", type=int,
                      help="fix the pipeline stages per rank (default: searched)")
    plan.add_argument("--placement", choices=PLACEMENTS, default="interleaved",
                      help="which rank runs each virtual stage: interleaved (s mod p) or v "
                           "(V-shaped, virtual 2; default interleaved)")  # fmt: skip
    plan.add_argument("--schedule", choices=(*SCHEDULES, "auto"), default="message",
                      help="pipeline schedule priced (zb, zb-h1, zb-v: zero bubble, zb-v with "
                           "--placement v only; auto: search those priced differently; default message)")  # fmt: skip
    plan.add_argument("--no-scatter-batch", action="store_true",
                      help="price the all-reduce form (partition(..., scatter_batch=False)): each "
                           "layer's partial sums all-reduced, not reduce-scattered onto the batch")  # fmt: skip
    plan.add_argument("--loss", choices=("planned", "gathered"), default="planned",
                      help="planned (default): a softmax cross-entropy planned with the model, as "
                           "pm.train_step runs it (its max and sums all-reduced over x, one row per "
                           "output token); gathered: the loss of a jitted step after pm.apply's "
                           "gathered outputs")  # fmt: skip
    plan.add_argument("--efficiency", type=float,
                      help="fraction of peak FLOP/s compute reaches (default: the profile's)")  # fmt: skip
    plan.add_argument("--check", "--check-memory", dest="check", type=int, nargs="?", const=3, default=0,
                      metavar="K",
                      help="compile the top K (default 3) configurations' train steps ahead of time "
                           "on this machine's devices, drop those whose compiled bytes exceed "
                           "the device memory, and reorder the rest by the step time their compiled "
                           "programs imply (CPU: --gpus devices are simulated)")  # fmt: skip
    plan.add_argument("--within", type=float, metavar="FRACTION",
                      help="with --check: also compile every configuration predicted within this "
                           "share of the first's step time (default 0.1: the analytical model's near "
                           "ties, which it does not order; 0: the top K only)")  # fmt: skip
    plan.add_argument("--trial", type=int, nargs="?", const=10, default=0, metavar="STEPS",
                      help="with --check: also run each checked configuration STEPS (default 10) "
                           "timed steps on this machine's devices (twice, in opposite orders) and "
                           "reorder by the measured median step; run it where the job will run")  # fmt: skip

    prof = sub.add_parser("profile", help="measure this machine and write a profile JSON",
                          description="Collective bandwidth/latency by group, GEMM rate, memory.")  # fmt: skip
    prof.add_argument("--devices", type=int, default=8,
                      help="devices to profile; on CPU this many are simulated (default 8)")  # fmt: skip
    prof.add_argument("--out", default="machine-profile.json", help="where to write the profile")
    prof.add_argument("--name", help="profile name (default measured-<platform>-<devices>)")
    prof.add_argument("--repeats", type=int, default=21,
                      help="timed runs per measurement, the best is kept (default 21)")  # fmt: skip

    machines = sub.add_parser("machines", help="list the built-in machine profiles")
    return ap, {"plan": plan, "profile": prof, "machines": machines}


def main(argv=None) -> int:
    """Entry point of the ``axonn-jax`` script; returns the exit status (2: bad arguments)."""
    parser, commands = _parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        return _plan(commands["plan"], args)
    if args.command == "profile":
        return _profile(commands["profile"], args)
    return _machines()


# --- plan -------------------------------------------------------------------
def _plan(parser: argparse.ArgumentParser, args) -> int:
    from axonn_jax.perf import machines
    from axonn_jax.perf.options import Options
    from axonn_jax.partitioner.grid import Grid
    from axonn_jax.search import PRICED_SCHEDULES, search

    if args.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {args.gpus}")
    if args.top < 1:
        parser.error(f"--top must be >= 1, got {args.top}")
    if args.microbatches is not None and args.microbatches < 1:
        parser.error(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.virtual is not None and args.virtual < 1:
        parser.error(f"--virtual must be >= 1 (stages per pipeline rank), got {args.virtual}")
    if args.placement == "v" and args.virtual != 2:
        parser.error(f"--placement v needs --virtual 2 (rank r runs stages r and 2p-1-r), got "
                     f"--virtual {args.virtual}; remedy: --virtual 2, or --placement interleaved")
    if args.schedule == "zb-v" and args.placement != "v":
        parser.error("--schedule zb-v runs on the V-shaped placement; remedy: --virtual 2 --placement v, "
                     "or --schedule zb / zb-h1")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        parser.error(f"--efficiency must be in (0, 1], got {args.efficiency}")
    try:
        machine = machines.get(args.machine)
    except ValueError as e:
        parser.error(str(e))
    if args.efficiency is not None:
        machine = machine.with_efficiency(args.efficiency)
    if args.check < 0:
        parser.error(f"--check must be >= 0, got {args.check}")
    if args.trial < 0:
        parser.error(f"--trial must be >= 0 (timed steps per configuration), got {args.trial}")
    if args.trial and not args.check:
        parser.error("--trial times the configurations --check compiles; remedy: add --check [K]")
    if args.within is not None and not args.check:
        parser.error("--within widens the configurations --check compiles; remedy: add --check [K]")
    if args.within is not None and args.within < 0:
        parser.error(f"--within must be >= 0 (a share of the first's predicted step time), got {args.within}")
    if args.no_recompute and args.recompute != "auto":
        parser.error(f"--no-recompute is --recompute off; it cannot be combined with --recompute {args.recompute}")
    recompute = "off" if args.no_recompute else args.recompute
    schedule = "message" if args.schedule == "auto" else args.schedule
    if args.check:
        _simulate_cpu_devices(args.gpus)
    source = _spec(parser, args)
    spec = source.for_grid(Grid())  # the model's sizes and name (a traced model: its one-device plan)
    options = Options(precision=args.precision, schedule=schedule, scatter_batch=not args.no_scatter_batch,
                      loss_rows=loss_rows(spec, args.loss))  # fmt: skip
    model = _model(parser, args) if args.check else None
    t0 = time.perf_counter()
    result = search(source, args.gpus, machine, options=options, top=args.top,
                    offload=args.offload, update_on=args.update_on, pipeline=not args.no_pipeline,
                    microbatches=args.microbatches, virtual=args.virtual, recompute=recompute,
                    schedules=(PRICED_SCHEDULES + ("zb-v",) * (args.placement == "v")
                               if args.schedule == "auto" else None),
                    placement=args.placement)  # fmt: skip
    seconds = time.perf_counter() - t0
    checks = None
    if model is not None and result.ranked:
        from axonn_jax.compiled_check import rerank

        checks, checked = _check(model, result, args.check, machine, args.trial, args.within)
        kept = rerank(checks)
        result = dataclasses.replace(result, ranked=tuple(c.prediction for c in kept))
    # grids where the partitioner falls back (a dim it does not divide): priced on their own plan
    own_plan = {p.grid for p in result.ranked if source.for_grid(p.grid) is not spec}
    if args.json:
        rows = [{**p.as_dict(), "grid_flag": _grid_flag(p.grid), "own_plan": p.grid in own_plan}
                for p in result.ranked]  # fmt: skip
        if checks is not None:
            rows = [{**row, "compiled_check": c.as_dict()} for row, c in zip(rows, kept)]
        print(json.dumps(rows, indent=2))
    elif result.ranked:
        print(_table(spec, machine, options, args.gpus, result, seconds, recompute, own_plan))
        if checks is not None:
            from axonn_jax.compiled_check import NEAR_TIE, format_checks

            by = (f"the median of {args.trial} steps run here (the lesser of two passes)" if args.trial
                  else "the compiled ms")  # fmt: skip
            ties = checked - min(args.check, checked)
            which = f"the top {args.check}" + (f" and {ties} more predicted within {args.within or NEAR_TIE:.0%} "
                                               "of the first" if ties else "")  # fmt: skip
            print(f"\n{which} compiled ahead of time on this machine's devices (limit "
                  f"{machine.memory_gib:g} GiB per device; compiled ms: XLA's FLOPs, bytes and "
                  f"collectives of the program on {machine.name}; the table above is reranked by "
                  f"{by}):\n{format_checks(checks)}")  # fmt: skip
        if result.ranked:
            print(_launch(result.ranked[0]))
    if not result.ranked:
        print(f"axonn-jax plan: no grid of {args.gpus} GPUs divides and fits {spec.name} "
              f"({result.summary()}). Remedy: {_no_grid_remedy(result.rejected)}.", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _no_grid_remedy(rejected) -> str:
    """What to change when every grid was rejected, by why they were."""
    remedies = []
    if rejected.get("do not divide the model") or rejected.get("do not divide the batch into microbatches"):
        remedies.append("a GPU count whose factors divide the model's dims and batch (e.g. a power of 2), "
                        "or model dims with more factors of 2")  # fmt: skip
    if rejected.get("do not fit memory"):
        remedies.append("more GPUs, --offload on, or a machine with more memory")
    if rejected.get("refused by the partitioner"):
        remedies.append("see why with axonn_jax.partition(model, grid, ...) on one of the grids")
    return "; ".join(remedies) or "more GPUs"


def loss_rows(spec, loss: str = "planned") -> int:
    """``Options.loss_rows`` of the program the launch line runs: ``pm.train_step`` plans a
    softmax cross-entropy with the model on every row of its vocabulary-split outputs (the
    example's :func:`~axonn_jax.models.next_token_loss` on loader windows: batch·seq rows);
    0 for ``"gathered"`` (a loss after ``pm.apply``) or a model without split outputs."""
    return spec.tokens if loss == "planned" and spec.split_outputs else 0


def _check(model, result, k: int, machine, trial_steps: int = 0, within: float | None = None):
    """The compiled checks (and ``trial_steps`` timed steps) of the top ``k`` configurations
    and those predicted ``within`` of the first (:func:`~axonn_jax.compiled_check.to_check`),
    then the others unchecked; and how many were checked."""
    from axonn_jax.compiled_check import NEAR_TIE, CompiledCheck, check_compiled, to_check

    flax_model, inputs = model
    limit = machine.memory_gib * 2**30
    candidates = to_check(result.ranked, k, NEAR_TIE if within is None else within)
    checked = check_compiled(flax_model, inputs, candidates, limit_bytes=limit, machine=machine,
                             trial_steps=trial_steps)  # fmt: skip
    beyond = f"beyond the top {k} and their near ties" if len(candidates) > k else f"beyond the top {k}"
    return checked + [CompiledCheck(p, limit, note=beyond) for p in result.ranked[len(candidates):]], len(candidates)


def _model(parser, args) -> tuple:
    """``(flax model, example inputs)`` for the memory check: the factory's, or the GPT of
    the flags (its spec is :func:`~axonn_jax.perf.spec.gpt_spec` of the same flags)."""
    import jax
    import jax.numpy as jnp

    if args.model:
        model, inputs = _made_model(parser, args.model)
        if isinstance(inputs, dict):
            parser.error(f"--model {args.model}: --check compiles steps of positional inputs; the factory "
                         "returns keyword inputs (a dict). Remedy: plan without --check, or return a tuple "
                         "of the inputs in the order the model takes them.")  # fmt: skip
        return model, inputs
    from axonn_jax.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=args.vocab, num_layers=args.layers, hidden=args.hidden,
                       num_heads=args.heads, max_seq_len=args.seq, ffn_hidden=args.ffn,
                       tie_embeddings=not args.untied)  # fmt: skip
    return GPT(config), (jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32),)


def _spec(parser, args):
    from axonn_jax.perf.spec import gpt_spec

    given = [f for f in GPT_FLAGS if getattr(args, f) is not None]
    if args.model:
        if given:
            parser.error(f"--model cannot be combined with the GPT flags (got --{', --'.join(given)})")
        return _spec_from_factory(parser, args.model)
    missing = [f for f in GPT_FLAGS if getattr(args, f) is None]
    if missing:
        parser.error(
            f"a model is needed: either --model module:factory, or all of --{', --'.join(GPT_FLAGS)} "
            f"(missing --{', --'.join(missing)})"
        )
    for flag in GPT_FLAGS + ("ffn",):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be >= 1, got {value}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    return gpt_spec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                    batch=args.batch, vocab=args.vocab, ffn=args.ffn, tied=not args.untied)  # fmt: skip


def _spec_from_factory(parser, target: str):
    from axonn_jax.perf.traced import PerGridSpec

    model, inputs = _made_model(parser, target)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    try:
        return PerGridSpec(model, *args, name=f"{target} ({type(model).__name__})", **kwargs)
    except Exception as e:  # noqa: BLE001 - tracing the user's model: its error, named, not a traceback
        parser.error(f"--model {target}: cannot plan the model: {type(e).__name__}: {e}")


def _made_model(parser, target: str) -> tuple:
    """``(flax model, example inputs)`` from the factory ``target`` names: the inputs as a
    tuple (positional), or a dict (keyword inputs, ``model(**inputs)``); a factory that
    raises, or returns something else, is a usage error naming it."""
    try:
        made = _factory(parser, target)()
    except Exception as e:  # noqa: BLE001 - the user's code: say where it failed, not a traceback of ours
        frame = traceback.extract_tb(e.__traceback__)[-1]
        parser.error(f"--model {target}: the factory raised {type(e).__name__}: {e} "
                     f"(at {frame.filename}:{frame.lineno}). Remedy: fix the factory; it takes no "
                     "arguments and returns (flax model, example inputs).")  # fmt: skip
    if not (isinstance(made, tuple) and len(made) == 2):
        parser.error(
            f"--model {target}: the factory must return (flax model, example inputs), got "
            f"{type(made).__name__}"
        )
    model, inputs = made
    if isinstance(inputs, dict):
        return model, dict(inputs)
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _factory(parser, target: str):
    """The callable ``module:factory`` names (imported like ``python -m`` would)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        parser.error(f"--model must be module:factory (e.g. mypkg.models:make_gpt), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules next to the caller
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        parser.error(f"--model {target}: cannot import {module_name!r}: {e}")
    factory = getattr(module, attr, None)
    if not callable(factory):
        parser.error(f"--model {target}: {module_name!r} has no callable {attr!r}")
    return factory


def _grid_flag(grid) -> str:
    """``z=4,data=2``: the axes larger than 1, as ``--grid`` and ``Grid.parse`` take them."""
    sizes = {"x": grid.x, "y": grid.y, "z": grid.z, "data": grid.data, "pipeline": grid.pipeline,
             "virtual": grid.virtual}
    flag = ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "x=1"
    return flag + (f",placement={grid.placement}" if grid.placement != "interleaved" else "")


def _launch(best) -> str:
    """How to run the top-ranked configuration: the example's flags and the Python call."""
    flag = _grid_flag(best.grid)
    mb, offload = best.options.microbatches, best.options.offload
    streamed = offload and best.options.update_on == "device"
    schedule = best.options.schedule if best.bubble else "message"  # no pipeline: no schedule
    remat = best.options.recompute
    step = ([f"microbatches={mb}"] * (mb > 1) + ["offload=True"] * offload + ['update_on="device"'] * streamed
            + [f'schedule="{schedule}"'] * (schedule != "message") + ['remat="full"'] * remat)  # fmt: skip
    args = flag.replace(",", ", ").replace("placement=v", 'placement="v"')
    python = f"axonn_jax.Grid({args})"
    if not best.options.scatter_batch:
        python = f"partition(model, {python}, ..., scatter_batch=False)"
    if step:
        python += f" and pm.train_step(..., {', '.join(step)})"
    return (f"\nto launch rank 1: --grid {flag} --microbatches {mb}{' --offload' * offload}"
            f"{' --update-on device' * streamed}"
            f"{' --remat full' * remat}"
            f"   (in Python: {python})")


def _count(n: float) -> str:
    """A parameter count as people write it: ``1.23B``, ``45.60M``, or exactly below a million.

    >>> _count(80.6e9), _count(239_488), _count(1.5e6)
    ('80.60B', '239,488', '1.50M')
    """
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{int(n):,}"


def _table(spec, machine, options, gpus, result, seconds, recompute: str = "auto", own_plan=frozenset()) -> str:
    head = (
        f"{spec.name}: {_count(spec.num_params)} parameters, {spec.tokens:,} tokens per step, "
        f"on {gpus} × {machine.name}\n"
        f"compute at {machine.peak_tflops:g} TFLOP/s × {machine.efficiency:g}; "
        f"{options.precision} precision; "
        f"loss {'planned with the model' if options.loss_rows else 'after the gathered outputs'}; "
        f"activation checkpointing {'searched' if recompute == 'auto' else recompute}; "
        f"{result.summary()}; searched in {seconds:.2f} s"
    )
    # MiB where every total is under 1 GiB: a small model's columns would all read 0.0
    unit, scale = ("GiB", 2**30) if any(p.memory.device >= 2**30 for p in result.ranked) else ("MiB", 2**20)
    cols = ("rank", "x", "y", "z", "data", "pipe", "mb", "virt", "remat", "sched", "offload",
            "comm s", "compute s", "step s", "bubble", f"params {unit}", f"grads {unit}", f"optim {unit}",
            f"activ {unit}", f"total {unit}")  # fmt: skip
    rows = [cols]
    for i, p in enumerate(result.ranked, 1):
        g, m = p.grid, p.memory
        o = p.options
        virt = f"{g.virtual}V" if g.placement == "v" else str(g.virtual)
        rows.append((f"{i}*" if g in own_plan else str(i), str(g.x), str(g.y), str(g.z), str(g.data), str(g.pipeline),
                     str(o.microbatches), virt, "yes" if o.recompute else "no",
                     o.schedule if p.bubble else "-", o.update_on if o.offload else "no",  # no pipeline: no bubble
                     f"{p.comm_seconds:.3g}", f"{p.compute_seconds:.3g}", f"{p.step_seconds:.3g}",
                     f"{p.bubble:.0%}", *(f"{b / scale:.1f}" for b in (m.params, m.grads, m.optimizer,
                                                                        m.activations, m.device))))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [head, ""]
    for k, row in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    if own_plan:
        lines.append("* the partitioner falls back on this grid (a dim it does not divide stays whole or takes "
                     "another axis): priced on the grid's own plan; partition(...).report() shows the moves")
    return "\n".join(lines)


# --- profile ----------------------------------------------------------------
def _profile(parser, args) -> int:
    if args.devices < 2:
        parser.error(f"--devices must be >= 2 (collectives need a group), got {args.devices}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    _simulate_cpu_devices(args.devices)
    import jax

    from axonn_jax.perf import machines
    from axonn_jax.perf.microbench import measure_machine

    devices = jax.devices()
    if len(devices) < args.devices:
        parser.error(
            f"--devices {args.devices}: this process sees {len(devices)} {devices[0].platform} "
            "devices (JAX was initialised before the flag could take effect, or there are fewer)"
        )
    machine = measure_machine(devices[: args.devices], name=args.name, repeats=args.repeats)
    machines.save(machine, args.out)
    print(f"wrote {args.out}: {machine.name}, GEMM {machine.peak_tflops * 1e3:.1f} GFLOP/s per device")
    print("group (inner, size)   bandwidth GB/s   latency us")
    for key in sorted(machine.intra_node):
        print(f"{str(key):>19}   {machine.intra_node[key]:14.3g}   {machine.latency_us[key]:10.1f}")
    return 0


def _simulate_cpu_devices(n: int) -> None:
    """On CPU, ``n`` simulated devices (effective only if JAX has not started yet)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _machines() -> int:
    from axonn_jax.perf.machines import BUILTIN

    for m in BUILTIN.values():
        print(f"{m.name}: {m.gpus_per_node} GPUs/node, {m.peak_tflops:g} TFLOP/s, "
              f"{m.memory_gib:g} GiB, inter-node {m.inter_node_gbps:g} GB/s\n  source: {m.source}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train a small GPT with axonn_jax's 4D tensor parallelism and pipeline, on your data or ours.

The embedded default that ``make demo`` runs: a small byte-level GPT on the
docstrings of Python's standard library, 8 simulated CPU devices, grid
pipeline=2, x=2, z=2 (two pipeline stages, each 2-way tensor parallel with
depth-sharded weights), 4 microbatches through AxoNN's message-driven pipeline.

    python examples/train_gpt.py                                   # the default
    python examples/train_gpt.py --grid z=4,data=2 --steps 100     # no pipeline
    mpiexec -n 4 python examples/train_gpt.py --grid pipeline=2,data=2
    mpiexec -n 4 python examples/train_gpt.py --grid pipeline=4
    python examples/train_gpt.py --data notes.txt                  # your text, as bytes
    python examples/train_gpt.py --data notes.txt --tokenizer my-tokenizer/   # a local tokenizer
    python examples/train_gpt.py --data tokens.bin --data-dtype uint16        # token ids (memmap)

Data (``--data``): a text file is read as bytes (vocabulary 256) or encoded by
``--tokenizer`` (a local directory saved with ``save_pretrained``; needs
``transformers`` or ``tokenizers``); ``.npy`` and raw ``.bin`` files hold token
ids (vocabulary: the tokenizer's, else the largest id + 1). The last 5% is held
out for validation. Batches come from :class:`axonn_jax.loader.Loader`:
windows of ``--seq + 1`` tokens, a pure function of ``(--seed, step)``, each
process reading only its rows; its position is saved with every checkpoint.

Writes ``metrics.csv`` (step, loss, next-token accuracy, tokens_per_s, …), ``loss.png`` and, with a
pipeline, ``timeline.png`` + ``trace.json`` (Perfetto) of the last step under
``--out`` (default ``runs/gpt-<grid>``), and prints a generated sample.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The example's command line (every flag is listed in the README)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="pipeline=2,x=2,z=2",
                   help="e.g. pipeline=2,x=2,z=2 or x=2,y=2,z=2 or pipeline=2,data=2")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default: 4 with a pipeline, else 1)")
    p.add_argument("--data", default=None,
                   help="training data: a text file, or token ids in .npy / raw .bin "
                        "(default: Python's standard-library docstrings)")
    p.add_argument("--data-dtype", default=None, choices=("uint8", "uint16", "uint32", "int32"),
                   help="dtype of the ids in a raw .bin file")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="encode a text --data with this local tokenizer (transformers or tokenizers)")
    p.add_argument("--schedule", default="message", choices=("message", "1f1b", "gpipe"),
                   help="pipeline schedule")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay to 0.1x)")
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="steps over which the learning rate decays (default: --steps; after "
                        "--resume: the checkpoint's, so that extending a run keeps its schedule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="output directory (default runs/gpt-<grid>, runs/gpt-<data name>-<grid> with --data)")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="simulated CPU devices per process (default: 8 / #processes)")  # fmt: skip
    p.add_argument("--sample-tokens", "--sample-bytes", dest="sample_tokens", type=int, default=200,
                   help="length of the generated sample (bytes, or tokens with a tokenizer)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="device dtype of parameters and gradients (fp32 master weights); bf16 also "
                        "computes in bf16, on every backend")
    p.add_argument("--offload", action="store_true",
                   help="master weights and optimizer state in host memory")
    p.add_argument("--update-on", default="host", choices=("host", "device"),
                   help="with --offload: update on the host, or stream the host state through the "
                        "device in buckets")
    p.add_argument("--remat", default="none", choices=("none", "full", "save_dots", "offload"),
                   help="activation checkpointing policy")
    p.add_argument("--machine", default=None,
                   help="the machine profile pipeline stages are cut for: a built-in name "
                        "(perlmutter, frontier, h100-node) or a JSON from axonn-jax profile "
                        "(default: h100-node's rates)")
    p.add_argument("--overlap", default="all",
                   help="communication overlap: all, none, or a comma list of oag, ors, oar; "
                        "add layer-gathers for one weight gather per layer instead of per block, "
                        "bucket=N for N blocks per weight-gradient reduce-scatter (default 4)")
    p.add_argument("--eval-every", type=int, default=50,
                   help="validation loss every N steps and at the last (0: only at the last)")
    p.add_argument("--log-every", type=int, default=0,
                   help="without a terminal: one progress line every N steps (0: about 20 lines)")
    p.add_argument("--plan-table", action="store_true",
                   help="print every parameter's layout (default: the plan's summary)")
    p.add_argument("--all-ranks", action="store_true",
                   help="under MPI, let every rank print (default: rank 0 only)")
    p.add_argument("--check-replicas-every", type=int, default=50,
                   help="every N steps, check that data-parallel replicas hold bitwise equal "
                        "parameters (0: never)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default OUT/ckpt)")
    p.add_argument("--ckpt-every", type=int, default=100, help="save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --ckpt-dir (any grid)")
    p.add_argument("--fresh", action="store_true",
                   help="without --resume: delete the checkpoints already in --ckpt-dir and start over")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    for name in ("ckpt_every", "eval_every", "log_every", "check_replicas_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    try:
        from axonn_jax.partitioner.grid import Grid

        grid = Grid.parse(args.grid)
    except (TypeError, ValueError) as exc:
        p.error(f"--grid {args.grid!r}: {exc}")
    if args.microbatches is None:
        args.microbatches = 4 if grid.pipeline > 1 else 1
    for name in ("microbatches", "batch", "seq", "layers", "hidden", "heads", "schedule_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    need = args.microbatches * grid.data * grid.z
    if args.batch % need:
        p.error(f"--batch {args.batch} is not divisible by microbatches × data × z = "
                f"{args.microbatches} × {grid.data} × {grid.z} = {need} (grid {args.grid}): every "
                f"microbatch is split over data·z. Remedy: --batch {-(-args.batch // need) * need} "
                "or fewer --microbatches.")  # fmt: skip
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.data_dtype and not (args.data and args.data.endswith((".bin", ".npy"))):
        p.error("--data-dtype applies to a .bin (or .npy) token file given with --data")
    return args


def configure_devices(args) -> None:
    """Simulated CPU devices, set before JAX starts (no effect on GPUs)."""
    from axonn_jax.partitioner.grid import Grid
    from axonn_jax.runtime.launch import simulate_cpu_devices

    simulate_cpu_devices(Grid.parse(args.grid), args.devices_per_process)


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_devices(args)

    import jax
    import jax.numpy as jnp
    import optax

    import axonn_jax
    from axonn_jax.checkpoint import Checkpointer
    from axonn_jax.corpus import load_corpus, split
    from axonn_jax.health import check_replicas
    from axonn_jax.loader import Loader
    from axonn_jax.models import GPT, GPTConfig, next_token_accuracy, next_token_loss, window_inputs
    from axonn_jax.runtime.collectives import host_comm
    from axonn_jax.runtime.console import silence_stdout

    # joins the MPI job, if any; knowing the grid first lets a pipeline whose stages each fit in
    # one process keep its collectives in-process (gloo would carry them over TCP)
    grid = axonn_jax.Grid.parse(args.grid)
    info = axonn_jax.init(grid=grid)
    if info.distributed and not args.all_ranks and not info.is_main:  # rank 0 speaks for the job
        silence_stdout()  # (errors still reach stderr; init() already drops Gloo's lines)
    check_run_config(args)
    out = Path(args.out or default_out(args))
    try:
        corpus = load_corpus(args.data, dtype=args.data_dtype, tokenizer=args.tokenizer)
    except (OSError, ValueError, ImportError) as exc:
        raise SystemExit(f"error: {exc}") from None
    compute, notice = compute_dtype(args.precision)
    if notice and info.is_main:
        print(notice)
    config = GPTConfig(vocab_size=corpus.vocab_size, num_layers=args.layers, hidden=args.hidden,
                       num_heads=args.heads, max_seq_len=args.seq, dtype=compute)  # fmt: skip
    model = GPT(config)
    train_tokens, valid_tokens = split(corpus.tokens)
    if len(train_tokens) < args.seq + 2:
        raise SystemExit(f"error: {corpus} is too short for windows of --seq + 1 = {args.seq + 1} "
                         "tokens. Remedy: more data or a shorter --seq.")  # fmt: skip
    # batches hold seq + 1 tokens: the model reads [:, :-1] of a microbatch, the loss predicts [:, 1:]
    example = jnp.zeros((args.batch // args.microbatches, args.seq), jnp.int32)

    pm = axonn_jax.partition(model, grid, example, overlap=args.overlap, machine=args.machine)
    if info.is_main:
        print(f"data: {corpus}")
        print(pm.plan.table() if args.plan_table else pm.plan)
    params = pm.init(jax.random.key(args.seed))
    ckpt_dir = Path(args.ckpt_dir or out / "ckpt")
    ckpt = Checkpointer(ckpt_dir, max_to_keep=2, takeover=args.resume)
    run = run_record(args, corpus)
    previous = read_run_record(ckpt_dir) if ckpt.all_steps() else None
    if ckpt.all_steps() and not args.resume:
        if not args.fresh:
            raise SystemExit(_occupied_message(ckpt_dir, ckpt.all_steps(), previous, run))
        if info.is_main:
            print(f"--fresh: deleting the checkpoints in {ckpt_dir} (steps {ckpt.all_steps()} and "
                  f"{RUN_RECORD}; other files stay)")
        for step in ckpt.all_steps():
            ckpt.delete(step)
        host = host_comm()  # every process deleted before the record goes
        host.barrier()
        if info.is_main:
            (ckpt_dir / RUN_RECORD).unlink(missing_ok=True)
        host.barrier()
        previous = None
    resuming = args.resume and ckpt.latest_step() is not None
    if resuming and previous is not None:
        check_resumable(previous, run, ckpt_dir)
    run["schedule_steps"], notes = learning_rate_schedule(args, previous if resuming else None)
    for note in notes if info.is_main else ():
        print(note)
    optimizer = optax.adamw(optax.cosine_decay_schedule(args.lr, run["schedule_steps"], 0.1),
                            weight_decay=0.01)  # fmt: skip

    options = dict(inputs=window_inputs, microbatches=args.microbatches, remat=args.remat)
    if grid.pipeline > 1:
        options["schedule"] = args.schedule
    def loss_and_accuracy(logits, batch):  # the accuracy comes from the step's own forward pass
        return next_token_loss(logits, batch), {"accuracy": next_token_accuracy(logits, batch)}

    train_step = pm.train_step(loss_and_accuracy, optimizer, precision=args.precision, offload=args.offload,
                               update_on=args.update_on, has_aux=True, **options)  # fmt: skip
    params, opt_state = train_step.init(params)  # params now in --precision on the devices
    logits_of = _partitioned_forward(pm, microbatches=args.microbatches)

    def evaluate(params, batch):  # forward only, on the grid (pipelines included)
        return next_token_loss(logits_of(params, window_inputs(batch)[0]), batch)

    valid = None
    if len(valid_tokens) >= args.seq + 2:
        valid = Loader(valid_tokens, batch=args.batch, seq=args.seq, mesh=None, seed=1).global_batch(0)
    elif info.is_main:
        print(f"no validation: the held-out 5% ({len(valid_tokens)} tokens) is shorter than a window")
    # one step's windows, sharded over (data, z) on pm.mesh; with a pipeline the
    # runtime places each microbatch on its stages, so the loader yields host arrays
    mesh = pm.mesh if grid.pipeline == 1 else None
    loader = Loader(train_tokens, batch=args.batch, seq=args.seq, mesh=mesh, seed=args.seed)

    first_step = 0
    if resuming:
        # any grid, pipeline or not, offloaded or not: the checkpoint holds float32
        # params and the optimizer state over the whole model
        try:
            restored = ckpt.restore_train_state(train_step, params, opt_state)
        except ValueError as exc:  # a checkpoint of another model (written before run.json existed)
            raise SystemExit(f"error: --resume: {ckpt_dir} holds another model than this run's "
                             f"--layers/--hidden/--heads/--seq: {exc}") from None  # fmt: skip
        params, opt_state = restored.params, restored.opt_state
        first_step = int(restored.extra["next_step"])
        loader = _resumed_loader(Loader, train_tokens, restored.extra, loader, first_step, mesh)
        if info.is_main:
            print(f"resumed from {ckpt.directory} at step {first_step}")
    elif args.resume and info.is_main:
        print(f"--resume: no checkpoint in {ckpt.directory}; starting from step 0")
    # batches are a pure function of (seed, step): resuming at step k replays the same data
    out.mkdir(parents=True, exist_ok=True)
    if info.is_main:
        write_run_record(ckpt_dir, run)
    rows = []
    progress = _Progress(first_step, args.steps, enabled=info.is_main, every=args.log_every)
    board = _tensorboard(out / "tensorboard") if info.is_main else None
    tokens_per_step = args.batch * args.seq
    start = time.perf_counter()
    for step in range(first_step, args.steps):
        batch = next(loader)
        if step == first_step:
            progress.compiling()
        t0 = time.perf_counter()
        params, opt_state, (loss, metrics) = train_step(params, opt_state, batch)
        loss = float(loss)
        dt = time.perf_counter() - t0
        number = step + 1  # steps count from 1 everywhere: console, metrics.csv, loss.png, checkpoints
        row = {"step": number, "loss": loss, "accuracy": float(metrics["accuracy"]),
               "tokens_per_s": tokens_per_step / dt, "seconds": dt}  # fmt: skip
        last = number == args.steps
        if valid is not None and (last or number == 1 or (args.eval_every and number % args.eval_every == 0)):
            row["valid_loss"] = float(evaluate(params, valid))
        rows.append(row)
        if board is not None:
            for key in ("loss", "accuracy", "valid_loss", "tokens_per_s"):
                if key in row:
                    board.add_scalar(key, row[key], number)
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            ckpt.save_train_state(step + 1, train_step, params, opt_state,
                                  extra={"next_step": step + 1, "loader": loader.state()})  # fmt: skip
        if args.check_replicas_every and (step + 1) % args.check_replicas_every == 0:
            check_replicas(params, step=step + 1)  # collective: every rank, the same steps
        progress.step(row, seconds=time.perf_counter() - t0)
    progress.close()
    elapsed = time.perf_counter() - start
    if first_step < args.steps:
        ckpt.save_train_state(args.steps, train_step, params, opt_state,
                              extra={"next_step": args.steps, "loader": loader.state()})  # fmt: skip
    ckpt.close()  # waits for the asynchronous writes
    if board is not None:
        board.close()

    if grid.pipeline > 1:  # the last step's tasks on every rank (a collective)
        train_step.value_and_grad.trace(out / "trace.json", out / "timeline.png",
                                        title=f"{args.schedule} schedule, {grid}")
    # sampled through the partitioned model on every rank (a collective; the same key everywhere)
    sample_logits = _partitioned_forward(pm, microbatches=1)  # one row per batch shard
    sample = corpus.decode(_generate(lambda t: sample_logits(params, t), train_tokens[:args.seq],
                                     args.sample_tokens, args.seq, copies=grid.data * grid.z))  # fmt: skip
    if info.is_main:
        ran = rows
        if first_step:  # resumed: keep the rows of the steps before the checkpoint
            rows = [r for r in _read_csv(out / "metrics.csv") if r["step"] <= first_step] + rows
        _write_csv(out / "metrics.csv", rows)
        _plot(out / "loss.png", rows, title=f"GPT {config.num_layers}L/{config.hidden}H on {grid}")
        if not ran:
            print(f"nothing to do: the checkpoint is already at step {first_step} >= --steps")
            return 0
        print(_summary(ran, first_step, args.steps, elapsed, progress.compile_seconds))
        files = ["metrics.csv", "loss.png"] + (["timeline.png", "trace.json"] if grid.pipeline > 1 else [])
        stale = [] if grid.pipeline > 1 else _remove_stale_timeline(out)
        print(f"wrote {out}/: {', '.join(files)}" + (f" (removed an earlier pipeline run's "
              f"{' and '.join(stale)})" if stale else ""))  # fmt: skip
        if board is not None:
            print(f"TensorBoard: {out / 'tensorboard'} ({_tensorboard_hint(out / 'tensorboard')})")
        print(f"checkpoints: {ckpt.directory} (steps {', '.join(map(str, ckpt.all_steps()))}; "
              "continue with --resume)")  # fmt: skip
        print("sample:", repr(sample))
    return 0


#: flags that only change what a rank prints: they may differ between ranks
PER_RANK_FLAGS = ("all_ranks", "log_every", "plan_table")


def check_run_config(args: argparse.Namespace) -> None:
    """Under MPI, every rank must run the same configuration (steps, seed, sizes, ...).

    Ranks with another ``--steps`` (or ``--seed``, ``--batch``, ...) issue different
    collectives and would end in a collective mismatch deep inside Gloo; this check
    (collective, before the first step) raises on every rank naming both values, e.g.
    ``the ranks of this job run different configurations: rank 1 has --steps 4 but rank
    0 has 3``. Does nothing in one process.
    """
    from axonn_jax.runtime.consistency import check_consistent

    config = {f"--{k.replace('_', '-')}": v for k, v in sorted(vars(args).items()) if k not in PER_RANK_FLAGS}
    check_consistent(config, what="run different configurations", remedy=(
        " Remedy: launch every rank with the same arguments (mpiexec -n N python "
        "examples/train_gpt.py ARGS), e.g. no rank-dependent values in a wrapper script."))  # fmt: skip


def default_out(args: argparse.Namespace) -> str:
    """``runs/gpt-<grid>``, or ``runs/gpt-<data name>-<grid>`` with ``--data``.

    Runs on other data get their own directory, so the README's own-data
    command right after ``make demo`` does not meet the demo's checkpoints.

    >>> default_out(parse_args(["--data", "notes.txt", "--grid", "x=2,z=2"]))
    'runs/gpt-notes-x2_z2'
    """
    grid = args.grid.replace(",", "_").replace("=", "")
    name = Path(args.data).stem if args.data else ""
    return f"runs/gpt-{name}-{grid}" if name else f"runs/gpt-{grid}"


#: flags a resumed run must share with its checkpoint (model shape, data, batches)
RESUME_FLAGS = ("layers", "hidden", "heads", "seq", "batch", "seed", "data", "data_dtype", "tokenizer")
#: the run record next to the checkpoints (written by rank 0)
RUN_RECORD = "run.json"


def run_record(args: argparse.Namespace, corpus) -> dict:
    """What a checkpoint directory's runs must agree on, plus the learning-rate schedule."""
    record = {name: getattr(args, name) for name in RESUME_FLAGS}
    if args.data:  # the same file under another path is the same data; its size tells edits apart
        record["data"] = str(Path(args.data).resolve())
    record.update(tokens=int(len(corpus.tokens)), vocab=int(corpus.vocab_size), lr=args.lr)
    return record


def read_run_record(ckpt_dir: Path) -> dict | None:
    """The record the run that wrote ``ckpt_dir`` left there (``None`` before run records existed)."""
    import json

    path = Path(ckpt_dir) / RUN_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def write_run_record(ckpt_dir: Path, record: dict) -> None:
    import json

    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    (Path(ckpt_dir) / RUN_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def _differences(previous: dict, record: dict) -> list[str]:
    """``--flag old → new`` for every resume flag (and the data's size) that differs."""
    keys = [*RESUME_FLAGS, "tokens"]
    return [f"--{k.replace('_', '-')} {previous.get(k)} → {record.get(k)}" if k != "tokens" else
            f"the data's length {previous.get(k)} → {record.get(k)} tokens"
            for k in keys if k in previous and previous.get(k) != record.get(k)]  # fmt: skip


def _occupied_message(ckpt_dir: Path, steps: list[int], previous: dict | None, record: dict) -> str:
    """The error for a new run pointed at a directory that already holds checkpoints."""
    changed = _differences(previous, record) if previous else []
    if changed:  # another run's checkpoints: --resume would be wrong
        return (f"error: {ckpt_dir} already holds the checkpoints (steps {steps}) of another run "
                f"({'; '.join(changed)}). Remedy: another --out (or --ckpt-dir) for this run, or "
                "--fresh to delete them and start over.")  # fmt: skip
    return (f"error: {ckpt_dir} already holds checkpoints (steps {steps}). Remedy: --resume to "
            "continue from the latest, --fresh to delete them and start over, or another --out / "
            "--ckpt-dir.")  # fmt: skip


def check_resumable(previous: dict, record: dict, ckpt_dir: Path) -> None:
    """Refuse ``--resume`` onto checkpoints of another model, data or batch order, naming the flags."""
    changed = _differences(previous, record)
    if changed:
        raise SystemExit(
            f"error: --resume: the checkpoints in {ckpt_dir} were trained with other settings: "
            f"{'; '.join(changed)}. Remedy: the checkpoint's values to continue it, or another "
            "--out (or --fresh) to train this configuration from scratch."
        )


def learning_rate_schedule(args: argparse.Namespace, previous: dict | None) -> tuple[int, list[str]]:
    """The cosine schedule's length, and notices for what a resume changes.

    A fresh run decays over ``--schedule-steps`` (default ``--steps``). A resumed
    run keeps its checkpoint's schedule unless ``--schedule-steps`` says
    otherwise, so that ``--resume --steps 600`` extends a 300-step run at the
    learning rate it ended with instead of jumping back up the cosine.
    """
    notes = []
    if previous is None or "schedule_steps" not in previous:
        return args.schedule_steps or args.steps, notes
    kept = previous["schedule_steps"]
    steps = args.schedule_steps or kept
    if steps != kept:
        notes.append(f"note: --schedule-steps {steps}: the learning rate now decays over {steps} steps "
                     f"(the checkpoint's schedule: {kept}); it changes at the resumed step")  # fmt: skip
    elif args.steps != kept:
        notes.append(f"note: the learning rate keeps the checkpoint's schedule, a cosine over {kept} "
                     f"steps (--steps {args.steps}; --schedule-steps N sets another)")  # fmt: skip
    if previous.get("lr") not in (None, args.lr):
        notes.append(f"note: --lr {args.lr} (the checkpoint was trained with --lr {previous['lr']})")
    return steps, notes


def compute_dtype(precision: str) -> tuple[str, str | None]:
    """The model's computation dtype for ``--precision``, and a notice if it differs.

    bf16 stores parameters and gradients in bf16 and computes in bf16, on every
    backend (CPU included). fp16 is storage only: fp16 activations overflow where
    the loss scale cannot help.
    """
    if precision == "bf16":
        return "bfloat16", None
    if precision == "fp16":
        return "float32", ("note: --precision fp16 stores parameters and gradients in fp16; the "
                           "model computes in fp32")
    return "float32", None


def _summary(ran: list[dict], first_step: int, steps: int, elapsed: float, compile_s: float) -> str:
    """The loss over the steps this run executed (after --resume, only those), labelled.

    The end is the mean of the last (up to) 10 steps: one step's loss is one batch's.
    """
    tail = ran[-10:]
    last = sum(r["loss"] for r in tail) / len(tail)
    span = f"steps {tail[0]['step']}-{tail[-1]['step']}" if len(tail) > 1 else f"step {tail[0]['step']}"
    resumed = f", resumed from the checkpoint of step {first_step}" if first_step else ""
    return (f"\nloss {ran[0]['loss']:.3f} (step {ran[0]['step']}) -> {last:.3f} (mean of {span}) in "
            f"{len(ran)} steps ({first_step + 1}-{steps} of {steps}{resumed}), {elapsed:.0f} s of "
            f"which {compile_s:.0f} s compiling")


class _Progress:
    """Progress of the run: a tqdm bar on a terminal, else a plain line every ``every`` steps.

    The first step compiles: it is announced and timed, and rates and the ETA
    count only the steps after it.
    """

    def __init__(self, first: int, total: int, *, enabled: bool, every: int = 0) -> None:
        self.first, self.total, self.enabled = first, total, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.every = every or max(1, (total - first) // 20)
        self.bar, self.compile_seconds, self.started = None, 0.0, None

    def compiling(self) -> None:
        if self.enabled:  # (a log gets whole lines)
            print(f"step {self.first + 1}/{self.total}: compiling the train step…",
                  end=" " if self.tty else "\n", flush=True)  # fmt: skip

    def step(self, row: dict, *, seconds: float) -> None:
        if self.started is None:  # the first step: compilation (and the first validation)
            self.compile_seconds, self.started = seconds, time.perf_counter()
            if self.enabled:
                print(f"{'done' if self.tty else 'compiled and ran it'} in {seconds:.1f} s "
                      f"(loss {row['loss']:.3f})", flush=True)  # fmt: skip
            if self.tty and row["step"] < self.total:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, initial=row["step"], desc="train",
                                unit="step", file=sys.stdout)  # fmt: skip
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        elif self.enabled and ((row["step"] - 1 - self.first) % self.every == 0 or row["step"] == self.total):
            print(self._line(row), flush=True)

    def _line(self, row: dict) -> str:
        done = row["step"] - 1 - self.first  # steps since the compiling one
        per_step = (time.perf_counter() - self.started) / max(done, 1)
        valid = f"  valid {row['valid_loss']:.3f}" if "valid_loss" in row else ""
        return (f"step {row['step']}/{self.total}  loss {row['loss']:.3f}  acc {row['accuracy']:.3f}{valid}  "
                f"tok/s {row['tokens_per_s']:,.0f}  {per_step:.2f} s/step  "
                f"eta {_clock(per_step * (self.total - row['step']))}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def _tensorboard(directory: Path):
    """A TensorBoard event writer (tensorboardX), or None if it is not installed."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(directory))


def _tensorboard_hint(directory: Path) -> str:
    """How to view the events: the command, and how to get it when it is not installed."""
    import importlib.util

    command = f"tensorboard --logdir {directory}"
    if importlib.util.find_spec("tensorboard") is None:  # tensorboardX writes events, it does not show them
        return f"to view: pip install tensorboard, then {command}"
    return command


def _remove_stale_timeline(out: Path) -> list[str]:
    """Delete the timeline of an earlier pipelined run in ``out`` (this run's grid has no pipeline)."""
    removed = []
    for name in ("timeline.png", "trace.json"):
        if (out / name).exists():
            (out / name).unlink()
            removed.append(name)
    return removed


def _write_csv(path: Path, rows: list[dict]) -> None:
    import csv

    columns = ["step", "loss", "accuracy", "valid_loss", "tokens_per_s", "seconds"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in columns})


def _read_csv(path: Path) -> list[dict]:
    import csv

    if not path.exists():
        return []
    with path.open() as f:
        return [{k: (int(v) if k == "step" else float(v)) for k, v in row.items() if v != ""}
                for row in csv.DictReader(f)]  # fmt: skip


def _plot(path: Path, rows: list[dict], *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    valid = [(r["step"], r["valid_loss"]) for r in rows if "valid_loss" in r]
    if valid:  # points: evaluations are sparse, a line between them would suggest data
        ax.plot(*zip(*valid), "o", ms=4, label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _partitioned_forward(pm, *, microbatches: int):
    """``logits_of(device params, tokens)`` → host logits, from the partitioned model on its grid.

    With a pipeline: :meth:`~axonn_jax.Partitioned.forward` (forward-only tasks
    through the dispatch queue). Without: a jitted ``pm.apply`` on the batch
    placed over (data, z), gathered to every process.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from axonn_jax.runtime.precision import as_planned
    from axonn_jax.runtime.sharded import batch_sharding, place

    if pm.grid.pipeline > 1:  # (half-precision parameters are cast per stage)
        return lambda params, tokens: pm.forward(params, tokens, microbatches=microbatches)
    apply = jax.jit(lambda p, t: pm.apply(as_planned(p, pm.plan), t))

    def logits_of(params, tokens):
        tokens = place(np.asarray(tokens), batch_sharding(pm.mesh, pm.grid, np.shape(tokens)))
        logits = apply(params, tokens)
        if jax.process_count() > 1:
            return np.asarray(multihost_utils.process_allgather(logits, tiled=True))
        return np.asarray(logits)

    return logits_of


def _resumed_loader(loader_type, tokens, extra: dict, loader, step: int, mesh):
    """The loader at the checkpoint's position (checkpoints without one: at ``step``)."""
    if "loader" not in extra:
        loader.step = step
        return loader
    try:
        resumed = loader_type.from_state(tokens, extra["loader"], mesh=mesh)
    except ValueError as exc:
        raise SystemExit(f"error: --resume: {exc}") from None
    if (resumed.batch, resumed.seq, resumed.seed) != (loader.batch, loader.seq, loader.seed):
        raise SystemExit(
            f"error: --resume: the checkpoint was trained with --batch {resumed.batch} --seq "
            f"{resumed.seq} --seed {resumed.seed}; pass the same values to continue its data."
        )
    return resumed


def _generate(logits_of, prompt, n: int, window: int, *, copies: int) -> list[int]:
    """Sample ``n`` tokens; ``logits_of(tokens)`` runs the partitioned model.

    The context is repeated ``copies`` times so that the batch splits over the
    grid's batch axes (and microbatches); row 0 is used.
    """
    import jax
    import numpy as np

    tokens = list(np.asarray(prompt, dtype=np.int32))
    key = jax.random.key(0)
    for _ in range(n):
        context = np.repeat(np.asarray(tokens[-window:], dtype=np.int32)[None], copies, axis=0)
        logits = logits_of(context)[0, -1]
        key, sub = jax.random.split(key)
        tokens.append(int(jax.random.categorical(sub, logits / 0.8)))
    return tokens[len(prompt) :]


if __name__ == "__main__":
    sys.exit(main())

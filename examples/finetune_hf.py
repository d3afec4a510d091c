"""Fine-tune a HuggingFace Flax causal language model on a grid: its weights in, trained, weights out.

    python examples/finetune_hf.py                                  # a small random GPT-2, offline
    python examples/finetune_hf.py --model my-llama/ --tokenizer my-llama/ --data notes.txt
    python examples/finetune_hf.py --grid x=2,y=2,z=2 --precision bf16
    mpiexec -n 2 python examples/finetune_hf.py --grid pipeline=2,x=2,z=2

``--model`` is a directory written by ``save_pretrained`` (``config.json`` and
``flax_model.msgpack``) of a Flax causal LM of ``transformers`` 4.x called as
``module(input_ids, attention_mask, position_ids)``: GPT-2, GPT-Neo, GPT-J, OPT,
Llama, Mistral, Gemma, ... Nothing is downloaded: without ``--model`` the example
first writes a small randomly initialised GPT-2 with a byte vocabulary there
(``--out``/base).

The steps, each one call of ``axonn_jax``:

1. ``hf.module(dir)``: the linen module the directory's config describes;
2. ``axonn_jax.partition(module, grid, ids, mask, positions)``: its 4D layout
   (and pipeline stages);
3. ``hf.load(pm, dir)``: the saved weights placed in that layout, each process
   reading the shards of its own devices;
4. ``pm.train_step``: next-token cross-entropy (and, from the same forward pass,
   the accuracy) with AdamW, ``--steps`` times over windows of ``--data``;
5. ``hf.save_pretrained(pm, out, params, opt_state)``: the tuned weights, which
   ``FlaxAutoModelForCausalLM.from_pretrained(out)`` reads. The example reads them
   back so and checks that their logits on a held-out batch are the partitioned
   model's (``reloaded: max |logits - partitioned| = ...``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a save_pretrained directory (default: a small random GPT-2 written to OUT/base)")
    p.add_argument("--grid", default="x=2,z=2,data=2", help="e.g. x=2,y=2,z=2 or pipeline=2,x=2,z=2")
    p.add_argument("--data", default=None,
                   help="a text file, or token ids in .npy / raw .bin (default: Python's docstrings)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="encode a text --data with this local tokenizer (default: bytes)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default: 2 with a pipeline, else 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/finetune-hf", help="the tuned model goes to OUT/tuned")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from axonn_jax.partitioner.grid import Grid

    try:
        grid = Grid.parse(args.grid)
    except (TypeError, ValueError) as exc:
        p.error(f"--grid {args.grid!r}: {exc}")
    args.microbatches = args.microbatches or (2 if grid.pipeline > 1 else 1)
    need = args.microbatches * grid.data * grid.z
    if args.batch % need:
        p.error(f"--batch {args.batch} is not divisible by microbatches × data × z = {need} "
                f"(grid {args.grid}). Remedy: --batch {-(-args.batch // need) * need}.")  # fmt: skip
    return args


def write_small_gpt2(directory: Path, vocab: int, seq: int) -> None:
    """A randomly initialised 2-block GPT-2 saved with ``save_pretrained`` (process 0 writes)."""
    import transformers

    config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=128, n_layer=2, n_head=4)
    transformers.FlaxGPT2LMHeadModel(config, seed=0).save_pretrained(directory)


def model_inputs(window):
    """``(input_ids, attention_mask, position_ids)`` of a loader window ``[batch, seq + 1]``."""
    import jax.numpy as jnp

    ids = window[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return ids, jnp.ones_like(ids), positions


def main(argv=None) -> int:
    args = parse_args(argv)
    from axonn_jax.partitioner.grid import Grid
    from axonn_jax.runtime.launch import simulate_cpu_devices

    simulate_cpu_devices(Grid.parse(args.grid))  # before JAX starts; no effect on GPUs

    import numpy as np
    import optax
    import transformers

    import axonn_jax
    from axonn_jax import hf
    from axonn_jax.corpus import load_corpus, split
    from axonn_jax.loader import Loader
    from axonn_jax.models import next_token_accuracy, next_token_loss
    from axonn_jax.runtime.collectives import host_comm
    from axonn_jax.runtime.console import silence_stdout

    # transformers 4.x warns once that its Flax classes go in v5 (axonn_jax[hf] pins < 5)
    transformers.logging.get_logger("transformers.modeling_flax_utils").setLevel("ERROR")
    grid = axonn_jax.Grid.parse(args.grid)
    info = axonn_jax.init(grid=grid)  # joins the MPI job, if any
    if info.distributed and not info.is_main:
        silence_stdout()  # rank 0 speaks for the job
    out = Path(args.out)
    try:
        corpus = load_corpus(args.data, tokenizer=args.tokenizer)
    except (OSError, ValueError, ImportError) as exc:
        raise SystemExit(f"error: {exc}") from None
    source = Path(args.model) if args.model else out / "base"
    if args.model is None:
        if info.is_main:
            write_small_gpt2(source, corpus.vocab_size, args.seq)
        host_comm().barrier()
    model = hf.module(source)
    config = model.config
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if corpus.vocab_size > config.vocab_size or (positions and args.seq > positions):
        raise SystemExit(f"error: {source} has a vocabulary of {config.vocab_size} and {positions} positions; "
                         f"the data needs {corpus.vocab_size} token ids and --seq {args.seq}. Remedy: the "
                         "model's own --tokenizer, or a shorter --seq.")  # fmt: skip
    train_tokens, valid_tokens = split(corpus.tokens)

    example = model_inputs(np.zeros((args.batch // args.microbatches, args.seq + 1), np.int32))
    pm = axonn_jax.partition(model, grid, *example)
    params = hf.load(pm, source)
    if info.is_main:
        print(f"data: {corpus}\nmodel: {type(model).__name__} from {source}")
        print(pm.plan)

    def loss_and_accuracy(outputs, window):  # the accuracy comes from the step's own forward pass
        logits = outputs.logits
        return next_token_loss(logits, window), {"accuracy": next_token_accuracy(logits, window)}

    step = pm.train_step(loss_and_accuracy, optax.adamw(args.lr, weight_decay=0.01), inputs=model_inputs,
                         microbatches=args.microbatches, precision=args.precision, has_aux=True)  # fmt: skip
    params, opt_state = step.init(params)
    loader = Loader(train_tokens, batch=args.batch, seq=args.seq, mesh=pm.mesh if grid.pipeline == 1 else None,
                    seed=args.seed)  # fmt: skip
    started = time.perf_counter()
    for n in range(1, args.steps + 1):
        params, opt_state, (loss, aux) = step(params, opt_state, next(loader))
        if n == 1 or n % args.log_every == 0 or n == args.steps:
            print(f"step {n}/{args.steps}  loss {float(loss):.3f}  acc {float(aux['accuracy']):.3f}  "
                  f"{time.perf_counter() - started:.1f} s", flush=True)

    tuned = out / "tuned"
    hf.save_pretrained(pm, tuned, params, opt_state)
    print(f"wrote {tuned} (FlaxAutoModelForCausalLM.from_pretrained reads it)")
    held_out = valid_tokens if len(valid_tokens) > args.seq + 1 else train_tokens
    window = Loader(held_out, batch=args.batch, seq=args.seq, mesh=None, seed=1).global_batch(0)
    inputs = [np.asarray(x) for x in model_inputs(window)]
    trained = pm.gather(params)  # every process takes part; host arrays, in the step's precision
    if info.is_main:
        want = np.asarray(model.apply({"params": trained}, *inputs).logits, np.float32)
        reloaded = transformers.FlaxAutoModelForCausalLM.from_pretrained(tuned)
        got = np.asarray(reloaded(*inputs).logits, np.float32)
        print(f"reloaded: max |logits - trained| = {np.abs(got - want).max():.2e} "
              f"({args.precision} weights in the step, float32 in the file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train a small ResNet written in Flax nnx (BatchNorm, Dropout) on a grid, and evaluate it.

    python examples/train_resnet_nnx.py                          # z=2,data=4 on 8 CPU devices
    python examples/train_resnet_nnx.py --grid y=2,data=4        # channels split over y
    mpiexec -n 2 python examples/train_resnet_nnx.py --grid pipeline=2,data=4

The model is plain nnx, written as its community writes it: ``nnx.Conv``,
``nnx.BatchNorm`` (batch statistics in training, running averages in
evaluation), ``nnx.Dropout`` with its own RNG stream, residual blocks. The task
is synthetic so that it runs anywhere with nothing downloaded: 32×32 RGB images
of a noisy sinusoidal grating, the class its orientation (``--classes`` bins of
180°); each step's batch is a pure function of ``(--seed, step)``.

What the example shows:

* ``axonn_jax.partition(model, grid, images)`` of an ``nnx.Module``: its
  parameters are ``variables["params"]``, everything else (batch statistics, the
  dropout stream's key and counter) ``variables["state"]``;
* ``pm.train_step`` updates both: AdamW on ``params``, the new statistics and
  RNG counter written back;
* evaluation: ``model.eval()`` then ``partition`` again gives the evaluation
  program (running averages, no dropout) over the same ``variables``; on a
  pipeline, ``stages=pm.plan.stage_cuts`` cuts its stages where the training
  program's are, so that each process holds what its stages read.
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="z=2,data=4", help="e.g. z=2,data=4, y=2,data=4 or pipeline=2,data=4")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=64, help="global batch (images)")
    p.add_argument("--classes", type=int, default=6, help="orientation bins")
    p.add_argument("--widths", default="16,32,64", help="channels of the residual stages")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("steps", "batch", "classes", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        args.widths = tuple(int(w) for w in args.widths.split(","))
    except ValueError:
        p.error(f"--widths {args.widths!r}: expected comma-separated channel counts, e.g. 16,32,64")
    from axonn_jax.partitioner.grid import Grid

    try:
        grid = Grid.parse(args.grid)
    except (TypeError, ValueError) as exc:
        p.error(f"--grid {args.grid!r}: {exc}")
    if args.batch % (grid.data * grid.z):
        p.error(f"--batch {args.batch} is not divisible by data × z = {grid.data * grid.z} (grid {args.grid})")
    return args


def gratings(seed: int, step: int, batch: int, classes: int):
    """``(images [batch, 32, 32, 3] float32, labels [batch] int32)`` of step ``step``: a grating
    at a random angle in its class's bin, random frequency, phase and tint, plus noise."""
    import numpy as np

    rng = np.random.default_rng([seed, step])
    labels = rng.integers(0, classes, batch)
    angles = (labels + rng.uniform(0.1, 0.9, batch)) * np.pi / classes
    frequency = rng.uniform(0.3, 0.8, batch)
    phase = rng.uniform(0, 2 * np.pi, batch)
    yy, xx = np.mgrid[0:32, 0:32].astype(np.float32)
    along = np.cos(angles)[:, None, None] * xx + np.sin(angles)[:, None, None] * yy
    wave = np.sin(frequency[:, None, None] * along + phase[:, None, None])
    tint = rng.uniform(0.2, 1.0, (batch, 1, 1, 3))
    images = wave[..., None] * tint + rng.normal(0, 0.5, (batch, 32, 32, 3))
    return images.astype(np.float32), labels.astype(np.int32)


def make_resnet(classes: int, widths: tuple[int, ...], dropout: float, seed: int):
    """A CIFAR-style ResNet in nnx: a stem, one residual block per width (stride 2 after the first)."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, cin: int, cout: int, stride: int, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(cin, cout, (3, 3), strides=stride, use_bias=False, rngs=rngs)
            self.norm1 = nnx.BatchNorm(cout, rngs=rngs)
            self.conv2 = nnx.Conv(cout, cout, (3, 3), use_bias=False, rngs=rngs)
            self.norm2 = nnx.BatchNorm(cout, rngs=rngs)
            self.shortcut = (nnx.Conv(cin, cout, (1, 1), strides=stride, use_bias=False, rngs=rngs)
                             if stride != 1 or cin != cout else None)  # fmt: skip

        def __call__(self, x):
            h = nnx.relu(self.norm1(self.conv1(x)))
            h = self.norm2(self.conv2(h))
            return nnx.relu(h + (x if self.shortcut is None else self.shortcut(x)))

    class ResNet(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.stem = nnx.Conv(3, widths[0], (3, 3), use_bias=False, rngs=rngs)
            self.norm = nnx.BatchNorm(widths[0], rngs=rngs)
            ins = (widths[0], *widths[:-1])
            self.blocks = nnx.List([Block(cin, cout, 1 if i == 0 else 2, rngs)
                                    for i, (cin, cout) in enumerate(zip(ins, widths))])  # fmt: skip
            self.drop = nnx.Dropout(dropout, rngs=rngs)
            self.head = nnx.Linear(widths[-1], classes, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.norm(self.stem(x)))
            for block in self.blocks:
                x = block(x)
            return self.head(self.drop(x.mean(axis=(1, 2))))

    return ResNet(nnx.Rngs(seed, dropout=seed + 1))


def main(argv=None) -> int:
    args = parse_args(argv)
    from axonn_jax.partitioner.grid import Grid
    from axonn_jax.runtime.launch import simulate_cpu_devices

    simulate_cpu_devices(Grid.parse(args.grid))  # before JAX starts; no effect on GPUs

    import jax
    import numpy as np
    import optax

    import axonn_jax
    from axonn_jax.runtime.console import silence_stdout

    grid = axonn_jax.Grid.parse(args.grid)
    info = axonn_jax.init(grid=grid)  # joins the MPI job, if any
    if info.distributed and not info.is_main:
        silence_stdout()  # rank 0 speaks for the job
    model = make_resnet(args.classes, args.widths, args.dropout, args.seed)
    images, _ = gratings(args.seed, 0, args.batch, args.classes)
    pm = axonn_jax.partition(model, grid, images)
    model.eval()  # running averages, no dropout: the evaluation program over the same variables,
    # its pipeline stages cut where the training program's are (they hold the same parameters)
    evaluate = axonn_jax.partition(model, grid, images, stages=pm.plan.stage_cuts)
    print(pm.plan)

    def loss_and_accuracy(logits, batch):
        labels = batch["labels"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(20, args.steps // 5), args.steps)
    step = pm.train_step(loss_and_accuracy, optax.adamw(schedule, weight_decay=1e-4),
                         inputs=lambda batch: (batch["images"],), has_aux=True)  # fmt: skip
    variables, opt_state = step.init(pm.init(jax.random.key(args.seed)))
    held_out = [gratings(args.seed + 1, k, args.batch, args.classes) for k in range(4)]

    def eval_accuracy(variables) -> float:
        right = 0
        for x, labels in held_out:
            logits, _ = evaluate.apply(variables, x)  # (outputs, state): the state is not updated
            right += int((np.asarray(jax.device_get(logits)).argmax(-1) == labels).sum())
        return right / (len(held_out) * args.batch)

    started = time.perf_counter()
    print(f"step 0/{args.steps}  held-out accuracy {eval_accuracy(variables):.3f} "
          f"(chance {1 / args.classes:.3f})")  # fmt: skip
    for n in range(1, args.steps + 1):
        x, labels = gratings(args.seed, n, args.batch, args.classes)
        variables, opt_state, (loss, aux) = step(variables, opt_state, {"images": x, "labels": labels})
        if n % args.eval_every == 0 or n == args.steps:
            print(f"step {n}/{args.steps}  loss {float(loss):.3f}  train accuracy {float(aux['accuracy']):.3f}  "
                  f"held-out accuracy {eval_accuracy(variables):.3f}  {time.perf_counter() - started:.0f} s",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

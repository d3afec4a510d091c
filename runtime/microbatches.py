"""Microbatches: a batch (or a call's inputs) split along dim 0, and the checks that it can be.

Both engines split the same way: microbatch ``mb`` of ``m`` is rows
``[mb·n/m, (mb+1)·n/m)`` of every batch leaf, and the batch size must divide
into ``m × data × z`` so that each microbatch still splits over the batch axes.

Example:
    >>> part = batch_slices((np.arange(8), np.arange(8) * 10), 2, Grid())
    >>> part(1)
    (array([4, 5, 6, 7]), array([40, 50, 60, 70]))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from axonn_jax.partitioner.grid import Grid
from axonn_jax.runtime.model_call import microbatch_rngs


def default_inputs(batch) -> tuple:
    """The model's positional arguments from a batch: the batch itself, or its items."""
    if isinstance(batch, Mapping):
        raise TypeError(
            f"the batch is a dict (keys {sorted(batch)}), so which entries the model takes "
            "cannot be guessed. Remedy: pass inputs=, e.g. pm.value_and_grad(loss_fn, "
            "inputs=lambda batch: (batch['input_ids'],)) (the same for pm.train_step)."
        )
    return tuple(batch) if isinstance(batch, tuple) else (batch,)


def check_microbatches(microbatches) -> int:
    """``microbatches`` as a positive int, or ``ValueError`` naming what was given."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, (int, np.integer)) \
            or microbatches < 1:  # fmt: skip
        raise ValueError(
            f"microbatches must be a positive integer, got {microbatches!r}. Remedy: "
            "microbatches=1 (no splitting) or the number of slices of the batch, e.g. 4."
        )
    return int(microbatches)


def check_batch(leaves, microbatches: int, grid: Grid) -> int:
    """The batch size, after checking it splits into ``microbatches`` × data × z."""
    if not leaves:
        raise ValueError("the batch is empty: pass the model inputs (and targets) as arrays")
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            f"every batch leaf needs the same leading batch dimension; got sizes {sorted(sizes)}"
        )
    size = sizes.pop()
    need = microbatches * grid.data * grid.z
    if microbatches < 1 or size % need:
        raise ValueError(
            f"batch size {size} is not divisible by microbatches × data × z = {microbatches} × "
            f"{grid.data} × {grid.z} = {need} (grid {grid}). Remedy: use a batch size that is a "
            "multiple of it, or fewer microbatches."
        )
    return size


def batch_slices(batch, microbatches: int, grid: Grid) -> Callable[[int], Any]:
    """``part(mb)``: microbatch ``mb`` of ``batch`` (every leaf split along dim 0; arrays or tracers)."""
    leaves, tree = jax.tree.flatten(batch)
    size = check_batch(leaves, microbatches, grid) // microbatches

    def part(mb: int):
        return jax.tree.unflatten(tree, [x[mb * size : (mb + 1) * size] for x in leaves])

    return part


def call_slices(args: tuple, kwargs: dict, microbatches: int, grid: Grid) -> Callable[[int], tuple]:
    """``part(mb)``: ``(args, kwargs)`` of microbatch ``mb`` of a model call.

    Array leaves with a dim are split along dim 0, scalars and flags stay
    whole; RNG keys (``rngs=``) give one stream per microbatch, as in training.
    """
    rngs = kwargs.get("rngs")
    rest = {k: v for k, v in kwargs.items() if k != "rngs"}
    leaves, tree = jax.tree.flatten((args, rest))
    arrays = [i for i, x in enumerate(leaves) if hasattr(x, "shape") and np.ndim(x) > 0]
    size = check_batch([leaves[i] for i in arrays], microbatches, grid) // microbatches

    def part(mb: int) -> tuple[tuple, dict]:
        sliced = list(leaves)
        for i in arrays:
            sliced[i] = leaves[i][mb * size : (mb + 1) * size]
        mb_args, mb_kwargs = jax.tree.unflatten(tree, sliced)
        if rngs:
            mb_kwargs["rngs"] = microbatch_rngs(rngs, mb, microbatches)
        return mb_args, mb_kwargs

    return part

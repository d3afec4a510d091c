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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from axonn_jax.partitioner.grid import Grid
from axonn_jax.runtime.model_call import microbatch_rngs


def default_inputs(batch, keywords: Sequence[str] = ()) -> tuple | dict:
    """The model's inputs from a batch: the batch itself, or its items.

    A dict batch gives the keyword inputs named in ``keywords`` (the array
    keywords of the call given to ``partition()``, e.g. ``inputs=``), when it
    has them all; other entries (targets) are for the loss only.

    Example:
        >>> default_inputs({"inputs": x, "targets": y}, keywords=("inputs",))  # doctest: +SKIP
        {'inputs': x}
    """
    if isinstance(batch, Mapping):
        if keywords and set(keywords) <= set(batch):
            return {k: batch[k] for k in keywords}
        named = f" (partition() was given keyword inputs {list(keywords)})" if keywords else ""
        raise TypeError(
            f"the batch is a dict (keys {sorted(batch)}), so which entries the model takes "
            f"cannot be guessed{named}. Remedy: pass inputs=, e.g. pm.value_and_grad(loss_fn, "
            "inputs=lambda batch: (batch['input_ids'],)) for positional inputs or "
            "inputs=lambda batch: {'inputs': batch['inputs']} for keyword inputs (the same for "
            "pm.train_step)."
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


def check_batch(leaves, microbatches: int, grid: Grid, paths: list[str] | None = None) -> int:
    """The batch size, after checking it splits into ``microbatches`` × data × z.

    ``paths`` name the leaves in the errors (``batch_paths``). Leaves with
    different leading dims (a graph batch: nodes, edges, graphs) cannot be
    split into microbatches; with one microbatch nothing is split, and callers
    do not check.
    """
    if not leaves:
        raise ValueError("the batch is empty: pass the model inputs (and targets) as arrays")
    paths = paths or [f"leaf {i}" for i in range(len(leaves))]
    dims = {p: int(np.shape(x)[0]) if np.ndim(x) else None for p, x in zip(paths, leaves)}
    sizes = set(dims.values())
    if len(sizes) != 1 or None in sizes:
        named = ", ".join(f"{p}: {'scalar' if d is None else d}" for p, d in dims.items())
        raise ValueError(
            f"microbatches={microbatches} splits every batch leaf along dim 0, but the leaves' "
            f"leading dims differ ({named}) on {grid}, so there is no one dim to split (a graph "
            "batch: nodes, edges, graphs). Remedy: microbatches=1 (the batch runs whole, nothing "
            "is split), or a batch whose leaves all lead with the batch dim (e.g. graphs padded to "
            "fixed node and edge counts, stacked along a new dim 0)."
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


def same_leading_dim(leaves) -> bool:
    """True when the leaves are arrays with one dim 0 (a batch that splits); False for a
    ragged batch (graphs) or an empty one."""
    dims = {int(np.shape(x)[0]) if np.ndim(x) else None for x in leaves}
    return len(dims) == 1 and None not in dims


def batch_paths(tree) -> list[str]:
    """The leaves of a batch (or call) named as the user wrote them: ``['inputs']``, ``[0]``.

    Example:
        >>> batch_paths({"nodes": 1, "edges": (2, 3)})
        ["['edges'][0]", "['edges'][1]", "['nodes']"]
    """
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def batch_slices(batch, microbatches: int, grid: Grid) -> Callable[[int], Any]:
    """``part(mb)``: microbatch ``mb`` of ``batch`` (every leaf split along dim 0; arrays or tracers).

    One microbatch of a ragged batch (leaves with different leading dims) is the batch itself.
    """
    leaves, tree = jax.tree.flatten(batch)
    if microbatches == 1 and leaves and not same_leading_dim(leaves):
        return lambda mb: batch
    size = check_batch(leaves, microbatches, grid, batch_paths(batch)) // microbatches

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
    if microbatches == 1 and arrays and not same_leading_dim([leaves[i] for i in arrays]):
        return lambda mb: (args, dict(kwargs))  # ragged: the call whole
    paths = batch_paths((args, rest))
    size = check_batch([leaves[i] for i in arrays], microbatches, grid, [paths[i] for i in arrays]) // microbatches

    def part(mb: int) -> tuple[tuple, dict]:
        sliced = list(leaves)
        for i in arrays:
            sliced[i] = leaves[i][mb * size : (mb + 1) * size]
        mb_args, mb_kwargs = jax.tree.unflatten(tree, sliced)
        if rngs:
            mb_kwargs["rngs"] = microbatch_rngs(rngs, mb, microbatches)
        return mb_args, mb_kwargs

    return part

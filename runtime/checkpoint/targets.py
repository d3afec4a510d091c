"""Restore targets checked against what a checkpoint holds, and the checks on what is saved.

A target names, per saved path (``params/dense/kernel``), where the value goes:
a ``Sharding`` (only the layout is checked), or a ``jax.Array`` /
``ShapeDtypeStruct`` / NumPy array (shape and dtype are checked too); ``None``
marks a leaf another process holds (:data:`ELSEWHERE`). :func:`targets`
checks one tree against the saved leaves, naming the path on any mismatch;
:func:`check_complete` checks that the processes' targets together cover the
checkpoint (collective).

Example:
    >>> wanted, tree = targets("params", pm.param_structs, saved, "checkpoint runs/ckpt step 3")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.runtime.checkpoint.handler import EmptyNode, LeafKey, allgather_json
from axonn_jax.runtime.checkpoint.shard_store import LeafMeta
from axonn_jax.runtime.master_optimizer import optimizer_state_shardings

ELSEWHERE = object()  # a leaf held by another process: not read here


def _is_leaf(x) -> bool:
    return x is None or isinstance(x, (jax.sharding.Sharding, jax.ShapeDtypeStruct))


def keyed(item: str, tree) -> list[tuple[LeafKey, Any]]:
    """``[(LeafKey, leaf)]`` of ``tree``; ``None`` stays a leaf (held by another process),
    and subtrees without leaves (``{}``, ``optax.EmptyState()``) become :class:`EmptyNode`."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: _is_leaf(x) or _is_empty(x))[0]
    return [(LeafKey.of(keys), _EMPTY_TYPES.get(type(leaf), EmptyNode("None")) if _is_empty(leaf) else leaf)
            for keys, leaf in flat if keys]  # fmt: skip


_EMPTY_TYPES = {dict: EmptyNode("Dict"), list: EmptyNode("List")}


def _is_empty(x) -> bool:
    """A pytree node with no leaves (not ``None``, which marks a leaf held elsewhere)."""
    return (x is not None and not _is_leaf(x) and not jax.tree_util.all_leaves([x])
            and not jax.tree.leaves(x, is_leaf=_is_leaf))  # fmt: skip


def _flatten(item: str, tree) -> tuple[list[tuple[str, Any]], Any]:
    """``[(path, leaf)]`` with paths like ``params/dense/kernel``; ``None`` stays a leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    pairs = []
    for keys, leaf in flat:
        suffix = LeafKey.of(keys).path
        pairs.append((f"{item}/{suffix}" if suffix else item, leaf))
    return pairs, treedef


def check_not_donated(items: Mapping[str, list]) -> None:
    """Refuse arrays whose buffers a jitted step donated (deleted), naming the first."""
    for item, leaves in items.items():
        for key, leaf in leaves:
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise ValueError(
                    f"checkpoint leaf '{item}/{key.path}' was donated to a jitted step (its buffer "
                    "is deleted). Remedy: save what the step returned "
                    "(params, opt_state, loss = step(params, opt_state, batch); ckpt.save(...))."
                )


def check_step(step, what: str) -> None:
    """A step is a non-negative ``int`` (not a string, bool or float)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        hint = f" Remedy: {what}(step={int(step)})." if isinstance(step, str) and step.isdigit() else ""
        raise TypeError(f"{what}: step must be a non-negative int, got {step!r} "
                        f"({type(step).__name__}).{hint}")  # fmt: skip
    if step < 0:
        raise ValueError(f"{what}: step must be a non-negative int, got {step}")


def _stored(item: str, saved: Mapping) -> set[str]:
    return {p for p in saved if p == item or p.startswith(item + "/")}


def _mismatch(item: str, where: str, extra, missing) -> ValueError:
    remedy = (f"restore with the model{' and optimizer' if item == 'opt_state' else ''} the "
              "checkpoint was saved with.")  # fmt: skip
    if item == "opt_state" and any(p.startswith(_TRAIN_STEP_STATE) for p in (*extra, *missing)):
        remedy = (
            "the opt_state of pm.train_step(...) has the form of its grid (one state per "
            "pipeline stage, offload, precision), so a raw save of it restores only onto the same "
            "grid and settings. Save with ckpt.save_train_state(n, step, params, opt_state) and "
            "restore with ckpt.restore_train_state(step, params, opt_state): that form restores "
            "onto any grid. With the same grid, restore with the same settings it was saved with."
        )
    return ValueError(
        f"the {item} target does not match {where}: missing from the checkpoint "
        f"{sorted(extra) or 'none'}; in the checkpoint but not in the target (of any process) "
        f"{sorted(missing) or 'none'}. Remedy: {remedy}"
    )


_TRAIN_STEP_STATE = "opt_state/optimizer/"  # a train step's OptState saved as it is (Checkpointer.save)


def targets(item: str, tree, saved: Mapping[str, LeafMeta | None], where: str):
    """``({path: sharding | ELSEWHERE}, treedef)`` for ``tree``, checked against ``saved``.

    Paths are checked here one way (each must be in the checkpoint); that the
    processes' targets together cover the checkpoint is :func:`check_complete`.
    """
    pairs, treedef = _flatten(item, tree)
    stored = _stored(item, saved)
    if pairs and not stored:
        raise ValueError(
            f"{where} holds no {item} (saved without it, or its {item} folder is missing). Remedy: "
            f"restore without an {item} target"
            + (" and start the optimizer afresh (step.init), or restore a step saved with it."
               if item == "opt_state" else ", or restore a step saved with it.")
        )
    unknown = {p for p, _ in pairs} - stored
    if unknown:
        raise _mismatch(item, where, unknown, ())
    wanted = {}
    for path, leaf in pairs:
        meta = saved[path]
        if leaf is None:
            wanted[path] = ELSEWHERE
            continue
        if meta is None:
            raise ValueError(
                f"'{path}' was saved empty (None on every process) in {where}, but the target "
                "asks for an array. Remedy: pass None for it."
            )
        if isinstance(leaf, jax.sharding.Sharding):
            wanted[path] = _checked(leaf, path, meta, where)
            continue
        shape, dtype = tuple(np.shape(leaf)), _dtype_name(leaf)
        if (shape, dtype) != (meta.shape, meta.dtype):
            raise ValueError(
                f"'{path}' is {meta.dtype}{list(meta.shape)} in {where} but the target is "
                f"{dtype}{list(shape)}. Remedy: restore into the model/optimizer configuration it "
                "was saved from (same sizes and dtypes; any grid)."
            )
        sharding = getattr(leaf, "sharding", None)
        if sharding is None and not isinstance(leaf, np.ndarray):
            raise ValueError(f"target '{path}' has no sharding; give a Sharding, jax.Array or "
                             "ShapeDtypeStruct(..., sharding=...)")  # fmt: skip
        wanted[path] = None if sharding is None else _checked(sharding, path, meta, where)
    return wanted, treedef


def check_complete(wanted: Mapping[str, Mapping | None], saved: Mapping, where: str) -> None:
    """The targets of all processes together cover every saved path with data (collective)."""
    local = {item: sorted(paths) for item, paths in wanted.items() if paths is not None}
    union: dict[str, set[str]] = {}
    for listing in allgather_json(local):
        for item, paths in listing.items():
            union.setdefault(item, set()).update(paths)
    for item, paths in union.items():
        missing = {p for p in _stored(item, saved) if saved[p] is not None} - paths
        if missing:
            raise _mismatch(item, where, (), missing)


def _checked(sharding: jax.sharding.Sharding, path: str, meta: LeafMeta, where: str):
    """``sharding`` if it can lay out the saved shape, else a ``ValueError`` naming ``path``."""
    try:
        sharding.shard_shape(meta.shape)
    except ValueError as err:
        raise ValueError(
            f"target sharding of '{path}' cannot lay out its saved shape {list(meta.shape)} "
            f"({where}): {err}. Remedy: pick grid sizes that divide the dimensions."
        ) from None
    return sharding


def _dtype_name(leaf) -> str:
    """The dtype as checkpoints record it (``key<impl>`` for typed PRNG keys)."""
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    if isinstance(leaf, jax.Array) and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return f"key<{jax.random.key_impl(leaf)}>"
    return jnp.dtype(dtype).name


def optimizer_target(optimizer, param_targets, param_tree, saved):
    """Optimizer-state target: leaves mirroring a parameter take its sharding.

    The target of a model with state is its variables dict (``{'params': ...,
    'batch_stats': ...}``); the optimizer state is over ``params`` alone, as
    ``optimizer.init(variables['params'])`` (or ``pm.init_optimizer``) made it.
    """
    shardings = [None if s is ELSEWHERE else s for s in param_targets.values()]
    meshes = [s.mesh for s in shardings if isinstance(s, NamedSharding)]
    if not meshes:
        raise ValueError(
            "deriving the optimizer-state target needs at least one parameter with a "
            "NamedSharding on this process. Remedy: pass opt_state=... instead."
        )
    abstract = [
        None if s is None else jax.ShapeDtypeStruct(saved[p].shape, jnp.dtype(saved[p].dtype))
        for p, s in zip(param_targets, shardings)
    ]
    params, shardings = jax.tree.unflatten(param_tree, abstract), jax.tree.unflatten(param_tree, shardings)
    if isinstance(params, Mapping) and "params" in params and len(params) > 1:  # variables with state
        params, shardings = params["params"], shardings["params"]
    return optimizer_state_shardings(optimizer, params, shardings, NamedSharding(meshes[0], P()))

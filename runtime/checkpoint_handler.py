"""An orbax checkpoint handler for flat ``{path: array}`` trees, written shard by shard.

Orbax's own PyTree handler refuses arrays that live entirely on one process
when several processes run (the pipeline-stage case: each stage's parameters
sit on one process's devices) and wants the same tree on every process. This
handler writes each leaf as one grid-independent Zarr array
(:mod:`~axonn_jax.runtime.shard_store`): every process writes the shards it
holds, a leaf held elsewhere is passed as ``None``, and process 0 writes the
JSON index of paths. Orbax's ``CheckpointManager`` provides the rest:
asynchronous commit, the temporary directory renamed only when every process
has finished, retention, step listing.

Directory layout of one item::

    index.json            {"format": ..., "leaves": [{"path": "params/dense/kernel",
                                                       "dir": "leaf_00000"}, ...]}
    leaf_00000/zarr.json  shape, dtype, chunk grid, codecs (JSON)
    leaf_00000/c.0.1      one chunk per saved shard, CRC-32C checked

Example::

    manager = ocp.CheckpointManager(path, item_handlers={"arrays": ShardedTreeHandler()})
    manager.save(step, args=ocp.args.Composite(arrays=ShardedTreeSave(leaves)))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.experimental import multihost_utils

from axonn_jax.runtime import shard_store
from axonn_jax.runtime.shard_store import DamagedArrayError, LeafMeta

FORMAT = "axonn_jax.sharded_tree/1"
INDEX = "index.json"
_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, bool, int, float)


@dataclasses.dataclass
class ShardedTreeSave(ocp.args.CheckpointArgs):
    """``leaves`` and ``owners`` as :func:`plan_leaves` returns them (computed before
    the save starts, so that a bad tree fails before orbax begins the step):
    the same paths on every process, ``None`` where this process lacks a leaf."""

    leaves: Sequence[tuple[str, Any]]
    owners: Sequence[int | None]


@dataclasses.dataclass
class ShardedTreeRestore(ocp.args.CheckpointArgs):
    """``targets``: ``{path: sharding}`` of the leaves to read (``None``: to host)."""

    targets: Mapping[str, jax.sharding.Sharding | None]


class ShardedTreeHandler(ocp.AsyncCheckpointHandler):
    """Saves and restores :class:`ShardedTreeSave` items (see the module doc)."""

    async def async_save(
        self, directory, args: ShardedTreeSave | None = None
    ) -> list[ocp.future.Future]:
        """Copy this process's shards to host now; write them in the background."""
        if args is None:
            raise ValueError("ShardedTreeHandler.async_save needs args=ShardedTreeSave(...)")
        me = jax.process_index()
        prepared = [
            (_leaf_dir(i), shard_store.prepare(path, value, sole_writer=owner == me))
            for i, ((path, value), owner) in enumerate(zip(args.leaves, args.owners))
            if value is not None
        ]
        entries = [
            {"path": path, "dir": None if owner is None else _leaf_dir(i)}
            for i, ((path, _), owner) in enumerate(zip(args.leaves, args.owners))
        ]
        index = {"format": FORMAT, "leaves": entries}
        is_primary = me == 0

        async def commit() -> None:
            root = Path(str(directory))
            context = ts.Context()
            writes = [shard_store.write(leaf, root / name, context) for name, leaf in prepared]
            await asyncio.gather(*writes)
            if is_primary:
                (root / INDEX).write_text(json.dumps(index))

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name="axonn_jax_arrays")]

    def save(self, directory, args: ShardedTreeSave | None = None) -> None:
        for commit in _run(self.async_save(directory, args)):
            commit.result()

    def metadata(self, directory) -> dict[str, LeafMeta | None]:
        """``{path: LeafMeta}`` of every saved leaf, ``None`` if saved empty (JSON only)."""
        root = Path(str(directory))
        metas: dict[str, LeafMeta | None] = {}
        for path, name in read_index(root).items():
            if name is None:
                metas[path] = None
                continue
            try:
                meta = shard_store.read_meta(root / name)
            except DamagedArrayError as err:
                raise DamagedArrayError(f"'{path}': {err}") from None
            if meta.path != path:
                raise DamagedArrayError(f"{root / name} holds '{meta.path}', not '{path}'")
            metas[path] = meta
        return metas

    def restore(self, directory, args: ShardedTreeRestore | None = None) -> dict[str, Any]:
        """``{path: value}`` for the paths in ``args.targets``, placed on their shardings."""
        if args is None:
            raise ValueError("ShardedTreeHandler.restore needs args=ShardedTreeRestore(...)")
        root = Path(str(directory))
        index = read_index(root)
        unknown = sorted(p for p in args.targets if index.get(p) is None)
        if unknown:
            raise KeyError(f"{root} holds no data for {unknown}")

        async def read_all() -> list:
            context = ts.Context()

            async def one(path: str, target):
                leaf = root / index[path]
                try:
                    meta = shard_store.read_meta(leaf)
                    return await shard_store.read(leaf, meta, target, context)
                except DamagedArrayError as err:
                    raise DamagedArrayError(f"'{path}': {err}") from None

            return await asyncio.gather(*(one(p, t) for p, t in args.targets.items()))

        return dict(zip(args.targets, _run(read_all())))

    def finalize(self, directory) -> None:
        del directory  # every process's chunks are complete once its commit future is

    def close(self) -> None:
        pass


# `register_with_handler` pairs args with their handler class; done after both exist.
ocp.args.register_with_handler(ShardedTreeHandler, for_save=True)(ShardedTreeSave)
ocp.args.register_with_handler(ShardedTreeHandler, for_restore=True)(ShardedTreeRestore)


def read_index(root: Path) -> dict[str, str | None]:
    """``{path: leaf directory name}`` (``None``: saved empty) from ``index.json``."""
    file = root / INDEX
    try:
        doc = json.loads(file.read_text())
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
        return {leaf["path"]: _safe_name(leaf["dir"]) for leaf in doc["leaves"]}
    except FileNotFoundError:
        raise DamagedArrayError(f"{file} is missing") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise DamagedArrayError(f"{file} is not a valid index ({err})") from None


def plan_leaves(leaves: Sequence[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], list[int | None]]:
    """The job-wide leaf list and, per leaf, the lowest process holding it.

    Processes may pass different trees (e.g. only their own pipeline stages'
    optimizer states): the result covers the union of their paths (in order of
    first appearance, process 0 first), with ``None`` for what this process
    lacks. A leaf no process holds has owner ``None`` and is saved as empty.
    Also validates the leaves. Collective when several processes run.
    """
    paths = [path for path, _ in leaves]
    if len(set(paths)) != len(paths):
        raise ValueError(f"duplicate checkpoint paths in {paths}")
    for path, value in leaves:
        if not (value is None or isinstance(value, _ARRAY_LIKE)):
            raise TypeError(
                f"checkpoint leaf '{path}' is a {type(value).__name__}, not an array. Remedy: keep "
                "only arrays and numbers in the checkpointed pytrees; put other state in `extra`."
            )
    mine = [[path, value is not None] for path, value in leaves]
    owners: dict[str, int | None] = {}
    for process, listing in enumerate(allgather_json(mine)):
        for path, held in listing:
            owners.setdefault(path, None)
            if held and owners[path] is None:
                owners[path] = process
    local = dict(leaves)
    return [(path, local.get(path)) for path in owners], list(owners.values())


def allgather_json(value: Any) -> list[Any]:
    """``value`` (JSON-able) of every process, in process order (collective)."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
    sizes = sizes.reshape(-1)
    padded = np.zeros(max(1, int(sizes.max())), np.uint8)
    padded[: data.size] = data
    table = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:size])) for row, size in zip(table, sizes)]


def _leaf_dir(i: int) -> str:
    return f"leaf_{i:05d}"


def _safe_name(name: str | None) -> str | None:
    """Leaf directories are ``leaf_NNNNN``; anything else (e.g. ``../x``) is rejected."""
    if name is not None and not (isinstance(name, str) and name.startswith("leaf_") and name[5:].isdigit()):
        raise ValueError(f"bad leaf directory name {name!r}")
    return name


def _run(coro):
    """Run a coroutine to completion, also when called from inside an event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()

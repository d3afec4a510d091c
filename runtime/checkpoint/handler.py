"""An orbax checkpoint handler that writes pytrees in orbax's standard layout, shard by shard.

What it writes is what ``orbax.checkpoint.StandardCheckpointHandler`` writes
with ``use_ocdbt=False, use_zarr3=True``: a ``_METADATA`` JSON tree index and
one Zarr v3 array per leaf, in a directory named by the leaf's keys joined
with dots. So plain orbax (``StandardCheckpointer().restore(step_dir /
"params")``) reads it without axonn_jax. Orbax's own handler cannot write
these trees: under several processes it refuses arrays that live on one
process only (a pipeline stage's parameters) and arrays with no shard on the
calling process. Here every process writes the shards it holds
(:mod:`~axonn_jax.runtime.checkpoint.shard_store`, CRC-32C per chunk), a leaf held by
another process is ``None``, and process 0 writes ``_METADATA``. Orbax's
``CheckpointManager`` does the rest: asynchronous commit, the temporary
directory renamed only when every process has finished, retention.

Directory layout of one item::

    _METADATA                  orbax's tree metadata (JSON): per leaf its keys and type;
                               empty nodes ({}, optax.EmptyState()) and leaves no
                               process holds are entries without data
    block_0.attn.kernel/       zarr.json (shape, dtype, chunk grid, codecs) + chunks c.0.1

Example::

    manager = ocp.CheckpointManager(path, item_handlers={"params": StandardTreeHandler()})
    plan = plan_leaves({"params": [(LeafKey.of(keys), leaf) for keys, leaf in flat_with_path]})
    manager.save(step, args=ocp.args.Composite(params=plan["params"]))
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

from axonn_jax.runtime.checkpoint import shard_store
from axonn_jax.runtime.checkpoint.shard_store import DamagedArrayError, LeafMeta
from axonn_jax.runtime.collectives import world

FORMAT = "axonn_jax.standard_tree/2"
METADATA = "_METADATA"
_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, bool, int, float)
_SEQUENCE, _DICT = 1, 2  # orbax's KeyType values


@dataclasses.dataclass(frozen=True)
class LeafKey:
    """Where a leaf sits in its tree: key names and, per key, whether it is a sequence index."""

    names: tuple[str, ...]
    sequence: tuple[bool, ...]

    @classmethod
    def of(cls, keypath: Sequence) -> LeafKey:
        """From a JAX key path (``DictKey``, ``GetAttrKey``, ``SequenceKey``, ...)."""
        names, sequence = [], []
        for key in keypath:
            if isinstance(key, jax.tree_util.DictKey):
                names.append(str(key.key))
            elif isinstance(key, jax.tree_util.GetAttrKey):
                names.append(key.name)
            elif isinstance(key, jax.tree_util.SequenceKey | jax.tree_util.FlattenedIndexKey):
                names.append(str(key.idx))
            else:
                raise TypeError(f"unsupported pytree key {key!r} in a checkpointed tree")
            sequence.append(not isinstance(key, jax.tree_util.DictKey | jax.tree_util.GetAttrKey))
        return cls(tuple(names), tuple(sequence))

    @property
    def path(self) -> str:
        """``block_0/attn/kernel``: how messages and restore targets name the leaf."""
        return "/".join(self.names)

    @property
    def dir_name(self) -> str:
        """``block_0.attn.kernel``: the leaf's directory, as orbax names it."""
        return ".".join(self.names)

    def to_json(self) -> list:
        return [list(self.names), list(self.sequence)]

    @classmethod
    def from_json(cls, doc) -> LeafKey:
        names, sequence = doc
        return cls(tuple(map(str, names)), tuple(map(bool, sequence)))


@dataclasses.dataclass(frozen=True)
class EmptyNode:
    """A subtree without leaves (``{}``, ``()``, ``optax.EmptyState()``): recorded, holds no data.

    ``value_type`` is orbax's name for it ("Dict", "List", "None"), so a plain
    reader rebuilds the same structure."""

    value_type: str


@dataclasses.dataclass
class StandardTreeSave(ocp.args.CheckpointArgs):
    """``leaves`` and ``owners`` as :func:`plan_leaves` returns them (computed before
    the save starts, so that a bad tree fails before orbax begins the step):
    the same keys on every process, ``None`` where this process lacks a leaf."""

    leaves: Sequence[tuple[LeafKey, Any]]
    owners: Sequence[int | None]
    value_types: Sequence[str]
    prepared: Sequence[tuple[str, shard_store.PreparedLeaf]] | None = None  # prepare_shards


@dataclasses.dataclass
class StandardTreeRestore(ocp.args.CheckpointArgs):
    """``targets``: ``{path: sharding}`` of the leaves to read (``None``: to host)."""

    targets: Mapping[str, jax.sharding.Sharding | None]


class StandardTreeHandler(ocp.AsyncCheckpointHandler):
    """Saves and restores :class:`StandardTreeSave` items (see the module doc)."""

    async def async_save(self, directory, args: StandardTreeSave | None = None) -> list:
        """Copy this process's shards to host now; write them in the background."""
        if args is None:
            raise ValueError("StandardTreeHandler.async_save needs args=StandardTreeSave(...)")
        prepared = (args if args.prepared is not None else prepare_shards(args)).prepared
        metadata = _tree_metadata(args, prepared)
        is_primary = jax.process_index() == 0

        async def commit() -> None:
            root = Path(str(directory))
            context = ts.Context()
            await asyncio.gather(*(shard_store.write(leaf, root / name, context)
                                   for name, leaf in prepared))  # fmt: skip
            if is_primary:
                (root / METADATA).write_text(json.dumps(metadata))

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name="axonn_jax_tree")]

    def save(self, directory, args: StandardTreeSave | None = None) -> None:
        for commit in _run(self.async_save(directory, args)):
            commit.result()

    def metadata(self, directory) -> dict[str, LeafMeta | None]:
        """``{path: LeafMeta}`` of every saved leaf, ``None`` if saved empty (JSON only)."""
        root = Path(str(directory))
        return read_metas(root, read_index(root))

    def restore(self, directory, args: StandardTreeRestore | None = None) -> dict[str, Any]:
        """``{path: value}`` for the paths in ``args.targets``, placed on their shardings."""
        if args is None:
            raise ValueError("StandardTreeHandler.restore needs args=StandardTreeRestore(...)")
        return read_leaves(Path(str(directory)), read_index(Path(str(directory))), args.targets)

    def finalize(self, directory) -> None:
        del directory  # every process's chunks are complete once its commit future is

    def close(self) -> None:
        pass


# `register_with_handler` pairs args with their handler class; done after both exist.
ocp.args.register_with_handler(StandardTreeHandler, for_save=True)(StandardTreeSave)
ocp.args.register_with_handler(StandardTreeHandler, for_restore=True)(StandardTreeRestore)


def prepare_shards(plan: StandardTreeSave) -> StandardTreeSave:
    """``plan`` with this process's shards copied to host memory (synchronous).

    Done before orbax starts a step, so that a leaf that cannot be read (e.g.
    deleted by donation) fails the ``save`` call instead of orbax's threads."""
    me = jax.process_index()
    prepared = [
        (key.dir_name, shard_store.prepare(key.path, value, sole_writer=owner == me))
        for (key, value), owner in zip(plan.leaves, plan.owners)
        if value is not None and not isinstance(value, EmptyNode)
    ]
    return dataclasses.replace(plan, prepared=prepared)


def read_metas(root: Path, index: Mapping[str, str | None]) -> dict[str, LeafMeta | None]:
    """``{path: LeafMeta}`` of the leaves in ``index`` (``None``: saved empty), checked to be theirs."""
    metas: dict[str, LeafMeta | None] = {}
    for path, name in index.items():
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


def read_leaves(root: Path, index: Mapping[str, str | None], targets: Mapping) -> dict[str, Any]:
    """Read the leaves ``targets`` names (``{path: sharding or None}``) from ``root``."""
    unknown = sorted(p for p in targets if index.get(p) is None)
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

        return await asyncio.gather(*(one(p, t) for p, t in targets.items()))

    return dict(zip(targets, _run(read_all())))


def read_index(root: Path) -> dict[str, str | None]:
    """``{path: leaf directory name}`` (``None``: saved empty) from ``_METADATA``."""
    file = root / METADATA
    try:
        doc = json.loads(file.read_text())
        ours = doc["custom_metadata"]["axonn_jax"]
        if ours.get("format") != FORMAT:
            raise ValueError(f"format {ours.get('format')!r}, expected {FORMAT!r}")
        index: dict[str, str | None] = {}
        for entry in doc["tree_metadata"].values():
            key = LeafKey(tuple(str(k["key"]) for k in entry["key_metadata"]),
                          tuple(k["key_type"] == _SEQUENCE for k in entry["key_metadata"]))  # fmt: skip
            has_data = not entry["value_metadata"]["skip_deserialize"]
            index[key.path] = _safe_name(key.dir_name) if has_data else None
        return index
    except FileNotFoundError:
        raise DamagedArrayError(f"{file} is missing") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise DamagedArrayError(f"{file} is not a valid tree index ({err!r})") from None


def plan_leaves(items: Mapping[str, Sequence[tuple[LeafKey, Any]]]) -> dict[str, StandardTreeSave]:
    """Per item, the job-wide leaf list and, per leaf, the lowest process holding it.

    Processes may pass different trees (e.g. only their own pipeline stages'
    optimizer states): the result covers the union of their keys (in order of
    first appearance, process 0 first), with ``None`` for what this process
    lacks. A leaf no process holds has owner ``None`` and is saved empty, as
    are :class:`EmptyNode` values.
    Also validates the leaves (types, and keys that would share a directory).
    One collective for all items when several processes run.
    """
    mine = {}
    for item, leaves in items.items():
        _check_keys(item, leaves)
        mine[item] = [[key.to_json(), None if value is None else _value_type(value),
                       not (value is None or isinstance(value, EmptyNode))]
                      for key, value in leaves]  # fmt: skip
    plans = {}
    listings = allgather_json(mine)
    for item, leaves in items.items():
        owners: dict[LeafKey, int | None] = {}
        types: dict[LeafKey, str] = {}
        for process, listing in enumerate(listings):
            for key_doc, value_type, held in listing.get(item, []):
                key = LeafKey.from_json(key_doc)
                owners.setdefault(key, None)
                if held and owners[key] is None:
                    owners[key], types[key] = process, value_type
                types.setdefault(key, value_type)
        local = dict(leaves)
        plans[item] = StandardTreeSave([(key, local.get(key)) for key in owners],
                                       list(owners.values()),
                                       [types.get(key) or "None" for key in owners])  # fmt: skip
    return plans


def allgather_json(value: Any) -> list[Any]:
    """``value`` (JSON-able) of every process, in process order (collective).

    Over MPI (:func:`~axonn_jax.runtime.collectives.world`), not an XLA program: a job
    whose CPU collectives stay inside each process cannot run one across processes.
    """
    comm = world()
    return [value] if comm is None else comm.allgather(value)


def _check_keys(item: str, leaves: Sequence[tuple[LeafKey, Any]]) -> None:
    """Leaves are arrays or numbers; no two share a directory; names are plain."""
    seen: dict[str, str] = {}
    for key, value in leaves:
        where = f"{item}/{key.path}" if key.names else item
        if not (value is None or isinstance(value, (*_ARRAY_LIKE, EmptyNode))):
            raise TypeError(
                f"checkpoint leaf '{where}' is a {type(value).__name__}, not an array. Remedy: keep "
                "only arrays and numbers in the checkpointed pytrees; put other state in `extra`."
            )
        if not key.names or any(not n or "/" in n or n.startswith(".") for n in key.names):
            raise ValueError(
                f"checkpoint leaf '{where}' has a key orbax cannot name a directory by (empty, "
                "containing '/' or starting with '.'). Remedy: rename the key, or wrap a bare "
                "array in a dict."
            )
        if key.dir_name in seen and seen[key.dir_name] != key.path:
            raise ValueError(
                f"checkpoint leaves '{item}/{seen[key.dir_name]}' and '{where}' would both be "
                f"stored as '{item}/{key.dir_name}' (orbax joins keys with '.'). Remedy: rename "
                "keys that contain '.'."
            )
        seen[key.dir_name] = key.path


def _tree_metadata(args: StandardTreeSave, prepared) -> dict:
    """Orbax's ``_METADATA`` document for the saved leaves (see the module doc)."""
    chunks = {name: leaf for name, leaf in prepared}
    tree = {}
    for (key, _), owner, value_type in zip(args.leaves, args.owners, args.value_types):
        entry = {"value_type": value_type, "skip_deserialize": owner is None}
        if key.dir_name in chunks:
            entry["write_shape"] = list(chunks[key.dir_name].chunks)
        tree[str(key.names)] = {
            "key_metadata": [{"key": n, "key_type": _SEQUENCE if s else _DICT}
                             for n, s in zip(key.names, key.sequence)],  # fmt: skip
            "value_metadata": entry,
        }
    return {
        "tree_metadata": tree,
        "use_ocdbt": False,
        "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": {"axonn_jax": {"format": FORMAT}},
    }


def _value_type(value) -> str:
    """Orbax's name for how a plain reader gets a leaf back: device array, host array or scalar."""
    if isinstance(value, EmptyNode):
        return value.value_type
    if isinstance(value, np.ndarray):
        return "np.ndarray"
    if isinstance(value, np.generic | bool | int | float):
        return "scalar"
    return "jax.Array"


def _safe_name(name: str) -> str:
    """Leaf directories are plain names (no ``/``, not ``.``/``..``): never outside the item."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad leaf directory name {name!r}")
    return name


def _run(coro):
    """Run a coroutine to completion, also when called from inside an event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()

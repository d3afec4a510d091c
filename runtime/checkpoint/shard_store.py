"""One checkpointed array = one Zarr v3 array of its global logical value.

Each process writes the shards it holds (those with ``replica_id == 0``) as
chunks of the array; the chunk grid is the saving sharding's shard shape, so
writers never touch the same file. Every chunk carries a CRC-32C checksum, and
missing chunks are an error on read (never silently zero), so a truncated,
corrupted or incomplete array is detected. Reading takes any target sharding:
each process reads just the regions its devices need. Metadata is JSON
(``zarr.json``); nothing is ever unpickled.

Example::

    leaf = prepare("params/dense/kernel", array, sole_writer=True)  # this process's shards to host
    await write(leaf, root / "block_0.attn.kernel", context)    # in a background thread
    meta = read_meta(root / "block_0.attn.kernel")
    value = await read(root / "block_0.attn.kernel", meta, target_sharding, context)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax.sharding import SingleDeviceSharding

#: Per-chunk codecs: raw little-endian bytes followed by a CRC-32C checksum.
CODECS = ({"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"})
#: Chunk files ``c.0.1`` side by side (no directory per dim: fewer inodes to create and delete).
CHUNK_KEYS = {"name": "default", "configuration": {"separator": "."}}
_ATTRS = "axonn_jax"


class DamagedArrayError(RuntimeError):
    """An array on disk is unreadable: missing or truncated files, checksum mismatch."""


@dataclasses.dataclass(frozen=True)
class LeafMeta:
    """What ``zarr.json`` says about a saved leaf (the stored value, not a layout)."""

    path: str
    shape: tuple[int, ...]  # logical shape (without the key-data dims of PRNG keys)
    dtype: str  # logical dtype; "key<impl>" for typed PRNG keys
    key_impl: str | None = None

    @property
    def is_key(self) -> bool:
        return self.key_impl is not None


@dataclasses.dataclass
class PreparedLeaf:
    """A leaf copied to host memory, ready to be written without touching devices."""

    path: str
    meta: LeafMeta
    stored_shape: tuple[int, ...]
    stored_dtype: str
    chunks: tuple[int, ...]
    creates_metadata: bool
    shards: list[tuple[tuple[slice, ...], np.ndarray]]


def prepare(path: str, value: Any, *, sole_writer: bool) -> PreparedLeaf:
    """Copy the shards this process must write to host memory (synchronous).

    ``value`` is a ``jax.Array`` (possibly a typed PRNG key array, possibly on
    devices of other processes only), a NumPy array or a Python scalar. An
    array spanning several processes is written cooperatively (each process
    its ``replica_id == 0`` shards); anything else exists whole on each process
    that holds it and is written by the one marked ``sole_writer``.
    """
    key_impl = None
    if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        key_impl = str(jax.random.key_impl(value))
        logical = (tuple(value.shape), f"key<{key_impl}>")
        value = jax.random.key_data(value)
    if isinstance(value, jax.Array):
        shape, chunks = tuple(value.shape), tuple(value.sharding.shard_shape(value.shape))
        if value.is_fully_addressable and not sole_writer:
            shards = []
        else:
            shards = [(_normalize(s.index, shape), np.array(s.data, copy=True))
                      for s in value.addressable_shards if s.replica_id == 0]  # fmt: skip
        creates = any(all(sl.start == 0 for sl in index) for index, _ in shards)
    else:
        host = np.array(value, copy=True)
        if isinstance(value, (bool, int, float, complex)):  # as JAX would store it
            host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype))
        if host.dtype == object:
            raise TypeError(
                f"checkpoint leaf '{path}' is a {type(value).__name__}, not an array. Remedy: keep "
                "only arrays and numbers in the checkpointed pytrees; put other state in `extra`."
            )
        shape, chunks, value = tuple(host.shape), tuple(host.shape), host
        shards = [(_normalize((), shape), host)] if sole_writer else []
        creates = sole_writer
    stored_dtype = jnp.dtype(value.dtype).name
    if key_impl is None:
        logical = (shape, stored_dtype)
    meta = LeafMeta(path, logical[0], logical[1], key_impl)
    return PreparedLeaf(path, meta, shape, stored_dtype, tuple(max(1, c) for c in chunks),
                        creates, shards)  # fmt: skip


async def write(leaf: PreparedLeaf, directory: Path, context: ts.Context) -> None:
    """Write ``leaf``'s host shards as chunks of the Zarr array at ``directory``."""
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(directory)},
        "metadata": {
            "shape": list(leaf.stored_shape),
            "data_type": leaf.stored_dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(leaf.chunks)}},
            "chunk_key_encoding": CHUNK_KEYS,
            "codecs": list(CODECS),
            "attributes": {_ATTRS: dataclasses.asdict(leaf.meta)},
        },
        "store_data_equal_to_fill_value": True,  # write every chunk, zeros too
    }
    if leaf.creates_metadata:
        store = await ts.open(spec, create=True, open=True, context=context)
    else:  # another process writes zarr.json; the chunk grid is the same everywhere
        store = await ts.open(spec, open=True, assume_metadata=True, context=context)
    await asyncio.gather(*(store[index].write(data) for index, data in leaf.shards))


def read_meta(directory: Path) -> LeafMeta:
    """The :class:`LeafMeta` stored in ``directory/zarr.json``."""
    file = directory / "zarr.json"
    try:
        doc = json.loads(file.read_text())
        attrs = doc["attributes"][_ATTRS]
        meta = LeafMeta(attrs["path"], tuple(attrs["shape"]), attrs["dtype"], attrs["key_impl"])
    except FileNotFoundError:
        raise DamagedArrayError(f"{file} is missing") from None
    except (ValueError, KeyError, TypeError) as err:
        raise DamagedArrayError(f"{file} is not valid array metadata ({err!r})") from None
    return meta


async def read(directory: Path, meta: LeafMeta, sharding: jax.sharding.Sharding | None,
               context: ts.Context) -> Any:  # fmt: skip
    """Read the leaf onto ``sharding`` (a ``jax.Array``), or to host if ``None``."""
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(directory)},
        "fill_missing_data_reads": False,  # a missing chunk is damage, not zeros
    }
    try:
        store = await ts.open(spec, open=True, context=context)
        stored = (tuple(store.shape), jnp.dtype(store.dtype.numpy_dtype).name)
        if not meta.is_key and stored != (meta.shape, meta.dtype):
            raise DamagedArrayError(
                f"{directory} holds {stored[1]}{list(stored[0])} but its metadata says "
                f"{meta.dtype}{list(meta.shape)}"
            )
        if meta.is_key:
            value = jax.random.wrap_key_data(await store.read(), impl=meta.key_impl)
            return value if sharding is None else jax.device_put(value, sharding)
        if sharding is None:
            return await store.read()
        shape = meta.shape
        indices = sharding.addressable_devices_indices_map(shape)
        wanted = {device: _normalize(index, shape) for device, index in indices.items()}
        keys = sorted({_key(i) for i in wanted.values()})
        by_key = {_key(i): i for i in wanted.values()}
        blocks = await asyncio.gather(*(store[by_key[k]].read() for k in keys))
        host = dict(zip(keys, blocks))
    except ValueError as err:  # tensorstore reports I/O and checksum failures as ValueError
        raise DamagedArrayError(f"reading {directory} failed: {err}") from None
    # each block in the target's memory kind (e.g. pinned_host for offloaded optimizer state)
    kind = sharding.memory_kind
    arrays = [jax.device_put(host[_key(index)], SingleDeviceSharding(device, memory_kind=kind))
              for device, index in wanted.items()]  # fmt: skip
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _normalize(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Explicit ``slice(start, stop)`` per dim (shard indices may hold ``slice(None)``)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _key(index: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in index)

"""Moving activations and gradients between pipeline stages.

One narrow interface (:class:`Transport`): the dispatch queue announces what it
expects (:meth:`~Transport.expect`, posting receives before it computes),
tests for arrival without blocking (:meth:`~Transport.arrived`), and hands over
outputs (:meth:`~Transport.send`, which never blocks the queue). Every shard of
a sharded activation goes straight to the device at the same mesh position of
the destination stage; nothing is gathered through one rank. The rest of a
pipelined step's traffic goes through the same object: host values between
the processes (:meth:`~Transport.allgather`, :meth:`~Transport.broadcast`,
:meth:`~Transport.all_true`, :meth:`~Transport.barrier`) and the gradients of
parameters that several stages share (:meth:`~Transport.sum_shared`).

- :class:`InProcessTransport`: stage meshes on different devices of one
  process; an asynchronous ``jax.device_put`` per message.
- :class:`MpiTransport`: between processes. Device arrays leave through
  ``mpi4jax.send`` on a sender thread (mpi4jax's send runs synchronously, so a
  thread keeps it off the queue; the thread holds each buffer until its send
  completes); receives are non-blocking ``MPI_Irecv`` posted ahead on a
  communicator of the pipeline's own (a ``Dup`` of ``COMM_WORLD``), so a send
  never waits on the receiver's compute and probing never touches other traffic.

Example:
    >>> transport = InProcessTransport()                      # doctest: +SKIP
    >>> transport.send(("F", 1, 0), arrays, shardings)        # doctest: +SKIP
    >>> transport.arrived(("F", 1, 0))                         # doctest: +SKIP
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from axonn_jax.runtime.launch import HostComm

#: (kind "F" | "B", destination stage, microbatch)
Key = tuple[str, int, int]


class Transport(Protocol):
    #: messages may arrive from other processes at any time (the queue polls while it waits)
    polled: bool

    def expect(self, key: Key, avals: Sequence[jax.ShapeDtypeStruct], source_mesh) -> None:
        """Post the receives of message ``key`` (arrays like ``avals``, from ``source_mesh``)."""

    def arrived(self, key: Key) -> list[jax.Array] | None:
        """The message's arrays if all of it has arrived (once), else ``None``."""

    def send(self, key: Key, arrays: Sequence[jax.Array], shardings: Sequence[NamedSharding]) -> None:
        """Hand ``arrays`` to the destination stage, laid out as ``shardings``."""

    def wait(self, wake: threading.Event, timeout: float) -> None:
        """Return when ``wake`` is set, a message may have arrived, or after ``timeout`` s.

        The dispatch queue's idle wait (``wake`` is set when one of its tasks
        finishes). Default: ``wake.wait(timeout)``.
        """
        wake.wait(timeout)

    def close(self) -> None:
        """Wait until every send has completed."""

    def allgather(self, obj: Any) -> list:
        """Every process's host value ``obj``, in process order."""

    def gather(self, obj: Any, root: int = 0) -> list | None:
        """Every process's host value on process ``root`` (``None`` elsewhere)."""

    def broadcast(self, obj: Any, root: int) -> Any:
        """Process ``root``'s host value on every process."""

    def all_true(self, flag: Any) -> bool:
        """Logical AND of ``flag`` over the processes."""

    def barrier(self) -> None:
        """Wait until every process got here."""

    def sum_shared(self, grads: list, users: Sequence[Sequence[int]], homes: Sequence[int | None],
                   shared: Sequence[int]) -> list:  # fmt: skip
        """Gradients of parameters used by several stages, summed over every process holding one.

        ``grads[i]`` is this process's gradient of parameter ``i`` on the mesh
        of its home stage ``homes[i]``; ``users[i]`` are the stages using it.
        """


class InProcessTransport:
    """All stages in this process: an asynchronous device-to-device copy per message."""

    polled = False  # a message is handed over by this process's own send

    def __init__(self):
        self._mailbox: dict[Key, list[jax.Array]] = {}

    def expect(self, key, avals, source_mesh) -> None:
        del key, avals, source_mesh

    def arrived(self, key):
        return self._mailbox.pop(key, None)

    def send(self, key, arrays, shardings) -> None:
        self._mailbox[key] = [jax.device_put(a, s) for a, s in zip(arrays, shardings)]

    def wait(self, wake, timeout) -> None:
        wake.wait(timeout)

    def close(self) -> None:
        self._mailbox.clear()

    # one process: host values are already everywhere, local stages already summed
    def allgather(self, obj):
        return [obj]

    def gather(self, obj, root=0):
        return [obj]

    def broadcast(self, obj, root):
        return obj

    def all_true(self, flag) -> bool:
        return bool(np.asarray(flag))

    def barrier(self) -> None:
        pass

    def sum_shared(self, grads, users, homes, shared):
        return grads


def _wire(dtype) -> tuple[np.dtype, object]:
    """The dtype a buffer travels as and its MPI datatype (16-bit floats as uint16)."""
    from mpi4py import MPI

    dtype = np.dtype(dtype)
    table = {
        np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
        np.dtype(np.int32): MPI.INT32_T, np.dtype(np.int64): MPI.INT64_T,
        np.dtype(np.uint32): MPI.UINT32_T, np.dtype(np.uint8): MPI.UINT8_T,
    }  # fmt: skip
    if dtype in table:
        return dtype, table[dtype]
    if dtype.itemsize == 2:
        return np.dtype(np.uint16), MPI.UINT16_T
    if dtype.itemsize == 1:
        return np.dtype(np.uint8), MPI.UINT8_T
    raise TypeError(f"cannot send arrays of dtype {dtype} between stages")


def _is_key(dtype) -> bool:
    """Typed PRNG keys (nnx RNG streams in flight between stages) travel as their raw bits."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _bits_aval(shape: tuple, dtype) -> jax.ShapeDtypeStruct:
    """Shape and dtype of a shard on the wire: a key array's bits have a trailing dim."""
    if _is_key(dtype):
        return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
    return jax.ShapeDtypeStruct(shape, dtype)


def _from_bits(data: jax.Array, dtype) -> jax.Array:
    """A received shard back in ``dtype`` (keys rewrapped with their implementation)."""
    if not _is_key(dtype):
        return data
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(jnp.zeros((), dtype)))


def _position(mesh, device) -> int:
    """Flat index of ``device`` in ``mesh`` (the same position exists in every stage)."""
    flat = list(mesh.devices.flat)
    return flat.index(device)


class MpiTransport:
    """Stages on different processes: mpi4jax sends, pre-posted MPI receives.

    Args:
        meshes: the stage meshes (all stages, same shape), stage 0 first.
        comm: an mpi4py communicator reserved for pipeline messages; its rank
            must equal ``jax.process_index()``.
    """

    polled = True

    def __init__(self, meshes, comm=None):
        self.meshes = list(meshes)
        self.host = HostComm(comm) if comm is not None else HostComm.duplicate_world()
        self.comm = self.host.comm
        self.me = jax.process_index()
        if self.comm.Get_rank() != self.me:
            raise RuntimeError(
                f"MPI rank {self.comm.Get_rank()} differs from jax.process_index() {self.me}; "
                "initialise with axonn_jax.init() so JAX processes follow MPI ranks."
            )
        self._slots = self.meshes[0].devices.size
        # virtual stages: several stages share a mesh, so two links can join the same pair of
        # processes; a stage's rank among the stages on its mesh keeps their tags apart
        seen: dict[tuple, int] = {}
        self._chunk = []
        for mesh in self.meshes:
            ids = tuple(d.id for d in mesh.devices.flat)
            self._chunk.append(seen.get(ids, 0))
            seen[ids] = seen.get(ids, 0) + 1
        self._pending: dict[Key, list] = {}  # key → [(array index, device, buffer, request)]
        self._local: dict[tuple, jax.Array] = {}  # (key, array, position) → shard
        self._sends: queue.Queue = queue.Queue()
        self._send_programs: dict = {}  # (dest, tag) → jitted mpi4jax send
        self._errors: list[BaseException] = []
        self._inflight = 0
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._sender, name="axonn-mpi-send", daemon=True)
        self._thread.start()

    def _tag(self, key: Key, array: int, position: int) -> int:
        """Distinct per link between two processes: kind, the destination stage's place
        among the stages on its mesh (0 without virtual stages), array, mesh position."""
        kind = 0 if key[0] == "F" else 1
        return ((self._chunk[key[1]] * 2 + kind) * 1024 + array) * self._slots + position

    # --- receiving --------------------------------------------------------
    def expect(self, key, avals, source_mesh) -> None:
        dst_mesh = self.meshes[key[1]]
        posted = []
        for i, aval in enumerate(avals):
            sharding = aval.sharding
            for device, index in sharding.addressable_devices_indices_map(aval.shape).items():
                pos = _position(dst_mesh, device)
                source = list(source_mesh.devices.flat)[pos]
                if source.process_index == self.me:
                    continue  # arrives through _local
                bits = _bits_aval(tuple(len(range(*s.indices(n))) for s, n in zip(index, aval.shape)),
                                  aval.dtype)  # fmt: skip
                wire, mpi_type = _wire(bits.dtype)
                buffer = np.empty(bits.shape, wire)
                request = self.comm.Irecv([buffer, mpi_type], source=source.process_index,
                                          tag=self._tag(key, i, pos))  # fmt: skip
                posted.append((i, device, buffer, request))
        self._pending[key] = (list(avals), posted)

    def arrived(self, key):
        self._raise_sender_error()
        entry = self._pending.get(key)
        if entry is None:
            return None
        avals, posted = entry
        from mpi4py import MPI

        if posted and not MPI.Request.Testall([r for *_, r in posted]):
            return None
        dst_mesh = self.meshes[key[1]]
        shards: dict[int, list] = {i: [] for i in range(len(avals))}
        remote = {(i, device): buffer for i, device, buffer, _ in posted}
        for i, aval in enumerate(avals):
            for device in aval.sharding.addressable_devices_indices_map(aval.shape):
                if (i, device) in remote:
                    data = remote[(i, device)].view(_bits_aval((), aval.dtype).dtype)
                    shards[i].append(_from_bits(jax.device_put(data, device), aval.dtype))
                else:
                    local = self._local.pop((key, i, _position(dst_mesh, device)), None)
                    if local is None:
                        return None  # the local half has not been handed over yet
                    shards[i].append(local)
        del self._pending[key]
        return [
            jax.make_array_from_single_device_arrays(aval.shape, aval.sharding, shards[i])
            for i, aval in enumerate(avals)
        ]

    # --- sending ----------------------------------------------------------
    def send(self, key, arrays, shardings) -> None:
        dst_mesh = self.meshes[key[1]]
        for i, (array, sharding) in enumerate(zip(arrays, shardings)):
            src_mesh = array.sharding.mesh
            for shard in array.addressable_shards:
                pos = _position(src_mesh, shard.device)
                target = list(dst_mesh.devices.flat)[pos]
                if target.process_index == self.me:
                    self._local[(key, i, pos)] = jax.device_put(shard.data, target)
                else:
                    with self._lock:
                        self._inflight += 1
                    self._sends.put((shard.data, target.process_index, self._tag(key, i, pos)))

    def _sender(self) -> None:
        import mpi4jax

        while True:
            item = self._sends.get()
            if item is None:
                return
            data, dest, tag = item
            try:
                if _is_key(data.dtype):
                    data = jax.random.key_data(data)
                wire, _ = _wire(data.dtype)
                if wire != data.dtype:
                    data = jax.lax.bitcast_convert_type(data, jnp.dtype(wire))
                self._send_program(mpi4jax, dest, tag)(data)
            except BaseException as exc:  # surfaced on the queue's thread
                self._errors.append(exc)
            finally:
                del data
                with self._lock:
                    self._inflight -= 1
                    self._lock.notify_all()

    def _send_program(self, mpi4jax, dest: int, tag: int):
        """A jitted send per (destination, tag), compiled once.

        Eager ``mpi4jax.send`` calls keep ~1.4 MiB of host memory each (measured
        with mpi4jax 0.9.1: RSS grew ~3 MiB per training step); a cached jitted
        send does not (benchmarks/soak.py).
        """
        key = (dest, tag)
        if key not in self._send_programs:
            comm = self.comm
            self._send_programs[key] = jax.jit(
                lambda x: mpi4jax.send(x, dest=dest, tag=tag, comm=comm)
            )
        return self._send_programs[key]

    def wait(self, wake, timeout) -> None:
        wake.wait(timeout)

    def _raise_sender_error(self) -> None:
        if self._errors:
            raise RuntimeError(f"pipeline send failed: {self._errors[0]!r}") from self._errors[0]

    def close(self) -> None:
        with self._lock:
            while self._inflight:
                self._lock.wait(timeout=0.1)
                self._raise_sender_error()
        self._raise_sender_error()

    # --- host values and shared gradients --------------------------------------
    def allgather(self, obj):
        return self.host.allgather(obj)

    def gather(self, obj, root=0):
        return self.host.gather(obj, root)

    def broadcast(self, obj, root):
        return self.host.broadcast(obj, root)

    def all_true(self, flag) -> bool:
        return self.host.all_true(np.asarray(flag))

    def barrier(self) -> None:
        self.host.barrier()

    def sum_shared(self, grads, users, homes, shared):
        """Each shard is exchanged with the processes holding the same mesh position
        in the other stages that use the parameter; partial sums are added in
        process order, so every copy receives bitwise the same gradient."""
        from mpi4py import MPI

        comm, me, meshes = self.comm, self.me, self.meshes
        grads = list(grads)
        for i in shared:
            g = grads[i]
            if g is None:
                continue
            home = meshes[homes[i]]
            flat_home = list(home.devices.flat)
            partials, requests, shards = [], [], []
            for shard in g.addressable_shards:
                pos = flat_home.index(shard.device)
                peers = sorted({meshes[t].devices.flat[pos].process_index for t in users[i]} - {me})
                mine = np.ascontiguousarray(np.asarray(shard.data))
                received = {q: np.empty_like(mine) for q in peers}
                tag = (i * home.devices.size + pos) % 30000
                for q in peers:
                    requests.append(comm.Isend(mine, dest=q, tag=tag))
                    requests.append(comm.Irecv(received[q], source=q, tag=tag))
                partials.append((mine, received))
                shards.append(shard)
            MPI.Request.Waitall(requests)
            summed = []
            for (mine, received), shard in zip(partials, shards):
                parts = dict(received)
                parts[me] = mine
                total = parts[min(parts)].copy()
                for q in sorted(parts)[1:]:
                    total = total + parts[q]
                summed.append(jax.device_put(total, shard.device))
            grads[i] = jax.make_array_from_single_device_arrays(g.shape, g.sharding, summed)
        return grads

"""Host collectives: values that cross the processes of a job outside the pipeline's messages.

The one place for them (the pipeline transport only moves stage messages):

* :class:`HostComm` over an MPI communicator: small picklable host values
  (:meth:`~HostComm.allgather`, :meth:`~HostComm.gather`,
  :meth:`~HostComm.broadcast`, :meth:`~HostComm.all_true`,
  :meth:`~HostComm.barrier`) and the gradients of parameters that several
  pipeline stages share (:meth:`~HostComm.sum_shared`);
* :class:`SingleProcess`: the same calls when the job is one process (nothing
  crosses, every value is already everywhere);
* :func:`world` (a :class:`HostComm` over every process, or ``None`` in one
  process) and :func:`host_comm` (never ``None``).

Collective: every process makes the same calls in the same order.

Example (under ``mpiexec -n 2``)::

    comm = host_comm()
    comm.allgather(jax.process_index())   # [0, 1] on both ranks
    comm.all_true(rank_ok)                # False everywhere if any rank is not ok
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np


class HostCollectives(Protocol):
    """What the runtime asks of the job's processes (:class:`HostComm`, :class:`SingleProcess`)."""

    @property
    def rank(self) -> int:
        """This process's index (the JAX process index)."""

    def allgather(self, obj: Any) -> list:
        """Every process's ``obj``, in process order, on every process."""

    def gather(self, obj: Any, root: int = 0) -> list | None:
        """Every process's ``obj`` on ``root`` (``None`` elsewhere)."""

    def broadcast(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every process."""

    def all_true(self, flag: Any) -> bool:
        """Logical AND of ``flag`` over the processes."""

    def barrier(self) -> None:
        """Return once every process got here."""

    def allgather_within(self, record: bytes, timeout: float) -> list[bytes] | None:
        """Every process's ``record`` (at most :data:`RECORD_BYTES`, zero-padded), or ``None``
        when not every process made this call within ``timeout`` s (a bounded collective)."""

    def sum_shared(self, grads: list, users: Sequence[Sequence[int]], homes: Sequence[int | None],
                   shared: Sequence[int], meshes: Sequence,
                   rows: Mapping[int, Mapping[int, tuple[int, int]]] | None = None) -> list:  # fmt: skip
        """Gradients of parameters used by several stages, summed over every process holding one.

        ``grads[i]`` is this process's gradient of parameter ``i`` on the mesh
        ``meshes[homes[i]]`` of its home stage; ``users[i]`` are the stages
        using it; ``shared`` the parameters used by more than one stage.
        ``rows[i]``, where given, maps each user stage to the rows of parameter ``i``
        (a stacked layer dim) it alone reads (:func:`~axonn_jax.runtime.pipeline.layer_rows.owned_rows`):
        every other stage's gradient is zero there, so each process receives those rows
        from their stage's process instead of whole gradients to add.
        """


class HostComm:
    """Host values between the processes of one MPI communicator (mpi4py).

    Example (under ``mpiexec -n 2``)::

        comm = HostComm.duplicate_world()
        comm.broadcast("hello", root=0)   # "hello" on both ranks
    """

    #: seconds :meth:`allgather_within` tests without sleeping before it sleeps between tests
    SPIN = 0.02
    #: longest sleep between two tests of :meth:`allgather_within` (bounds its added latency)
    NAP = 0.0005

    def __init__(self, comm: Any, bounded: Any = None):
        self.comm = comm  # an mpi4py communicator
        # the bounded collectives' own communicator: a call that one process gave up on stays
        # posted there (MPI cannot cancel it) and is matched by the others' next bounded call,
        # never by one of the blocking collectives on ``comm``
        self._bounded = bounded
        self._abandoned: list = []  # (request, buffers) given up on: kept alive for MPI

    @classmethod
    def duplicate_world(cls) -> HostComm:
        """A communicator of its own over every process (a ``Dup`` of ``COMM_WORLD``), and one
        more for :meth:`allgather_within` (``Dup`` is collective: made here, not on first use)."""
        from mpi4py import MPI

        return cls(MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup())

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    def allgather(self, obj: Any) -> list:
        return self.comm.allgather(obj)

    def gather(self, obj: Any, root: int = 0) -> list | None:
        return self.comm.gather(obj, root=root)

    def broadcast(self, obj: Any, root: int) -> Any:
        return self.comm.bcast(obj if self.rank == root else None, root=root)

    def all_true(self, flag: Any) -> bool:
        from mpi4py import MPI

        return bool(self.comm.allreduce(bool(np.asarray(flag)), op=MPI.LAND))

    def barrier(self) -> None:
        self.comm.Barrier()

    def allgather_within(self, record: bytes, timeout: float) -> list[bytes] | None:
        """A non-blocking ``Iallgather`` tested until it completes or ``timeout`` s pass: spins
        for :attr:`SPIN` s (yielding the CPU), then sleeps at most :attr:`NAP` s between tests.
        A call given up on stays posted (kept alive here) and completes with the others' next
        call: its callers compare the records, so they notice (:mod:`~axonn_jax.runtime.agreement`)."""
        if len(record) > RECORD_BYTES:
            raise ValueError(f"a bounded allgather record holds at most {RECORD_BYTES} bytes, got {len(record)}")
        if self._bounded is None:
            self._bounded = self.comm.Dup()  # only for a HostComm built around a communicator
        size = self._bounded.Get_size()
        send = np.zeros(RECORD_BYTES, np.uint8)
        send[: len(record)] = np.frombuffer(record, np.uint8)
        received = np.empty((size, RECORD_BYTES), np.uint8)
        request = self._bounded.Iallgather(send, received)
        now = start = time.perf_counter()
        nap = 0.00005
        while not request.Test():
            now = time.perf_counter()
            if now - start >= timeout:
                if request.Test():
                    break
                self._abandoned.append((request, send, received))
                return None
            if now - start < self.SPIN:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(2 * nap, self.NAP)
        return [bytes(row) for row in received]

    def sum_shared(self, grads, users, homes, shared, meshes, rows=None):
        """Each shard is exchanged with the processes holding the same mesh position in
        the other stages that use the parameter; partial sums are added in process
        order, so every copy receives bitwise the same gradient. A parameter with
        ``rows`` exchanges only the rows each process's stages read, each copied from
        its one owner (no sum)."""
        from mpi4py import MPI

        me, grads, rows = self.rank, list(grads), rows or {}
        for i in shared:
            g = grads[i]
            if g is None:
                continue
            home = meshes[homes[i]]
            flat_home = list(home.devices.flat)
            partials, requests, shards = [], [], []
            for shard in g.addressable_shards:
                pos = flat_home.index(shard.device)
                holders = {t: meshes[t].devices.flat[pos].process_index for t in users[i]}
                peers = sorted(set(holders.values()) - {me})
                mine = np.ascontiguousarray(np.asarray(shard.data))
                tag = (i * home.devices.size + pos) % 30000
                if i in rows:  # [(rows, buffer)] in the order both sides list them
                    owned = {q: sorted(rows[i][t] for t, h in holders.items() if h == q) for q in holders.values()}
                    received = {q: [(r, np.empty_like(mine[r[0]:r[1]])) for r in owned[q]] for q in peers}
                    sent = [np.ascontiguousarray(mine[a:b]) for a, b in owned.get(me, [])]
                else:
                    received = {q: [(None, np.empty_like(mine))] for q in peers}
                    sent = [mine]
                for q in peers:
                    requests.extend(self.comm.Isend(x, dest=q, tag=tag) for x in sent)
                    requests.extend(self.comm.Irecv(buf, source=q, tag=tag) for _, buf in received[q])
                partials.append((mine, received, sent))
                shards.append(shard)
            MPI.Request.Waitall(requests)
            summed = []
            for (mine, received, _), shard in zip(partials, shards):
                summed.append(jax.device_put(_combined(me, mine, received), shard.device))
            grads[i] = jax.make_array_from_single_device_arrays(g.shape, g.sharding, summed)
        return grads


#: the size of one process's record in :meth:`HostComm.allgather_within`
RECORD_BYTES = 1024


def _combined(me: int, mine: np.ndarray, received: dict) -> np.ndarray:
    """This process's shard with the peers' parts: rows copied in place, or whole partial
    gradients added in process order (the same order on every process)."""
    if all(r is not None for parts in received.values() for r, _ in parts):
        total = mine.copy()
        for parts in received.values():
            for (a, b), buf in parts:
                total[a:b] = buf
        return total
    parts = {q: buf for q, [(_, buf)] in received.items()}
    parts[me] = mine
    total = parts[min(parts)].copy()
    for q in sorted(parts)[1:]:
        total = total + parts[q]
    return total


def raise_together(host: HostCollectives, error: BaseException | None, what: str) -> None:
    """After work each process did on its own (``error``: how it failed here, or ``None``):
    raise on every process if it failed on any, instead of leaving the others waiting in the
    next collective for one that raised (and whose error a caller may catch). The failing
    process raises its own error, the others one naming it. A collective: every process calls it.

    >>> raise_together(SingleProcess(), None, "compiling")   # failed nowhere: returns
    """
    failures = host.allgather(None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    for rank, failure in enumerate(failures):
        if failure is not None:
            raise _elsewhere(rank, *failure, what)


def broadcast_or_raise(host: HostCollectives, compute, root: int, what: str) -> Any:
    """``compute()`` on process ``root``, its value on every process; if it raises, every
    process raises (``root`` its own error, the others one naming it). A collective.

    >>> broadcast_or_raise(SingleProcess(), lambda: 3, root=0, what="the loss")
    3
    """
    error = None
    if host.rank == root:
        try:
            payload = ("value", compute())
        except Exception as err:  # noqa: BLE001 - raised again below, on every process
            error, payload = err, ("error", type(err).__name__, str(err))
    else:
        payload = None
    payload = host.broadcast(payload, root=root)
    if payload[0] == "value":
        return payload[1]
    raise error if error is not None else _elsewhere(root, payload[1], payload[2], what)


def _elsewhere(rank: int, kind: str, message: str, what: str) -> Exception:
    """The error another process raised, as this one raises it (its kind where built in)."""
    cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
    return cls(f"{what} failed on process {rank} ({kind}): {message}")


class SingleProcess:
    """The host collectives of a one-process job: every value is already everywhere.

    >>> comm = SingleProcess()
    >>> comm.allgather(3), comm.broadcast(5, root=0), comm.all_true(np.bool_(False))
    ([3], 5, False)
    """

    rank = 0

    def allgather(self, obj: Any) -> list:
        return [obj]

    def gather(self, obj: Any, root: int = 0) -> list:
        return [obj]

    def broadcast(self, obj: Any, root: int) -> Any:
        return obj

    def all_true(self, flag: Any) -> bool:
        return bool(np.asarray(flag))

    def barrier(self) -> None:
        pass

    def allgather_within(self, record: bytes, timeout: float) -> list[bytes]:
        return [record]

    def sum_shared(self, grads, users, homes, shared, meshes, rows=None):
        return grads  # the local stages' gradients are already summed


_WORLD: HostComm | None = None


def world() -> HostComm | None:
    """A :class:`HostComm` over every process of the job, or ``None`` in a single process."""
    global _WORLD
    from axonn_jax.runtime.launch import mpi_world_size, process_info

    # process_info(), not jax.process_count(): that would start the backends before a
    # grid can choose their collectives (runtime/launch.py)
    if mpi_world_size() <= 1 or process_info().process_count <= 1:
        return None
    if _WORLD is None:
        _WORLD = HostComm.duplicate_world()
    return _WORLD


def host_comm() -> HostComm | SingleProcess:
    """The job's host collectives: :func:`world` under MPI, :class:`SingleProcess` otherwise.

    >>> host_comm().allgather("x")   # one process
    ['x']
    """
    comm = world()
    return SingleProcess() if comm is None else comm

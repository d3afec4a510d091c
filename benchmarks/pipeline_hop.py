"""One pipeline hop: MpiTransport vs raw mpi4py Send/Recv of the same bytes.

Launches itself under ``mpiexec -n 2`` (one CPU device per process) and
ping-pongs a float32 array of each size between the two processes:

* ``raw``: ``np.asarray`` of the device array (device → host), ``comm.Send``;
  the peer ``comm.Recv``s into a preallocated buffer and ``jax.device_put``s
  it (host → device, waited for), then sends it back the same way;
* ``transport``: :class:`~axonn_jax.runtime.pipeline.transport.MpiTransport`
  as the dispatch queue drives it: the receive is posted ahead
  (``expect``), the array is handed to ``send``, the receiver calls
  ``arrived`` and, until it returns the arrays, ``wait`` (the queue's
  wake-up), then waits until the arrays are ready; the pong goes back as
  message ``Message(TaskKind.BACKWARD, 0, i)``.

The two methods alternate within each round (which goes first alternates
too); the one-way time of a trip is half its round trip, and each size reports
the median over all trips and the ratio transport / raw of the medians.

    .venv/bin/python benchmarks/pipeline_hop.py [--sizes 4K,1M,16M] [--rounds 6] [--trips 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from mpi_launch import PREFIX, is_worker, relaunch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """Bytes of ``text`` such as ``"4K"``, ``"16M"`` or ``"512"``.

    >>> parse_size("4K"), parse_size("16M"), parse_size("512")
    (4096, 16777216, 512)
    """
    text = text.strip().upper()
    if text and text[-1] in UNITS:
        return int(text[:-1]) * UNITS[text[-1]]
    return int(text)


def label(nbytes: int) -> str:
    """``4096`` → ``"4 KiB"``.

    >>> label(4096), label(16 * 2**20), label(100)
    ('4 KiB', '16 MiB', '100 B')
    """
    for suffix, unit in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit} {suffix}"
    return f"{nbytes} B"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4K,1M,16M", help="message sizes in bytes (K, M suffixes)")
    p.add_argument("--rounds", type=int, default=6, help="rounds; each runs both methods")
    p.add_argument("--trips", type=int, default=20, help="round trips per method and round")
    p.add_argument("--out", default=None, help="write the markdown table here too")
    return p.parse_args(argv)


# --------------------------------------------------------------------- worker side


def _raw_trips(comm, x, buffer, sharding, peer: int, first: bool, trips: int) -> tuple[list[float], object]:
    """Round trips of raw mpi4py (rank 0 pings first): one-way times, the last array."""
    import jax
    import numpy as np

    times = []
    for _ in range(trips):
        start = time.perf_counter()
        if first:
            comm.Send(np.asarray(x), dest=peer, tag=7)
        comm.Recv(buffer, source=peer, tag=7)
        x = jax.device_put(buffer, sharding)
        x.block_until_ready()
        if not first:
            comm.Send(np.asarray(x), dest=peer, tag=7)
        times.append((time.perf_counter() - start) / 2)
    return times, x


def _receive(transport, key, wake: threading.Event):
    """The arrays of message ``key``, ready, polled the way the dispatch queue polls."""
    from axonn_jax.runtime.pipeline import dispatch

    while (arrays := transport.arrived(key)) is None:
        transport.wait(wake, dispatch.IDLE_WAIT)
    while not all(a.is_ready() for a in arrays):
        transport.wait(wake, dispatch.IDLE_WAIT)
    return arrays


def _transport_trips(transport, x, stages, first: bool, trips: int,
                     start_mb: int) -> tuple[list[float], object]:  # fmt: skip
    """Round trips through ``transport`` (F(1, mb) from rank 0, B(0, mb) back): one-way
    times, the last array. ``stages[s]``: (mesh, sharding, aval) of stage ``s``."""
    from axonn_jax.runtime.pipeline.tasks import Message, TaskKind

    wake = threading.Event()  # never set: nothing else to wake this loop
    (mesh0, sharding0, aval0), (mesh1, sharding1, aval1) = stages
    times = []
    for mb in range(start_mb, start_mb + trips):
        start = time.perf_counter()
        if first:
            transport.expect(Message(TaskKind.BACKWARD, 0, mb), [aval0], mesh1)
            transport.send(Message(TaskKind.FORWARD, 1, mb), [x], [sharding1])
            (x,) = _receive(transport, Message(TaskKind.BACKWARD, 0, mb), wake)
        else:
            (x,) = _receive(transport, Message(TaskKind.FORWARD, 1, mb), wake)
            if mb + 1 < start_mb + trips:  # the next one, ahead
                transport.expect(Message(TaskKind.FORWARD, 1, mb + 1), [aval1], mesh0)
            transport.send(Message(TaskKind.BACKWARD, 0, mb), [x], [sharding0])
        times.append((time.perf_counter() - start) / 2)
    return times, x


def worker(args) -> None:
    """Runs on both ranks under mpiexec; rank 0 prints JSON results."""
    import axonn_jax

    info = axonn_jax.init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from mpi4py import MPI

    from axonn_jax.runtime.pipeline.tasks import Message, TaskKind
    from axonn_jax.runtime.pipeline.transport import MpiTransport

    if info.process_count != 2 or len(jax.local_devices()) != 1:
        raise SystemExit("pipeline_hop runs on 2 processes with one device each")
    me, peer = info.process_index, 1 - info.process_index
    meshes = [Mesh(np.array([d]), ("x",)) for d in sorted(jax.devices(), key=lambda d: d.process_index)]
    stage_sharding = [NamedSharding(m, PartitionSpec()) for m in meshes]
    transport = MpiTransport(meshes)
    raw_comm = MPI.COMM_WORLD.Dup()
    first = me == 0
    results = []
    mb = 0
    for nbytes in map(parse_size, args.sizes.split(",")):
        n = nbytes // 4
        x = jax.device_put(np.arange(n, dtype=np.float32), stage_sharding[me])
        buffer = np.empty(n, np.float32)
        stages = [(m, s, jax.ShapeDtypeStruct((n,), np.float32, sharding=s))
                  for m, s in zip(meshes, stage_sharding)]  # fmt: skip

        def post_first():  # stage 1's first receive is posted before rank 0 may send
            if not first:
                transport.expect(Message(TaskKind.FORWARD, 1, mb), [stages[1][2]], meshes[0])

        post_first()
        raw_comm.Barrier()
        # warm-up, and a check that the bytes arrive intact both ways
        _, y = _raw_trips(raw_comm, x, buffer, stage_sharding[me], peer, first, 2)
        _, z = _transport_trips(transport, x, stages, first, 2, mb)
        mb += 2
        if not (np.array_equal(np.asarray(y), np.asarray(x)) and np.array_equal(np.asarray(z), np.asarray(x))):
            raise SystemExit(f"rank {me}: {label(nbytes)} arrived altered")
        samples = {"raw": [], "transport": []}
        for r in range(args.rounds):
            order = ("raw", "transport") if r % 2 == 0 else ("transport", "raw")
            for method in order:
                if method == "transport":
                    post_first()
                raw_comm.Barrier()
                if method == "raw":
                    times, _ = _raw_trips(raw_comm, x, buffer, stage_sharding[me], peer, first, args.trips)
                else:
                    times, _ = _transport_trips(transport, x, stages, first, args.trips, mb)
                    mb += args.trips
                samples[method] += times
        raw_comm.Barrier()
        if first:
            raw_s = statistics.median(samples["raw"])
            transport_s = statistics.median(samples["transport"])
            results.append({"bytes": nbytes, "raw_s": raw_s, "transport_s": transport_s,
                            "ratio": transport_s / raw_s, "trips": len(samples["raw"])})  # fmt: skip
    transport.close()
    raw_comm.Barrier()
    if first:
        print(PREFIX + json.dumps(results), flush=True)


# --------------------------------------------------------------------- launcher side


def table(result: dict) -> str:
    """The markdown table of a :func:`main` result."""
    lines = ["| bytes | transport / raw | transport (one way) | raw mpi4py (one way) | trips |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in result["results"]:
        lines.append(f"| {label(r['bytes'])} | **{r['ratio']:.2f}** | {r['transport_s'] * 1e3:.3f} ms "
                     f"| {r['raw_s'] * 1e3:.3f} ms | {r['trips']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if is_worker("AXONN_HOP_WORKER"):
        worker(args)
        return {}
    given = argv if argv is not None else sys.argv[1:]
    results = relaunch(__file__, 2, given, "AXONN_HOP_WORKER", timeout=1200)
    result = {"results": results, "load": os.getloadavg()}
    result["table"] = table(result)
    print(result["table"])
    print(f"load average at the end: {result['load'][0]:.2f}")
    if args.out:
        Path(args.out).write_text(result["table"] + "\n")
    return result


if __name__ == "__main__":
    main()

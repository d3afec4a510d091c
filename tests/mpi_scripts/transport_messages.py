"""Under mpiexec -n 2 (2 devices each): MpiTransport delivers every message intact.

Stage 0 lives on process 0's two devices, stage 1 on process 1's (meshes of
shape (2,), axis "x"). Process 0 sends forward messages F(1, 0..M-1); each
holds a float32 array sharded over "x", a bfloat16 array replicated, and a
typed PRNG key array. Some messages are still being computed when handed
over (a slow jitted program: they go through the sender thread, and the ready
ones sent after them wait their turn), the others are ready (posted at once).
Process 1 posts every receive ahead and polls the microbatches in reverse
order (the last completes only after the earlier ones), then sends each back
as B(0, mb) in microbatch order (a link's order, as the dispatch queue sends);
process 0 checks what comes back. All six messages of a direction are in
flight at once. Prints "OK transport <rank>" on success.
"""

import threading

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from axonn_jax.runtime.collectives import host_comm  # noqa: E402
from axonn_jax.runtime.pipeline.transport import MpiTransport  # noqa: E402
from axonn_jax.runtime.pipeline.tasks import Message, TaskKind  # noqa: E402

M = 6
me = info.process_index
by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
meshes = [Mesh(np.array(by_process[2 * s:2 * s + 2]), ("x",)) for s in range(2)]
split = [NamedSharding(m, P("x")) for m in meshes]
whole = [NamedSharding(m, P()) for m in meshes]
transport = MpiTransport(meshes)


def expected(mb: int) -> list[np.ndarray]:
    return [np.arange(64 * 8, dtype=np.float32).reshape(64, 8) + mb,
            (np.arange(16, dtype=np.float32) * (mb + 1)).astype(jnp.bfloat16),
            np.asarray(jax.random.key_data(jax.random.key(mb)))]  # fmt: skip


def avals(stage: int) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=split[stage]),
            jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=whole[stage]),
            jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=whole[stage])]  # fmt: skip


@jax.jit
def slow(x):
    """A few hundred milliseconds of work whose result is x."""
    y = jax.lax.fori_loop(0, 60, lambda i, y: 0.5 * jnp.tanh(y @ y), jnp.ones((256, 256)))
    return x + 0.0 * y[0, 0]


def message(mb: int, stage: int) -> list[jax.Array]:
    data, half, _ = expected(mb)
    arrays = [jax.device_put(data, split[stage]), jax.device_put(half, whole[stage]),
              jax.device_put(jax.random.key(mb), whole[stage])]  # fmt: skip
    if mb % 3 == 2:  # still computing when handed over: it and those behind it wait their turn
        arrays[0] = slow(arrays[0])
    else:
        jax.block_until_ready(arrays)
    return arrays


def check(arrays, mb: int, stage: int) -> None:
    data, half, key_bits = expected(mb)
    assert arrays[0].sharding == split[stage], arrays[0].sharding
    np.testing.assert_array_equal(np.asarray(arrays[0]), data)
    assert arrays[1].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(arrays[1]).astype(np.float32), half.astype(np.float32))
    assert jax.dtypes.issubdtype(arrays[2].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(arrays[2])), key_bits)


def receive(key):
    wake = threading.Event()
    for _ in range(200000):
        arrays = transport.arrived(key)
        if arrays is not None:
            return arrays
        transport.wait(wake, 0.0002)
    raise TimeoutError(f"rank {me}: {key} never arrived")


if me == 0:
    for mb in range(M):
        transport.expect(Message(TaskKind.BACKWARD, 0, mb), avals(0), meshes[1])
    for mb in range(M):
        transport.send(Message(TaskKind.FORWARD, 1, mb), message(mb, 0), [split[1], whole[1], whole[1]])
    for mb in range(M):
        check(receive(Message(TaskKind.BACKWARD, 0, mb)), mb, 0)
else:
    for mb in range(M):
        transport.expect(Message(TaskKind.FORWARD, 1, mb), avals(1), meshes[0])
    got = {}
    for mb in reversed(range(M)):  # the last one completes only after the earlier ones
        got[mb] = receive(Message(TaskKind.FORWARD, 1, mb))
        check(got[mb], mb, 1)
    for mb in range(M):  # a link's messages go in microbatch order, as the queue sends them
        transport.send(Message(TaskKind.BACKWARD, 0, mb), got[mb], [split[0], whole[0], whole[0]])
transport.close()
assert not transport._outgoing and not transport._queued and not transport._pending
host_comm().barrier()
print(f"OK transport {me}", flush=True)

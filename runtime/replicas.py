"""Data-parallel replicas must stay identical: an exact checksum of every shard, compared.

Every copy of a parameter shard (the data-parallel replicas, and any other axis
that replicates it) must hold the same bits after every step. A rank that was fed
other data, ran another optimizer or hit a silent fault makes its copy drift;
training then goes on with diverged replicas. :func:`check_replicas` sums each
addressable shard's bits as unsigned integers on its device (exact and independent
of the reduction order, so equal bits give equal sums), gathers the sums of every
process in one allgather, and raises ``ValueError`` on every rank when two copies
of a shard differ, naming the parameter, the shard, the ranks and the checksums.

Example::

    params, opt_state, loss = step(params, opt_state, batch)
    if step_number % 50 == 0:
        check_replicas(params, step=step_number)
    # ValueError: data-parallel replicas differ after step 50: 'dense/kernel' shard
    # [0:16, 0:8] is 0x3a2f… on rank 0 (cpu:0) but 0x3a30… on rank 1 (cpu:0); ...
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from axonn_jax.partitioner.trace import path_string
from axonn_jax.runtime.consistency import Comm
from axonn_jax.runtime.collectives import world

#: differing shards listed in the error before "and N more"
MAX_LISTED = 3
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


@jax.jit
def _bit_sum(x: jax.Array) -> jax.Array:
    """The shard's bits summed as uint32 (wrapping): exact, whatever the summation order."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = np.dtype(x.dtype).itemsize
    bits = lax.bitcast_convert_type(x, _UINT[width])  # 8-byte values: two uint32 words
    return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)


def shard_checksums(tree: Any) -> dict[tuple[str, str], list[tuple[str, int]]]:
    """``(path, shard index) → [(device, checksum), ...]`` for this process's shards.

    ``None`` leaves (other pipeline stages) and non-arrays are skipped. The sums are
    launched for every shard first and read back once.
    """
    pending = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            bounds = [s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape)]
            index = ", ".join(f"{start}:{stop}" for start, stop in bounds)
            pending.append(((path_string(key_path), f"[{index}]"), str(shard.device), _bit_sum(shard.data)))
    out: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for key, device, total in pending:
        out.setdefault(key, []).append((device, int(total)))
    return out


def check_replicas(tree: Any, *, step: int | None = None, comm: Comm | None = None) -> None:
    """Raise ``ValueError`` on every rank if two copies of any shard of ``tree`` differ.

    ``tree``: the device parameters (or any pytree of ``jax.Array``; a pipeline's
    ``None`` leaves are skipped). Collective under MPI (every rank calls it, one
    allgather of the checksums); in one process it compares the local copies.
    Cost: one bit-sum per shard on its device (a read of the parameters, no copy).

    Example:
        >>> check_replicas(params, step=100)  # doctest: +SKIP
    """
    comm = comm if comm is not None else world()
    mine = shard_checksums(tree)
    every = [mine] if comm is None else comm.allgather(mine)
    copies: dict[tuple[str, str], list[tuple[int, str, int]]] = {}
    for rank, sums in enumerate(every):
        for key, found in sums.items():
            copies.setdefault(key, []).extend((rank, device, total) for device, total in found)
    differing = []
    for (path, index), found in copies.items():
        first = found[0]
        other = next((c for c in found if c[2] != first[2]), None)
        if other is not None:
            differing.append(f"'{path}' shard {index} is {first[2]:#010x} on rank {first[0]} "
                             f"({first[1]}) but {other[2]:#010x} on rank {other[0]} ({other[1]})")  # fmt: skip
    if not differing:
        return
    listed = differing[:MAX_LISTED] + ([f"and {len(differing) - MAX_LISTED} more"]
                                       if differing[MAX_LISTED:] else [])  # fmt: skip
    when = f" after step {step}" if step is not None else ""
    raise ValueError(
        f"data-parallel replicas differ{when}: " + "; ".join(listed) + ". Every copy of a "
        "shard must hold the same values; a rank that was given other data, another optimizer "
        "or hit a fault has drifted. Remedy: build the data loader and optimizer from the same "
        "arguments on every rank, and resume from the last checkpoint saved before the drift."
    )

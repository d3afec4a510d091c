"""Checkpoint faults, one per run: python checkpoint_fault.py MODE DIRECTORY.

Modes: "no-close" (the script ends with a save pending), "disk-full" (the
second save's writes fail), "full-then-ok" (a failed save, then a good one),
"donated" (saving arrays a jitted step donated), "read-only" (the directory
becomes read-only after step 1: its mode bits, and since they do not bind
root, every directory created under it fails as on a read-only mount). Each saves step 1 first and
prints "end of script" when it reaches its end; the test checks the exit
status, the messages and what restores afterwards.
"""

import errno
import sys

import jax
import jax.numpy as jnp

from axonn_jax.checkpoint import Checkpointer, CheckpointError
from axonn_jax.runtime.checkpoint import shard_store

mode, directory = sys.argv[1], sys.argv[2]
ckpt = Checkpointer(directory)
ckpt.save(1, {"w": jnp.full((64, 64), 1.0)})
ckpt.wait()
write = shard_store.write


async def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


if mode == "no-close":
    ckpt.save(2, {"w": jnp.full((64, 64), 2.0)})  # never waited for, never closed
elif mode in ("disk-full", "full-then-ok"):
    shard_store.write = disk_full
    ckpt.save(2, {"w": jnp.full((64, 64), 2.0)})
    try:
        ckpt.wait()
    except CheckpointError as err:
        print(f"caught: {err}", flush=True)
    if mode == "full-then-ok":
        shard_store.write = write
        ckpt.save(3, {"w": jnp.full((64, 64), 3.0)})
        ckpt.close()
elif mode == "donated":
    params = {"w": jnp.full((64, 64), 2.0)}
    jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(params)
    try:
        ckpt.save(2, params)
    except ValueError as err:
        print(f"caught: {err}", flush=True)
elif mode == "read-only":
    import os
    from pathlib import Path

    os.chmod(directory, 0o555)
    inside, mkdir = str(Path(directory).resolve()), os.mkdir

    def read_only_mkdir(path, *args, **kwargs):
        if str(Path(path).resolve()).startswith(inside):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return mkdir(path, *args, **kwargs)

    os.mkdir = read_only_mkdir
    try:
        ckpt.save(2, {"w": jnp.full((64, 64), 2.0)})
        ckpt.wait()
    except CheckpointError as err:
        print(f"caught: {err}", flush=True)
    finally:
        os.chmod(directory, 0o755)
else:
    raise SystemExit(f"unknown mode {mode}")
print("end of script", flush=True)

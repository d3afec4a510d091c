"""Save step 1, then start step 2 and stall once its first array is written.

Usage: python interrupted_save.py DIRECTORY MARKER. The test kills this process
(SIGKILL) as soon as MARKER appears, i.e. in the middle of writing step 2.
"""

import asyncio
import sys
from pathlib import Path

import jax
from checkpoint_cases import place, shardings, values

from axonn_jax.checkpoint import Checkpointer
from axonn_jax.runtime.checkpoint import shard_store

directory, marker = sys.argv[1], Path(sys.argv[2])
layout = shardings(jax.devices())
ckpt = Checkpointer(directory)
ckpt.save(1, place(values(1), layout))
ckpt.wait()

original = shard_store.write


async def stall_after_first_array(leaf, where, context):
    await original(leaf, where, context)
    marker.write_text(str(where))
    await asyncio.sleep(3600)


shard_store.write = stall_after_first_array
ckpt.save(2, place(values(2), layout))
ckpt.wait()  # never returns: the test kills us

"""A script whose last line saves through a Checkpointer it never keeps.

python dropped_checkpointer.py DIRECTORY: the object is dropped as soon as
``save`` returns, with step 7 still being written in the background; the step
must be committed all the same (exit 0, no traceback).
"""

import sys

import jax.numpy as jnp

from axonn_jax.checkpoint import Checkpointer

Checkpointer(sys.argv[1]).save(7, {"w": jnp.full((64, 64), 7.0)})

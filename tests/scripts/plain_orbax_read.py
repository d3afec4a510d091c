"""Read a checkpoint step with plain orbax only, as a user without axonn_jax would.

Usage: python plain_orbax_read.py STEP_DIR OUT.npz. Restores every item of the
step that orbax's StandardCheckpointer can read (params, opt_state, rng) with no
target, and writes the leaves to OUT.npz under "item/key/key/..." names. Fails
if anything imported axonn_jax.
"""

import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

step_dir, out = Path(sys.argv[1]), sys.argv[2]
leaves = {}
for item in ("params", "opt_state", "rng"):
    if not (step_dir / item).is_dir():
        continue
    tree = ocp.StandardCheckpointer().restore(step_dir / item)
    for keys, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaves[f"{item}/{jax.tree_util.keystr(keys, simple=True, separator='/')}"] = np.asarray(value)
assert "axonn_jax" not in sys.modules, "the plain reader imported axonn_jax"
# .npz has no bfloat16: such leaves travel as their bits, with every leaf's dtype beside them
dtypes = np.array([f"{name}={value.dtype.name}" for name, value in leaves.items()])
leaves = {name: value.view(np.uint16) if value.dtype.name == "bfloat16" else value
          for name, value in leaves.items()}
np.savez(out, __dtypes__=dtypes, **leaves)
print(f"read {len(leaves)} leaves")

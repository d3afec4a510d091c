"""Small deterministic pytrees for checkpoint tests (shared with tests/scripts/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def values(step: int) -> dict:
    """Host values that differ per step."""
    return {
        "w": (np.arange(64, dtype=np.float32).reshape(8, 8) + 0.25) * step,
        "b": {"v": np.arange(8, dtype=np.float32) - step},
        "n": np.int32(step),
    }


def shardings(devices, axes=("z", "y", "x"), shape=(2, 2, 2)) -> dict:
    """A layout for :func:`values` on a mesh of ``devices``."""
    mesh = Mesh(np.asarray(devices).reshape(shape), axes)
    return {
        "w": NamedSharding(mesh, P(axes[:2], axes[2])),
        "b": {"v": NamedSharding(mesh, P(axes[2]))},
        "n": NamedSharding(mesh, P()),
    }


def place(host: dict, layout: dict) -> dict:
    return jax.tree.map(lambda v, s: jax.device_put(np.asarray(v), s), host, layout)


def read_with_plain_orbax(step_dir, tmp_path) -> dict:
    """``{"item/path": np.ndarray}`` of a step as plain orbax reads it, in a process
    that never imports axonn_jax (``tests/scripts/plain_orbax_read.py``)."""
    script = Path(__file__).resolve().parent / "scripts" / "plain_orbax_read.py"
    out = Path(tmp_path) / "plain.npz"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    result = subprocess.run([sys.executable, str(script), str(step_dir), str(out)], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    with np.load(out, allow_pickle=False) as saved:
        dtypes = dict(entry.split("=") for entry in saved["__dtypes__"].tolist())
        return {name: saved[name].view(jnp.dtype(dtypes[name])) for name in dtypes}


def host_leaves(item: str, tree) -> dict:
    """``{"item/path": np.ndarray}`` of a pytree (``None`` leaves skipped), paths as checkpoints name them."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {f"{item}/{'/'.join(_name(k) for k in keys)}": _host(v) for keys, v in flat if v is not None}


def _host(value) -> np.ndarray:
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)  # stored as its key data
    return np.asarray(jax.device_get(value))


def _name(key) -> str:
    for field in ("key", "name", "idx"):
        if hasattr(key, field):
            return str(getattr(key, field))
    raise TypeError(key)

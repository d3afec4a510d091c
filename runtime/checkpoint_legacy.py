"""Reads checkpoints written by axonn_jax before the orbax-standard layout (read only).

Those steps hold one item ``arrays``: an ``index.json`` (``{"format":
"axonn_jax.sharded_tree/1", "leaves": [{"path": "params/dense/kernel", "dir":
"leaf_00000"}, ...]}``) and one Zarr v3 array per leaf, with paths of all items
(``params/``, ``opt_state/``, ``rng``) in one tree. :class:`axonn_jax.checkpoint.Checkpointer`
restores them as before (the files are read directly, without orbax's manager); new saves
use :mod:`~axonn_jax.runtime.checkpoint_handler`.

Example::

    metas = leaf_metadata(step_dir / ITEM)                 # {path: LeafMeta or None}
    values = read(step_dir / ITEM, {"params/w": sharding})  # {path: jax.Array}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from axonn_jax.runtime.checkpoint_handler import read_leaves, read_metas
from axonn_jax.runtime.shard_store import DamagedArrayError, LeafMeta

ITEM = "arrays"
FORMAT = "axonn_jax.sharded_tree/1"
INDEX = "index.json"


def leaf_metadata(root: Path) -> dict[str, LeafMeta | None]:
    """``{full path: LeafMeta}`` of every saved leaf, ``None`` if saved empty (JSON only)."""
    return read_metas(root, read_index(root))


def read(root: Path, targets: Mapping[str, jax.sharding.Sharding | None]) -> dict[str, Any]:
    """``{full path: value}`` of the leaves in ``targets``, placed on their shardings."""
    return read_leaves(root, read_index(root), targets)


def read_index(root: Path) -> dict[str, str | None]:
    """``{full path: leaf directory}`` (``None``: saved empty) from ``index.json``."""
    file = root / INDEX
    try:
        doc = json.loads(file.read_text())
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
        return {leaf["path"]: _safe_name(leaf["dir"]) for leaf in doc["leaves"]}
    except FileNotFoundError:
        raise DamagedArrayError(f"{file} is missing") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise DamagedArrayError(f"{file} is not a valid index ({err})") from None


def _safe_name(name: str | None) -> str | None:
    """Leaf directories are ``leaf_NNNNN``; anything else (e.g. ``../x``) is rejected."""
    if name is not None and not (isinstance(name, str) and name.startswith("leaf_") and name[5:].isdigit()):
        raise ValueError(f"bad leaf directory name {name!r}")
    return name

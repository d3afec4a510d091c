"""Old module paths that keep working, with a ``DeprecationWarning``, after a move.

Example (``axonn_jax/precision.py``)::

    from axonn_jax._moved import forward

    __getattr__ = forward(__name__, "axonn_jax.runtime.precision")
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forward(old: str, new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that warns once per name and returns ``new``'s attribute."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(
            f"{old} moved to {new} (axonn_jax 0.2); import {name} from {new} instead. "
            f"The old path will be removed in axonn_jax 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    return __getattr__

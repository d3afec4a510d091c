"""Repeated blocks of a model, read from its parameter paths. Pure.

A parameter inside a repeated block has a numbered path component
(``block_3``, ``layers_0``, ``blocks/3``, also linen's ``Dense_1``). The path
up to and including the first such component names the block it belongs to;
the runtime gathers a whole block's depth-split weights in one all-gather
(``runtime/executor.py: gather_points``).

Example:
    >>> block_of("params/block_3/attn/qkv/kernel")
    'params/block_3'
    >>> block_of("params/blocks/2/mlp/kernel")
    'params/blocks/2'
    >>> block_of("params/head/kernel") is None
    True
"""

from __future__ import annotations

import re

#: a numbered path component: ``block_3``, ``Dense_0``, ``3``
NUMBERED = re.compile(r"^(.*?)_?(\d+)$")


def block_of(path: str) -> str | None:
    """The path of the first numbered component above ``path``'s leaf, or None (no block)."""
    parts = path.split("/")
    for depth, part in enumerate(parts[:-1]):
        if NUMBERED.match(part):
            return "/".join(parts[: depth + 1])
    return None

"""Repeated blocks of a model, read from its parameter paths. Pure.

A parameter inside a repeated block has a numbered path component
(``block_3``, ``layers_0``, ``blocks/3``, also linen's ``Dense_1``). The path
up to and including the first such component names the block it belongs to;
the runtime gathers a whole block's depth-split weights in one all-gather
(``runtime/executor.py: gather_points``), and by default reduce-scatters the
weight gradients of ``BUCKET_BLOCKS`` consecutive blocks in one call
(:func:`bucket_runs`, ``runtime/grad_buckets.py``).

Example:
    >>> block_of("params/block_3/attn/qkv/kernel")
    'params/block_3'
    >>> block_of("params/blocks/2/mlp/kernel")
    'params/blocks/2'
    >>> block_of("params/head/kernel") is None
    True
    >>> bucket_runs([None, "block_0", "block_1", "block_2", None], 2)
    [[0], [1, 2], [3], [4]]
"""

from __future__ import annotations

import re

#: default blocks per weight-gradient reduce-scatter (``Overlap.bucket_blocks``)
BUCKET_BLOCKS = 4

#: a numbered path component: ``block_3``, ``Dense_0``, ``3``
NUMBERED = re.compile(r"^(.*?)_?(\d+)$")


def block_of(path: str) -> str | None:
    """The path of the first numbered component above ``path``'s leaf, or None (no block)."""
    parts = path.split("/")
    for depth, part in enumerate(parts[:-1]):
        if NUMBERED.match(part):
            return "/".join(parts[: depth + 1])
    return None


def bucket_runs(group_blocks: list[str | None], size: int) -> list[list[int]]:
    """Gather groups whose weight gradients share one reduce-scatter: runs of ``size``
    consecutive groups in a block (``group_blocks[g]`` not None), one run per group
    outside blocks or alone."""
    runs: list[list[int]] = []
    for g, block in enumerate(group_blocks):
        if block is None or not runs or group_blocks[runs[-1][0]] is None or len(runs[-1]) >= size:
            runs.append([g])
        else:
            runs[-1].append(g)
    return runs

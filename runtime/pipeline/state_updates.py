"""Model state updated by pipeline stages, delivered to where the variables are held.

A stage returns the new value of the state it computes (``StageFlow.updates``:
BatchNorm statistics, an nnx RNG stream's key and counter), summed over the
microbatches. The variable itself is held by the processes of the stages that
read it (``ParamHomes``), which need not be the stage that computed the update
(an nnx Dropout's key is read on one stage and returned from the next). Here
each update becomes the mean over microbatches and lands on every holder: on
the same process it moves to the variable's sharding; to another process it
travels as a host value (state is small) through the host collectives' allgather.

Example:
    >>> updated = deliver_updates(placed, programs, {0: [mean_sum]}, leaves, m)  # doctest: +SKIP
    >>> updated[7]  # leaf 7's new value on this process (None: not held or not updated)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from axonn_jax.runtime.pipeline.stage_program import StageProgram
from axonn_jax.runtime.placement import PlacedModel
from axonn_jax.runtime.sharded import place, replicate


def deliver_updates(placed: PlacedModel, programs: Sequence[StageProgram],
                    summed: dict[int, list], leaves: Sequence, m: int) -> list:  # fmt: skip
    """Per variable leaf: its updated value (mean of ``m`` microbatches) on this process, or ``None``.

    Args:
        summed: local stage → its state updates summed over microbatches
            (``programs[s].flow.updates`` order).
        leaves: the variable leaves as held here (``None`` where another process holds one).
    """
    updated: list = [None] * len(leaves)
    crossing = _crossing(placed, programs)
    outgoing: dict[int, np.ndarray] = {}
    for s, values in summed.items():
        for (_, i), total in zip(programs[s].flow.updates, values):
            value = microbatch_mean(total, m)
            if leaves[i] is not None:
                sharding = leaves[i].sharding
                updated[i] = value if value.sharding == sharding else jax.device_put(value, sharding)
            if (s, i) in crossing:
                outgoing[i] = _host(value)
    if crossing:  # the same on every process: all of them take part in the allgather
        for received in placed.host.allgather(outgoing):
            for i, value in received.items():
                if leaves[i] is not None and updated[i] is None:
                    updated[i] = place(value, leaves[i].sharding)
    return updated


def microbatch_mean(total: jax.Array, m: int) -> jax.Array:
    """A state update summed over ``m`` microbatches → their mean (integers: exact when equal)."""
    if jax.numpy.issubdtype(total.dtype, jax.numpy.floating):
        return total / m
    return total // m


def _crossing(placed: PlacedModel, programs: Sequence[StageProgram]) -> set[tuple[int, int]]:
    """``(stage, leaf)`` of the updates some holder of the leaf gets from another process.

    Holders are the processes of the stages that read the variable (stage 0
    when none does); it depends on the plan only, so every process agrees.
    """
    def processes(s):
        return {d.process_index for d in placed.meshes[s].devices.flat}

    crossing = set()
    for prog in programs:
        for _, i in prog.flow.updates:
            holders = set().union(*(processes(t) for t in placed.homes.users[i] or (0,)))
            if holders - processes(prog.flow.index):
                crossing.add((prog.flow.index, i))
    return crossing


def _host(value: jax.Array) -> np.ndarray:
    """The whole value on this host (replicated over its stage mesh first if it spans processes)."""
    if not value.is_fully_addressable:
        (value,) = replicate([value], value.sharding.mesh)
        return np.asarray(value.addressable_data(0))
    return np.asarray(value)

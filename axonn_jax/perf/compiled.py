"""The step time a compiled program implies: XLA's analysis of it, priced with a profile. Pure.

The analytical model (:mod:`~axonn_jax.perf.step`) prices a configuration
from its spec, before anything is compiled. Once a configuration has been
compiled (the planner's ahead-of-time check, :mod:`axonn_jax.compiled_check`),
the program itself says what one device does in a step: the FLOPs and the
bytes its kernels read and write (XLA's ``cost_analysis()``), and every
collective it issues (read from its HLO). Priced with the same machine
profile, without overlap::

    step = flops / (peak × efficiency) + bytes accessed / memory_gbps
           + Σ over collectives (latency + ring wire bytes / β)

with each collective's latency and β looked up by its group's shape (eq. 7:
``size`` devices nested inside groups of ``inner``). It sees what the spec
does not: every elementwise kernel and layout copy of the program, the
collectives XLA added or combined, the optimizer's real passes. It does not
see kernel efficiency by shape, overlap, or (on simulated CPU devices) the
per-kernel overhead that makes both estimates about half the measured time
(``benchmarks/grid_prediction.py``).

Example:
    >>> from axonn_jax.perf.machines import get
    >>> cost = ProgramCost(flops=2e12, bytes_accessed=1e9,
    ...                    collectives=(ProgramCollective("all-reduce", size=4, inner=1, wire_bytes=3e8),))
    >>> t = cost.time(get("perlmutter"))
    >>> round(t.compute * 1e3, 2), round(t.memory * 1e3, 2), round(t.comm * 1e3, 2)
    (12.82, 0.8, 1.33)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from axonn_jax.perf.machines import Machine


@dataclasses.dataclass(frozen=True)
class ProgramCollective:
    """One collective of a compiled program: its kind, group ``size``, the product of the
    mesh axes nested inside its group (``inner``, eq. 7) and the ring wire bytes one
    device sends."""

    kind: str
    size: int
    inner: int
    wire_bytes: float


@dataclasses.dataclass(frozen=True)
class ProgramTime:
    """Seconds of one step by term (see the module docstring)."""

    compute: float
    memory: float
    comm: float

    @property
    def total(self) -> float:
        return self.compute + self.memory + self.comm


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """What one device of a compiled step program does, as XLA reports it."""

    flops: float
    bytes_accessed: float
    collectives: tuple[ProgramCollective, ...] = ()

    def time(self, machine: Machine) -> ProgramTime:
        """This program's step seconds on ``machine`` (module docstring)."""
        comm = sum(machine.seconds(c.wire_bytes, 1, c.inner, c.size) for c in self.collectives)
        return ProgramTime(compute=self.flops / machine.flops_per_second,
                           memory=self.bytes_accessed / (machine.memory_gbps * 1e9), comm=comm)  # fmt: skip


def nesting(group: Sequence[int]) -> int:
    """``inner`` of a collective's device group: the stride between its devices in the
    mesh's device order (x fastest, then y, z, data), i.e. the product of the axes nested
    inside it.

    >>> nesting((0, 1, 2, 3)), nesting((1, 3, 5, 7)), nesting((4,))
    (1, 2, 1)
    """
    ids = sorted(group)
    return ids[1] - ids[0] if len(ids) > 1 else 1

"""Communication and memory reports of a planned model: pure data and formatting.

A :class:`CommReport` lists every collective one training step (forward and
backward of the model) runs on one device, as :class:`Transfer` records; it
groups them by ``(kind, mesh axes)`` and prices them with ring algorithms. A
:class:`MemoryReport` holds the bytes one device keeps, by kind. Both are
plain values: the runtime fills them in (:mod:`axonn_jax.runtime.step_report`),
the parameter, gradient and optimizer bytes come straight from a
:class:`~axonn_jax.Plan` (:meth:`MemoryReport.from_plan`).

Kinds are XLA's HLO names, so a report can be compared with a compiled
program (:mod:`axonn_jax.runtime.hlo`).

Example:
    >>> t = Transfer("all-gather", ("z",), 2, "float32", (16, 8), (32, 8), "forward")
    >>> t.result_bytes, t.wire_bytes
    (1024, 512.0)
    >>> print(CommReport((t,)))                              # doctest: +NORMALIZE_WHITESPACE
    communication per device and step: 1 collectives, 1,024 B moved through them, 512 B on the wire (ring)
    collective  axes  group  count  forward B  backward B  wire B
    ----------  ----  -----  -----  ---------  ----------  ------
    all-gather  z         2      1      1,024           0     512
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
PHASES = ("forward", "backward")


def ring_wire_bytes(kind: str, group_size: int, result_bytes: float) -> float:
    """Bytes one device sends for one collective with ring algorithms.

    ``result_bytes`` is the size of the collective's result on one device (R):
    all-gather (g-1)/g·R, reduce-scatter (g-1)·R (R is the shard), all-reduce
    2(g-1)/g·R, all-to-all (g-1)/g·R, collective-permute R.

    Example:
        >>> ring_wire_bytes("all-reduce", 4, 1000)
        1500.0
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; kinds are {KINDS}")
    g = group_size
    if kind == "collective-permute":
        return float(result_bytes)
    if g <= 1:
        return 0.0
    factor = {
        "all-gather": (g - 1) / g,
        "reduce-scatter": g - 1,
        "all-reduce": 2 * (g - 1) / g,
        "all-to-all": (g - 1) / g,
    }[kind]
    return factor * result_bytes


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective of a training step, as one participating device sees it.

    ``axes`` are mesh axes in mesh order; ``count`` is how many times it runs
    per step (more than one inside a ``scan``). Shapes are local (per device).
    """

    kind: str
    axes: tuple[str, ...]
    group_size: int
    dtype: str
    operand_shape: tuple[int, ...]
    result_shape: tuple[int, ...]
    phase: str
    count: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r}; kinds are {KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")

    @property
    def operand_bytes(self) -> int:
        """Bytes of the operand on one device, times ``count``."""
        return self.count * math.prod(self.operand_shape) * np.dtype(self.dtype).itemsize

    @property
    def result_bytes(self) -> int:
        """Bytes of the result on one device (what HLO shows), times ``count``."""
        return self.count * math.prod(self.result_shape) * np.dtype(self.dtype).itemsize

    @property
    def wire_bytes(self) -> float:
        """Bytes this device sends (ring algorithms), times ``count``."""
        return ring_wire_bytes(self.kind, self.group_size, self.result_bytes)


@dataclasses.dataclass(frozen=True)
class GroupTotal:
    """All collectives of one kind over one set of mesh axes."""

    kind: str
    axes: tuple[str, ...]
    group_size: int
    count: int
    forward_bytes: int  # result bytes per device
    backward_bytes: int
    wire_bytes: float

    @property
    def result_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


@dataclasses.dataclass(frozen=True)
class CommReport:
    """Every collective of one training step of the model, per device."""

    transfers: tuple[Transfer, ...]

    def groups(self) -> dict[tuple[str, tuple[str, ...]], GroupTotal]:
        """Totals per ``(kind, axes)``, in order of first appearance."""
        acc: dict[tuple[str, tuple[str, ...]], list] = {}
        for t in self.transfers:
            entry = acc.setdefault((t.kind, t.axes), [t.group_size, 0, 0, 0, 0.0])
            entry[1] += t.count
            entry[2 if t.phase == "forward" else 3] += t.result_bytes
            entry[4] += t.wire_bytes
        return {key: GroupTotal(key[0], key[1], *vals) for key, vals in acc.items()}

    @property
    def count(self) -> int:
        return sum(t.count for t in self.transfers)

    @property
    def result_bytes(self) -> int:
        """Sum of the collectives' result sizes on one device."""
        return sum(t.result_bytes for t in self.transfers)

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per step with ring algorithms."""
        return sum(t.wire_bytes for t in self.transfers)

    def phase(self, phase: str) -> CommReport:
        """Only the forward (or backward) collectives."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        return CommReport(tuple(t for t in self.transfers if t.phase == phase))

    def __str__(self) -> str:
        head = (
            f"communication per device and step: {self.count} collectives, "
            f"{self.result_bytes:,} B moved through them, "
            f"{self.wire_bytes:,.0f} B on the wire (ring)"
        )
        if not self.transfers:
            return head + " (nothing to communicate)"
        rows = [("collective", "axes", "group", "count", "forward B", "backward B", "wire B")]
        for g in self.groups().values():
            rows.append((g.kind, ",".join(g.axes), str(g.group_size), str(g.count),
                         f"{g.forward_bytes:,}", f"{g.backward_bytes:,}",
                         f"{g.wire_bytes:,.0f}"))  # fmt: skip
        return head + "\n" + _table(rows, right=(2, 3, 4, 5, 6))


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes one device holds during a training step, by kind.

    ``parameters``: the stored shards (model state such as BatchNorm
    statistics included); ``gradients``: those of the trainable parameters,
    same layout and dtype; ``optimizer``: ``optimizer_slots`` fp32 values per
    trainable parameter element in the parameter layout (2 for Adam: m and v). Kept from the forward pass for the
    backward pass (``None`` until a step has been traced): ``activations``,
    and ``gathered_weights`` (values computed from parameters only, e.g. weight
    blocks after the depth all-gather).
    """

    parameters: int
    gradients: int
    optimizer: int
    optimizer_slots: int = 2
    activations: int | None = None
    gathered_weights: int | None = None

    @classmethod
    def from_plan(
        cls, plan, *, params=None, optimizer_slots: int = 2, activations=None, gathered_weights=None
    ) -> MemoryReport:
        """Parameter, gradient and optimizer bytes per device from ``plan``'s layouts.

        ``params``: the ``ParamPlan`` entries one device holds (default all of
        them; a pipeline stage's own on pipeline grids).

        Example:
            >>> pm.plan.memory().parameters == pm.plan.param_bytes_per_device  # doctest: +SKIP
            True
        """
        params = plan.params if params is None else params
        trainable = [p for p in params if p.trainable]  # model state has no gradient nor optimizer state
        elements = sum(math.prod(p.local_shape(plan.grid)) for p in trainable)
        return cls(
            parameters=sum(p.bytes_per_device(plan.grid) for p in params),
            gradients=sum(p.bytes_per_device(plan.grid) for p in trainable),
            optimizer=optimizer_slots * elements * np.dtype(np.float32).itemsize,
            optimizer_slots=optimizer_slots,
            activations=activations,
            gathered_weights=gathered_weights,
        )

    @property
    def traced(self) -> bool:
        return self.activations is not None

    @property
    def total(self) -> int:
        kept = (self.activations or 0) + (self.gathered_weights or 0)
        return self.parameters + self.gradients + self.optimizer + kept

    def as_dict(self) -> Mapping[str, int | None]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            f"optimizer state ({self.optimizer_slots}× fp32 per parameter)": self.optimizer,
            "activations kept for backward": self.activations,
            "gathered weights kept for backward": self.gathered_weights,
        }

    def __str__(self) -> str:
        rows = [("memory per device", "bytes")]
        for name, value in self.as_dict().items():
            rows.append((name, "not traced: pm.report()" if value is None else f"{value:,}"))
        rows.append(("total", f"{self.total:,}" + ("" if self.traced else " + what is kept")))
        return _table(rows, right=(1,))


def _table(rows: Iterable[tuple[str, ...]], right: tuple[int, ...] = ()) -> str:
    rows = list(rows)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(row):
        cells = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        return "  ".join(cells).rstrip()

    out = [line(rows[0]), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in rows[1:])
    return "\n".join(out)

"""The immutable result of partitioning: layouts, layers, fallbacks, memory. Pure.

Example:
    >>> print(pm.plan)                                   # doctest: +SKIP
    Plan for Grid(x=2, y=2, z=2, data=1, pipeline=1): 6 parameters ...
    >>> print(pm.plan.table())                           # doctest: +SKIP
    parameter   shape   stored as   role   bytes/device ...
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np

from axonn_jax.partitioner.grid import Grid
from axonn_jax.partitioner.layout import Layout, describe, factor, to_spec
from axonn_jax.partitioner.propagation import Fallback, PlannedLayouts
from axonn_jax.partitioner.report import MemoryReport
from axonn_jax.partitioner.roles import ParamRole
from axonn_jax.partitioner.balance import StageCosts
from axonn_jax.partitioner.stages import Stage, StagePlan, format_seconds


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """Where one parameter lives."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    storage: Layout  # stored layout (what PartitionSpec says)
    use: Layout  # layout after the depth (z) gather, where it is consumed
    role: ParamRole
    trainable: bool = True  # False: model state (e.g. BatchNorm statistics), not differentiated

    @property
    def spec(self) -> jax.sharding.PartitionSpec:
        return to_spec(self.storage)

    def local_shape(self, grid: Grid) -> tuple[int, ...]:
        return tuple(s // factor(a, grid) for s, a in zip(self.shape, self.storage))

    def bytes_per_device(self, grid: Grid) -> int:
        return math.prod(self.local_shape(grid)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a model is laid out on a :class:`~axonn_jax.Grid`."""

    grid: Grid
    params: tuple[ParamPlan, ...]
    param_tree: Any
    arg_layouts: tuple[Layout, ...]
    out_layouts: tuple[Layout, ...]
    fallbacks: tuple[Fallback, ...]
    notes: tuple[str, ...]
    stages: tuple[Stage, ...] = ()
    #: the rates the stages were priced with, and the ``stages=`` patterns that cut them (if given)
    stage_costs: StageCosts | None = None
    stage_boundaries: tuple[str, ...] | None = None
    #: scans over stacked layers split between pipeline stages (partitioner.scan_cuts)
    scan_cuts: tuple = ()

    @classmethod
    def build(cls, traced, grid: Grid, layouts: PlannedLayouts, split: StagePlan | None = None,
              scan_cuts=()) -> Plan:  # fmt: skip
        params = [
            ParamPlan(path, tuple(aval.shape), str(np.dtype(aval.dtype)), layouts.storage[path],
                      layouts.use[path], layouts.roles[path], trainable)  # fmt: skip
            for path, aval, trainable in zip(traced.param_paths, traced.param_avals, traced.trainable, strict=True)
        ]
        return cls(
            grid=grid,
            params=tuple(params),
            param_tree=traced.param_tree,
            arg_layouts=layouts.args,
            out_layouts=layouts.outs,
            fallbacks=layouts.fallbacks,
            notes=traced.notes + layouts.notes + (split.notes + _shared_stage_notes(split.stages) if split else ()),
            stages=split.stages if split else (),
            stage_costs=split.costs if split else None,
            stage_boundaries=split.boundaries if split else None,
            scan_cuts=tuple(scan_cuts),
        )

    # --- views ------------------------------------------------------------
    @property
    def param_specs(self):
        """PartitionSpec pytree matching the params pytree."""
        return jax.tree.unflatten(self.param_tree, [p.spec for p in self.params])

    def param(self, path: str) -> ParamPlan:
        for p in self.params:
            if p.path == path:
                return p
        raise KeyError(f"no parameter '{path}'; parameters are {[p.path for p in self.params]}")

    @property
    def stage_cuts(self) -> tuple[str, ...] | None:
        """``stages=`` patterns that cut another plan of this model as this one is cut (``None``
        without a pipeline): its evaluation program, say (``model.eval()`` in nnx, ``train=False``
        traced anew), whose stages then use the parameters these do, so that it runs on the
        variables this plan laid out across processes. Stage k+1 starts where the first of
        the parameters it uses and no earlier stage does is used.

        Example:
            >>> model.eval()                                                      # doctest: +SKIP
            >>> evaluate = axonn_jax.partition(model, grid, x, stages=pm.plan.stage_cuts)  # doctest: +SKIP
        """
        if len(self.stages) < 2:
            return None
        if self.scan_cuts:
            raise ValueError(
                f"the stages of {self.grid} are cut inside a scan over stacked layers, between "
                "layers that share their parameters, so stages= patterns cannot name the cuts. "
                "Remedy: partition the other program without stages= (its scan is cut by the same "
                "costs) and check that its plan.stages use the parameters these do."
            )
        seen, cuts = set(self.stages[0].params), []
        for st in self.stages[1:]:
            new = [p for p in st.params if p not in seen]  # a stage uses at least one parameter
            cuts.append("^(" + "|".join(re.escape(p) for p in new) + ")$")
            seen.update(st.params)
        return tuple(cuts)

    @property
    def total_param_bytes(self) -> int:
        return sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in self.params)

    @property
    def param_bytes_per_device(self) -> int:
        return sum(p.bytes_per_device(self.grid) for p in self.params)

    def memory(self, *, optimizer_slots: int = 2) -> MemoryReport:
        """Parameter, gradient and optimizer (``optimizer_slots`` fp32) bytes per device.

        What is kept for backward needs a traced step: ``pm.report().memory``.
        """
        return MemoryReport.from_plan(self, optimizer_slots=optimizer_slots)

    @property
    def warnings(self) -> tuple[str, ...]:
        """What was left unsplit, and why; identical lines merged with their count."""
        out = [f"replicated {f.primitive} at {f.where}: {f.reason}" for f in self.fallbacks]
        counts: dict[str, int] = {}
        for line in [*out, *self.notes]:
            counts[line] = counts.get(line, 0) + 1
        return tuple(line if n == 1 else f"{line} ({n} times)" for line, n in counts.items())

    def __str__(self) -> str:
        """A compact summary: totals, warnings, parameters by role, memory, stages.

        :meth:`table` lists every parameter.
        """
        g = self.grid
        lines = [
            f"Plan for {g}: {len(self.params)} parameters, "
            f"{self.total_param_bytes:,} bytes total, "
            f"{self.param_bytes_per_device:,} bytes per device "
            f"({self.total_param_bytes / max(self.param_bytes_per_device, 1):.2f}× less)"
        ]
        if self.warnings:
            lines.append("warnings:")
            lines.extend(f"  - {w}" for w in self.warnings)
        lines.append("parameters by role: " + self._role_counts())
        mem = self.memory()
        lines.append(
            f"memory per device: parameters {mem.parameters:,} B, gradients {mem.gradients:,} B, "
            f"Adam state {mem.optimizer:,} B; activations and communication: pm.report()"
        )
        if len(self.stages) > 1:
            lines.extend(self._stage_lines())
        lines.append("every parameter's layout: print(pm.plan.table())")
        return "\n".join(lines)

    def _stage_lines(self) -> list[str]:
        """How the stages were cut (truthfully), then one line per stage."""
        g = self.grid
        total = sum(st.flops for st in self.stages) or 1.0
        slowest = max(self.stages, key=lambda st: st.seconds)
        count = (f"{len(self.stages)} = pipeline {g.pipeline} × virtual {g.virtual}"
                 if g.virtual > 1 else f"{len(self.stages)}")  # fmt: skip
        if self.stage_boundaries is not None:
            how = f"cut where stages={list(self.stage_boundaries)} says"
        else:
            how = "cut for the fastest slowest stage: compute + boundary transfer"
        rates = f" at {self.stage_costs.describe()}" if self.stage_costs else ""
        lines = [f"pipeline stages ({count}, {how}; slowest: stage {slowest.index}, "
                 f"{format_seconds(slowest.seconds)} per microbatch{rates}"
                 + (f"; stage s runs on pipeline rank s mod {g.pipeline}"
                    if g.virtual > 1 and g.placement == "interleaved" else "")
                 + (f"; V-shaped: stage s runs on rank s, or 2·{g.pipeline} − 1 − s from stage {g.pipeline}"
                    if g.placement == "v" else "")
                 + "):"]  # fmt: skip
        for st in self.stages:
            rank = f" (rank {g.pipeline_rank(st.index)})" if g.virtual > 1 else ""
            lines.append(
                f"  stage {st.index}{rank}: {len(st.params)} params ({st.param_bytes:,} B), "
                f"{st.flops / total:.1%} of FLOPs, {format_seconds(st.seconds)} (compute "
                f"{format_seconds(st.compute_seconds)} + transfers {format_seconds(st.transfer_seconds)}), "
                f"sends {st.send_bytes:,} B/batch; {_span(st.params)}"
            )
        return lines

    def _role_counts(self) -> str:
        """``normal 4 (1,024 B/device), ...``: trainable parameters by role, then model state."""
        counts: dict[str, list[int]] = {}
        for p in self.params:
            kind = p.role.value if p.trainable else "state"
            entry = counts.setdefault(kind, [0, 0])
            entry[0] += 1
            entry[1] += p.bytes_per_device(self.grid)
        order = [r.value for r in ParamRole] + ["state"]
        return ", ".join(f"{k} {counts[k][0]} ({counts[k][1]:,} B/device)" for k in order if k in counts)

    def table(self) -> str:
        """One row per parameter: path, shape, stored layout, role, bytes per device."""
        g = self.grid
        rows = [("parameter", "shape", "stored as", "role", "bytes/device")]
        for p in self.params:
            rows.append((p.path, "×".join(map(str, p.shape)) or "scalar", describe(p.storage),
                         p.role.value if p.trainable else f"state, {p.role.value}", f"{p.bytes_per_device(g):,}"))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = []
        for i, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _span(paths) -> str:
    return f"{paths[0]} … {paths[-1]}" if len(paths) > 1 else (paths[0] if paths else "-")


def _shared_stage_notes(stages) -> tuple[str, ...]:
    """Parameters used by more than one stage (e.g. tied embeddings)."""
    seen: dict[str, list[int]] = {}
    for st in stages:
        for path in st.params:
            seen.setdefault(path, []).append(st.index)
    return tuple(
        f"{path}: used by stages {where}; each keeps a copy and their gradients are summed"
        for path, where in seen.items() if len(where) > 1
    )  # fmt: skip

"""``pm.report()`` on pipeline grids: each stage's traced step, the messages between stages, summed.

Each stage's forward (``jax.vjp`` of its program: outbound values and the
residuals it keeps) and backward (the pullback on the outbound cotangents) are
traced on an ``AbstractMesh`` of the stage's shape (no devices), exactly the
programs the dispatch queue runs for one call of the given inputs. Per stage:
its collectives, the bytes one of its devices holds, and its FLOPs per device;
between stages, the activation each device sends forward and the gradient it
sends back. The compute report sums the stages: ``stage devices · Σ_s FLOPs per
device of stage s`` against the plain model on one device, so the redundancy
means what it means on a grid without pipeline (1.00: nothing repeated).

Example:
    >>> report = pipeline_report(plan, program, (tokens,), {})   # doctest: +SKIP
    >>> report.compute.redundancy, report.stages[0].communication.wire_bytes  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from axonn_jax.partitioner.flops import ComputeReport, Flops, count
from axonn_jax.partitioner.layout import local_shape
from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.program import Program
from axonn_jax.partitioner.report import CommReport, MemoryReport
from axonn_jax.partitioner.trace import abstract_call, call_leaves
from axonn_jax.runtime.executor import Executor
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.pipeline.stage_program import StageProgram
from axonn_jax.runtime.step_report import (abstract_stage_mesh, cotangent, plain_flops, saved_bytes, step_collectives,
                                           without_dead_residuals)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StageReport:
    """One stage's training step (forward and backward of one call), per device of the stage."""

    index: int
    devices: int  # devices of the stage
    flops: Flops  # per device
    communication: CommReport  # collectives inside the stage
    memory: MemoryReport
    sends: int  # bytes of activations one device sends to the next stage (0 on the last)
    returns: int  # bytes of gradients one device sends back to the previous stage (0 on the first)

    def __str__(self) -> str:
        return (f"stage {self.index}: {self.flops.total:,} FLOPs per device ({self.devices} devices); "
                f"{self.communication.count} collectives, {self.communication.wire_bytes:,.0f} B on the wire; "
                f"sends {self.sends:,} B forward, {self.returns:,} B of gradients back; "
                f"holds {self.memory.total:,} B")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PipelineReport:
    """What one training step of a pipelined model computes, communicates and keeps.

    ``stages``: one :class:`StageReport` per stage. ``compute``: the stages
    summed (``per_device`` is one device of every stage together,
    ``devices`` the devices of a stage), so ``compute.redundancy`` is the
    whole grid's work over the plain model's. ``communication``: every stage's
    collectives together (one device of each stage); ``memory``: the stage
    that holds the most. Messages between stages are ``StageReport.sends`` /
    ``returns``.
    """

    plan: Plan
    stages: tuple[StageReport, ...]
    compute: ComputeReport

    @property
    def communication(self) -> CommReport:
        return CommReport(tuple(t for s in self.stages for t in s.communication.transfers))

    @property
    def memory(self) -> MemoryReport:
        return max((s.memory for s in self.stages), key=lambda m: m.total)

    @property
    def message_bytes(self) -> int:
        """Bytes one device of each stage sends to its neighbours per call, forward and back."""
        return sum(s.sends + s.returns for s in self.stages)

    def __str__(self) -> str:
        c = self.compute
        head = (f"compute per step: {c.devices * c.per_device.total:,} FLOPs on {len(self.stages)} stages of "
                f"{c.devices} devices; the plain model {c.plain.total:,} on one device; redundancy "
                f"{c.redundancy:.2f} (1.00 = nothing repeated)")  # fmt: skip
        rows = [f"  {share:+.1%}  {line}" for line, share in c.repeated()]
        repeated = ["most repeated (extra work, share of the plain step):", *rows] if rows else []
        per_stage = [str(s) for s in self.stages]
        return "\n".join([str(self.plan), self.plan.table(), "", *per_stage, "", str(self.memory),
                          "", str(self.communication), "", head, *repeated])  # fmt: skip


def pipeline_report(plan: Plan, program: Program, args: tuple, kwargs: dict, *,
                    overlap: Overlap = Overlap(), optimizer_slots: int = 2) -> PipelineReport:  # fmt: skip
    """Trace every stage's step of ``program`` (planned for a pipeline grid) on ``args``/``kwargs``."""
    grid = plan.grid
    args, kwargs = abstract_call(args, kwargs)
    arrays, _ = call_leaves(args, kwargs)
    executor = Executor(program, overlap=overlap)
    mesh = abstract_stage_mesh(grid)
    stages = []
    for flow in program.stage_flows:
        stage = StageProgram(flow, executor, mesh, last=False)
        forward, backward = stage.traceable()
        params = [jax.ShapeDtypeStruct(flow.param_shape(i, plan.params[i].shape), plan.params[i].dtype)
                  for i in flow.params]  # fmt: skip
        inbound = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in flow.inbound]
        fwd, (outs, residuals) = jax.make_jaxpr(forward, return_shape=True)(
            params, [arrays[j] for j in flow.args], inbound)  # fmt: skip
        leaves, tree = jax.tree.flatten(residuals)
        bwd = jax.make_jaxpr(lambda r, ct: backward(jax.tree.unflatten(tree, r), ct))(
            leaves, [cotangent(outs[i]) for i in flow.diff_out])  # fmt: skip
        fwd, bwd, kept = without_dead_residuals(fwd, bwd, len(leaves))
        saved = saved_bytes(fwd.jaxpr, num_params=len(params), num_residuals=kept)
        memory = MemoryReport.from_plan(plan, params=[plan.params[i] for i in flow.params],
                                        optimizer_slots=optimizer_slots, activations=saved.activations,
                                        gathered_weights=saved.weights)  # fmt: skip
        last = flow.index == len(program.stage_flows) - 1
        sends = 0 if last else _bytes(flow.outbound, flow.outbound_layouts, grid)
        returns = _bytes([flow.inbound[i] for i in flow.diff_in],
                         [flow.inbound_layouts[i] for i in flow.diff_in], grid)  # fmt: skip
        stages.append(StageReport(flow.index, grid.stage_size, count(fwd) + count(bwd), step_collectives(fwd, bwd),
                                  memory, sends, returns))  # fmt: skip
    per_device = sum((s.flops for s in stages[1:]), stages[0].flops)
    compute = ComputeReport(per_device, plain_flops(plan, program, args, kwargs), grid.stage_size)
    return PipelineReport(plan, tuple(stages), compute)


def _bytes(variables, layouts, grid) -> int:
    """Bytes of one device's shards of ``variables`` laid out as ``layouts``."""
    return sum(math.prod(local_shape(v.aval.shape, layout, grid)) * np.dtype(v.aval.dtype).itemsize
               for v, layout in zip(variables, layouts) if hasattr(v, "aval"))  # fmt: skip

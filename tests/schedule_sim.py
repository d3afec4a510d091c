"""A discrete-event simulation of the pipeline schedules, virtual (interleaved) stages too.

Runs the real :mod:`axonn_jax.runtime.pipeline.schedules` objects (one per
pipeline rank, over the stages ``r, r+p, …`` that rank owns, as the dispatch
queue does) on idealised devices: a rank runs one task at a time, a forward and
a backward of one stage take ``1/v`` of a time unit (the last stage's fused
forward+loss+backward ``2/v``), a message arrives ``latency`` after its task
ends. Schedules that split the backward (zero bubble) run its B and W parts
in ``split`` shares of the backward's time (default 1:1, a matmul layer's
FLOPs; or ``split(stage)`` per stage, e.g. the shares of the B and W programs'
FLOPs, where stage 0 has no B); ``forward`` scales the forward's time (``split=(1, 1)``:
F = B = W, the zero-bubble paper's setting).

``placement(stage, virtual, pipeline)`` gives the rank a stage runs on
(default: :meth:`Grid.pipeline_rank <axonn_jax.partitioner.grid.Grid.pipeline_rank>`,
where the runtime places the stage meshes). No JAX, no devices: it checks the schedules' logic (no deadlock, the
bubble, the residuals kept) in milliseconds.

Example:
    >>> sim = simulate("message", pipeline=2, virtual=2, microbatches=4)
    >>> round(sim.idle, 3), sim.makespan                     # doctest: +SKIP
    (0.111, 9.0)
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable

from axonn_jax.partitioner.grid import Grid
from axonn_jax.runtime.pipeline.schedules import make_schedule
from axonn_jax.runtime.pipeline.tasks import Task, TaskKind

F, B, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.WEIGHTS


@dataclasses.dataclass
class _Stage:
    """What a schedule reads of a stage (the dispatch queue's ``_StageState`` fields)."""

    forwards: int = 0
    backwards: int = 0
    cotangents: dict = dataclasses.field(default_factory=dict)  # mb → arrival time
    inbound: dict = dataclasses.field(default_factory=dict)  # mb → arrival time
    residuals: set = dataclasses.field(default_factory=set)
    deferred: dict = dataclasses.field(default_factory=dict)  # mb → True: B ran, W has not
    weights: int = 0
    peak: int = 0  # most microbatches holding residuals (full or W) at once
    peak_full: int = 0  # most microbatches between forward and B


@dataclasses.dataclass(frozen=True)
class Simulation:
    makespan: float
    idle: float  # mean over ranks of the idle fraction of the makespan
    peak: dict[int, int]  # stage → most microbatches holding residuals (full or W's) at once
    peak_full: dict[int, int]  # stage → most microbatches between forward and B
    #: rank → most stage-microbatches between forward and B on all its stages at once
    rank_peak_full: dict[int, int]
    order: dict[int, list[tuple[int, str, int, float]]]  # rank → (stage, kind, mb, start)
    #: (rank, W task, time) of each W started while a B of the same rank was ready
    w_before_b: list = dataclasses.field(default_factory=list)
    #: rank → most stage-microbatches holding residuals of either kind (full or W's) at once
    rank_peak: dict[int, int] = dataclasses.field(default_factory=dict)


def interleaved(stage: int, virtual: int, pipeline: int) -> int:
    """The runtime's placement of virtual stage ``stage`` (``stage mod pipeline``)."""
    return Grid(pipeline=pipeline, virtual=virtual).pipeline_rank(stage)


def v_shaped(stage: int, virtual: int, pipeline: int) -> int:
    """The runtime's V-shaped placement (``Grid(..., placement="v")``, ``virtual=2``)."""
    return Grid(pipeline=pipeline, virtual=virtual, placement="v").pipeline_rank(stage)


def simulate(schedule, pipeline: int, virtual: int, microbatches: int, *,
             latency: float = 0.0, limit: int | None = None, forward: float = 1.0,
             split: tuple[float, float] | Callable[[int], tuple[float, float]] = (0.5, 0.5),
             placement=interleaved) -> Simulation:  # fmt: skip
    """Simulate one step; raises ``RuntimeError`` on a deadlock.

    ``schedule``: a name, or ``make(pipeline) → Schedule`` for one built here.
    """
    p, m = pipeline, microbatches
    n = p * virtual
    last = n - 1
    unit = 1.0 / virtual
    stages = {s: _Stage() for s in range(n)}
    ranks = tuple(placement(s, virtual, p) for s in range(n))
    owned = {r: [s for s in range(n) if ranks[s] == r] for r in range(p)}
    rank_peak = {r: 0 for r in range(p)}
    rank_peak_all = {r: 0 for r in range(p)}
    plans = {}
    for r in range(p):
        plans[r] = (make_schedule(schedule, limit=limit, stages=n, pipeline=p, placement=ranks)
                    if isinstance(schedule, str) else schedule(p))  # fmt: skip
        plans[r].start(owned[r], n, m)
    splits = plans[0].splits_weights
    shares = split if callable(split) else (lambda s: split)

    def lengths(s: int) -> tuple[float, float]:  # (B, W) of stage s; the fused backward: (B + W, 0)
        b, w = shares(s)
        return (b * unit, w * unit) if splits else ((b + w) * unit, 0.0)

    t_f = forward * unit
    free = {r: 0.0 for r in range(p)}  # when each rank's device is next free
    busy = {r: 0.0 for r in range(p)}
    order: dict[int, list] = {r: [] for r in range(p)}
    w_before_b: list = []
    events: list = []  # (time, seq, kind, payload)
    seq = 0
    now = 0.0

    def done() -> bool:
        if splits:
            return all(st.weights == m for st in stages.values())
        return all((st.forwards if s == last else st.backwards) == m for s, st in stages.items())

    def hold(st) -> None:
        st.peak = max(st.peak, len(st.residuals) + len(st.deferred))
        st.peak_full = max(st.peak_full, len(st.residuals))

    while not done():
        progressed = False
        for r in range(p):
            if free[r] > now:
                continue
            views = {s: stages[s] for s in owned[r]}

            def has_input(task):
                s, mb, st = task.stage, task.microbatch, stages[task.stage]
                if task.kind is B:
                    return mb in st.residuals and st.cotangents.get(mb, float("inf")) <= now
                if task.kind is W:
                    return mb in st.deferred
                return mb == st.forwards and (s == 0 or st.inbound.get(mb, float("inf")) <= now)

            # cotangents the schedule sees: those arrived by now
            visible = {s: dataclasses.replace(st, cotangents={k: t for k, t in st.cotangents.items()
                                                              if t <= now})
                       for s, st in views.items()}  # fmt: skip
            task = plans[r].pick(visible, has_input, m)
            if task is None:
                continue
            if task.kind is W and any(has_input(Task(s, B, mb)) for s in owned[r] for mb in stages[s].cotangents):
                w_before_b.append((r, task, now))
            s, kind, mb = task.stage, task.kind.value, task.microbatch
            st = stages[s]
            t_b, t_w = lengths(s)
            length = {"F": t_f + (t_b if s == last else 0.0), "B": t_b, "W": t_w}[kind]  # last: F+B
            end = now + length
            if kind == "W":
                del st.deferred[mb]
                st.weights += 1
            elif kind == "F":
                st.inbound.pop(mb, None)
                st.forwards += 1
                if s == last:
                    st.backwards += 1
                    if splits:
                        st.deferred[mb] = True
                        hold(st)
                    if s > 0:
                        heapq.heappush(events, (end + latency, seq, "B", (s - 1, mb)))
                else:
                    st.residuals.add(mb)
                    hold(st)
                    heapq.heappush(events, (end + latency, seq, "F", (s + 1, mb)))
            else:
                st.cotangents.pop(mb)
                st.residuals.discard(mb)
                if splits:
                    st.deferred[mb] = True
                    hold(st)
                st.backwards += 1
                if s > 0:
                    heapq.heappush(events, (end + latency, seq, "B", (s - 1, mb)))
            seq += 1
            rank_peak[r] = max(rank_peak[r], sum(len(stages[o].residuals) for o in owned[r]))
            rank_peak_all[r] = max(rank_peak_all[r], sum(len(stages[o].residuals) + len(stages[o].deferred)
                                                         for o in owned[r]))  # fmt: skip
            plans[r].ran(task)
            order[r].append((s, "FB" if kind == "F" and s == last else kind, mb, now))
            free[r] = end
            busy[r] += length
            heapq.heappush(events, (end, seq, "free", r))
            seq += 1
            progressed = True
        if progressed:
            continue
        if not events:
            raise RuntimeError(f"deadlock at t={now}: " + ", ".join(
                f"s{s} F{st.forwards} B{st.backwards}" for s, st in stages.items()))
        now, _, kind, payload = heapq.heappop(events)
        if kind == "F":
            stages[payload[0]].inbound[payload[1]] = now
        elif kind == "B":
            stages[payload[0]].cotangents[payload[1]] = now
        while events and events[0][0] <= now:  # everything due at this instant
            _, _, kind, payload = heapq.heappop(events)
            if kind == "F":
                stages[payload[0]].inbound[payload[1]] = now
            elif kind == "B":
                stages[payload[0]].cotangents[payload[1]] = now
    makespan = max(free.values())
    idle = sum(1.0 - b / makespan for b in busy.values()) / p
    return Simulation(makespan, idle, {s: st.peak for s, st in stages.items()},
                      {s: st.peak_full for s, st in stages.items()}, rank_peak, order, w_before_b,
                      rank_peak_all)  # fmt: skip

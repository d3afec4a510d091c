"""A deterministic simulation of one pipelined step, driven by the real schedules.

One device per stage (the ``mpiexec`` deployment: one process per stage, each
with its own :class:`~axonn_jax.runtime.pipeline.schedules.Schedule`), task
durations in abstract units (forward ``forward``, backward ``backward``, the
last stage's fused forward+loss+backward both), and a message that leaves a
stage when its task ends and arrives ``latency`` later. A free device asks its
schedule for a task among those whose input has arrived, exactly as the
dispatch queue does; nothing here uses JAX, so schedules can be compared in
milliseconds and without timing noise.

Example:
    >>> round(simulate("1f1b", stages=4, microbatches=16).idle, 3)
    0.158
"""

from __future__ import annotations

import dataclasses

from axonn_jax.runtime.pipeline.schedules import make_schedule


@dataclasses.dataclass
class _Stage:
    """What a schedule reads of a stage (the :class:`StageView` protocol) plus the sim's own."""

    forwards: int = 0
    backwards: int = 0
    cotangents: dict = dataclasses.field(default_factory=dict)  # mb → arrival time
    last_kind: str = ""
    inbound: dict = dataclasses.field(default_factory=dict)  # mb → arrival time
    residuals: set = dataclasses.field(default_factory=set)
    free_at: float = 0.0
    busy: float = 0.0
    peak: int = 0


@dataclasses.dataclass(frozen=True)
class Simulated:
    idle: float  # mean over stages of the idle fraction of the step's span
    idle_per_stage: tuple[float, ...]
    span: float
    peak_in_flight: tuple[int, ...]  # per stage: most microbatches between forward and backward
    tasks: tuple[tuple[int, str, int, float, float], ...]  # (stage, kind, mb, start, end)


def simulate(schedule: str, stages: int, microbatches: int, *, latency: float = 0.0,
             forward: float = 1.0, backward: float = 1.0, limit: int | None = None) -> Simulated:  # fmt: skip
    """Run one step of ``schedule`` on ``stages`` stages and ``microbatches`` microbatches."""
    last = stages - 1
    sched = {s: make_schedule(schedule, limit=limit, stages=stages) for s in range(stages)}
    for s, sc in sched.items():
        sc.start([s], stages, microbatches)
    st = {s: _Stage() for s in range(stages)}
    tasks: list[tuple[int, str, int, float, float]] = []
    now = 0.0

    def has_input(s: int, kind: str, mb: int) -> bool:
        x = st[s]
        if kind == "B":
            return mb in x.residuals and x.cotangents.get(mb, float("inf")) <= now
        return mb == x.forwards and (s == 0 or x.inbound.get(mb, float("inf")) <= now)

    def done(s: int) -> bool:
        return st[s].forwards == microbatches if s == last else st[s].backwards == microbatches

    while not all(done(s) for s in range(stages)):
        for s in range(stages):
            x = st[s]
            if x.free_at > now or done(s):
                continue
            task = sched[s].pick({s: x}, has_input, microbatches)
            if task is None:
                continue
            _, kind, mb = task
            if kind == "F" and s == last:
                duration, label = forward + backward, "FB"
                x.forwards += 1
                x.backwards += 1
                if s > 0:
                    st[s - 1].cotangents[mb] = now + duration + latency
            elif kind == "F":
                duration, label = forward, "F"
                x.forwards += 1
                x.residuals.add(mb)
                x.peak = max(x.peak, len(x.residuals))
                st[s + 1].inbound[mb] = now + duration + latency
            else:
                duration, label = backward, "B"
                x.backwards += 1
                x.residuals.discard(mb)
                del x.cotangents[mb]
                if s > 0:
                    st[s - 1].cotangents[mb] = now + duration + latency
            x.last_kind = kind
            sched[s].ran(s)
            x.free_at = now + duration
            x.busy += duration
            tasks.append((s, label, mb, now, now + duration))
        upcoming = [x.free_at for x in st.values() if x.free_at > now]
        upcoming += [t for x in st.values() for t in (*x.inbound.values(), *x.cotangents.values())
                     if t > now]  # fmt: skip
        if not upcoming:
            if all(done(s) for s in range(stages)):
                break
            raise RuntimeError(f"{schedule}: no task can run at t={now} (deadlock)")
        now = min(upcoming)
    span = max(end for *_, end in tasks) - min(start for *_, start, _ in tasks)
    idle = tuple(1.0 - st[s].busy / span for s in range(stages))
    return Simulated(sum(idle) / stages, idle, span, tuple(st[s].peak for s in range(stages)),
                     tuple(tasks))  # fmt: skip

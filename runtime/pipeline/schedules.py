"""Pipeline schedules: which task a stage runs next.

A task is ``("F", mb)`` (forward of microbatch ``mb``) or ``("B", mb)``
(backward); on the last stage the forward also runs the loss and backward, so
it has only ``F`` tasks. A :class:`Schedule` picks, among the tasks whose
input has arrived, the one the dispatch queue runs next. Static schedules
(:class:`StaticSchedule`: GPipe, 1F1B) fix each stage's order in advance; the
message-driven schedule (:class:`MessageDriven`, AxoNN) runs whichever task's
input has arrived, backward first, with stage ``s`` keeping at most
``limit - s`` microbatches in flight.

Example:
    >>> one_f_one_b(stage=0, stages=2, microbatches=3)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    >>> gpipe(stage=1, stages=2, microbatches=2)
    [('F', 0), ('F', 1)]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

Task = tuple[str, int]
#: (stage, kind, microbatch)
StageTask = tuple[int, str, int]

SCHEDULES = ("message", "1f1b", "gpipe")


def check_schedule(name: str) -> str:
    """``name`` if it is one of :data:`SCHEDULES`, else a ``ValueError`` listing them."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    return name


def gpipe(stage: int, stages: int, microbatches: int) -> list[Task]:
    """All forwards, then all backwards (GPipe)."""
    forwards = [("F", mb) for mb in range(microbatches)]
    if stage == stages - 1:
        return forwards
    return forwards + [("B", mb) for mb in range(microbatches)]


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Task]:
    """Warm-up forwards, then one forward one backward, then the remaining backwards."""
    if stage == stages - 1:
        return [("F", mb) for mb in range(microbatches)]
    warmup = min(stages - stage - 1, microbatches)
    order: list[Task] = [("F", mb) for mb in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < microbatches:
        if next_f < microbatches:
            order.append(("F", next_f))
            next_f += 1
        order.append(("B", next_b))
        next_b += 1
    return order


def static_order(name: str, stage: int, stages: int, microbatches: int) -> list[Task]:
    if name == "gpipe":
        return gpipe(stage, stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stage, stages, microbatches)
    raise ValueError(f"unknown static schedule {name!r}; choose one of {SCHEDULES}")


class StageView(Protocol):
    """What a schedule reads of one stage's progress in the dispatch queue."""

    forwards: int  # forwards done (the next forward is microbatch ``forwards``)
    backwards: int
    cotangents: Mapping  # microbatch → gradient arrived from the next stage


#: ``has_input(stage, kind, mb)``: the task's input has arrived (and, for a
#: forward, ``mb`` is the stage's next microbatch)
HasInput = Callable[[int, str, int], bool]


class Schedule(Protocol):
    """Decides which ready task of this process's stages runs next."""

    name: str

    def start(self, local: list[int], stages: int, microbatches: int) -> None:
        """Called once at the start of a step."""

    def pick(self, states: Mapping[int, StageView], has_input: HasInput,
             microbatches: int) -> StageTask | None:  # fmt: skip
        """The next task, or ``None`` when none may run yet."""

    def ran(self, stage: int) -> None:
        """Called after a task of ``stage`` ran."""


class StaticSchedule:
    """Each stage follows a fixed order (:func:`gpipe` or :func:`one_f_one_b`)."""

    def __init__(self, name: str):
        if name not in ("gpipe", "1f1b"):
            raise ValueError(f"unknown static schedule {name!r}; choose one of {SCHEDULES}")
        self.name = name
        self._order: dict[int, list[Task]] = {}
        self._position: dict[int, int] = {}

    def start(self, local, stages, microbatches) -> None:
        self._order = {s: static_order(self.name, s, stages, microbatches) for s in local}
        self._position = {s: 0 for s in local}

    def pick(self, states, has_input, microbatches):
        for s in states:
            if self._position[s] < len(self._order[s]):
                kind, mb = self._order[s][self._position[s]]
                if has_input(s, kind, mb):
                    return s, kind, mb
        return None

    def ran(self, stage: int) -> None:
        self._position[stage] += 1


class MessageDriven:
    """AxoNN: run whichever task's input has arrived, backward first.

    Per pipeline rank (the stages on one device group): a backward whose
    gradient has arrived runs first, deepest stage first — except right after
    a backward, when a forward whose input has arrived runs (so a freed slot
    is refilled at once and downstream stages stay fed: AxoNN's injection
    rule on stage 0, 1F1B's alternation elsewhere). Forwards run in groups of
    ``pipeline`` microbatches, shallow stage first within a group (with
    virtual stages, the interleaved order: a group goes through a rank's first
    stage, then through its next one). Stage ``s`` keeps at most
    ``limit - s`` microbatches between forward and backward (at least one);
    with ``limit`` = the number of stages that is 1F1B's residual memory.

    Without the bounds on later stages, a forward that arrives a moment before
    a backward would run first and hold the backward (and with it stage 0's
    next injection) back by a whole task: with 4 stages, 16 microbatches and a
    message latency of 5% of a task, the idle fraction was 0.29 instead of
    1F1B's 0.19 (``tests/test_schedule_sim.py``). A ``limit`` above the number
    of stages absorbs message latency (the default, :func:`default_limit`,
    keeps one microbatch more: 0.164 there) at the cost of residuals in flight.

    Args:
        limit: the in-flight bound of stage 0 (``None``: no bound, e.g. forward-only passes).
        pipeline: pipeline ranks (stage ``s`` runs on rank ``s mod pipeline``);
            default: one stage per rank.
    """

    name = "message"

    def __init__(self, limit: int | None, pipeline: int | None = None):
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit  # None: no bound (forward-only passes keep no residuals)
        self.pipeline = pipeline
        self._stages = 1
        self._last: dict[int, str] = {}  # pipeline rank → kind of the last task it launched

    def start(self, local, stages, microbatches) -> None:
        self._stages = stages
        self._last = {}

    def in_flight_bound(self, stage: int) -> int | None:
        """Most microbatches ``stage`` keeps between forward and backward (``None``: no bound)."""
        return None if self.limit is None else max(self.limit - stage, 1)

    def _admits(self, s: int, st: StageView) -> bool:
        if self.limit is None or s == self._stages - 1:  # the last stage's forward runs its backward too
            return True
        return st.forwards - st.backwards < self.in_flight_bound(s)

    def pick(self, states, has_input, microbatches):
        ranks = self.pipeline or self._stages
        best = None
        for s, st in states.items():
            rank = s % ranks
            refill = self._last.get(rank) == "B"  # right after a backward: a forward first
            if st.forwards < microbatches and self._admits(s, st) and has_input(s, "F", st.forwards):
                mb = st.forwards
                key = (not refill, mb // ranks, s, mb)
                if best is None or key < best[0]:
                    best = (key, (s, "F", mb), rank)
            for mb in st.cotangents:
                if has_input(s, "B", mb):
                    key = (refill, -1, -s, mb)
                    if best is None or key < best[0]:
                        best = (key, (s, "B", mb), rank)
        if best is None:
            return None
        _, task, rank = best
        self._last[rank] = task[1]
        return task

    def ran(self, stage: int) -> None:
        pass


def default_limit(stages: int) -> int:
    """The message-driven schedule's default ``limit``: one microbatch more than 1F1B keeps.

    The extra microbatch absorbs message latency: with 4 stages, 16
    microbatches and messages taking 5% of a task, the idle fraction is 0.164
    against the theory's 0.158 (1F1B, or ``limit=stages``: 0.188), for one more
    microbatch of residuals per stage (``tests/test_schedule_sim.py``).

    >>> default_limit(4)
    5
    """
    return stages + 1


def make_schedule(name: str, *, limit: int | None, stages: int, pipeline: int | None = None) -> Schedule:
    """The schedule called ``name``; ``limit`` (message-driven) defaults to :func:`default_limit`.

    ``pipeline``: the pipeline ranks the ``stages`` run on (virtual stages: fewer ranks).
    """
    check_schedule(name)
    if name == "message":
        return MessageDriven(limit if limit is not None else default_limit(stages), pipeline)
    return StaticSchedule(name)

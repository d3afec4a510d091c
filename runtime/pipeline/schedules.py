"""Pipeline schedules: which task a stage runs next.

A :class:`~axonn_jax.runtime.pipeline.tasks.Task` is a forward or a backward
of one stage on one microbatch; on the last stage the forward also runs the
loss and backward, so it has only forward tasks. Zero-bubble schedules
(:attr:`Schedule.splits_weights`) split each backward into B (the input
gradient, which the previous stage waits for) and W (the weight gradients,
which only the optimizer waits for) and run W where a rank would idle:
:class:`ZeroBubble` (message-driven), ``"zb-h1"`` (static, :func:`zb_h1`) and,
on the V-shaped placement, ``"zb-v"`` (static, one order per rank:
:class:`ZeroBubbleV`, :func:`~axonn_jax.runtime.pipeline.zb_v.zb_v`). A :class:`Schedule` picks,
among the tasks whose input has arrived, the one the dispatch queue runs next. Static schedules
(:class:`StaticSchedule`: GPipe, 1F1B) fix each stage's order in advance; the
message-driven schedule (:class:`MessageDriven`, AxoNN) runs whichever task's
input has arrived, backward first, with stage ``s`` keeping at most
``limit - s`` microbatches in flight.

Example:
    >>> [f"{t.kind}{t.microbatch}" for t in one_f_one_b(stage=0, stages=2, microbatches=3)]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    >>> [f"{t.kind}{t.microbatch}" for t in gpipe(stage=1, stages=2, microbatches=2)]
    ['F0', 'F1']
    >>> [f"{t.kind}{t.microbatch}" for t in zb_h1(stage=0, stages=2, microbatches=3)]
    ['F0', 'F1', 'B0', 'W0', 'F2', 'B1', 'W1', 'B2', 'W2']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from axonn_jax.partitioner.grid import Grid, default_limit
from axonn_jax.runtime.pipeline.tasks import Task, TaskKind
from axonn_jax.runtime.pipeline.zb_v import v_stages, zb_v

F, B, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.WEIGHTS

#: every schedule's name; ``"zb"`` (message-driven), ``"zb-h1"`` and ``"zb-v"`` split B and W
SCHEDULES = ("message", "1f1b", "gpipe", "zb", "zb-h1", "zb-v")
STATIC = ("1f1b", "gpipe", "zb-h1")
SPLIT = ("zb", "zb-h1", "zb-v")


def check_schedule(name: str) -> str:
    """``name`` if it is one of :data:`SCHEDULES`, else a ``ValueError`` listing them."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    return name


def splits_weights(name: str) -> bool:
    """Whether schedule ``name`` runs B and W as separate tasks (zero bubble)."""
    return check_schedule(name) in SPLIT


def gpipe(stage: int, stages: int, microbatches: int) -> list[Task]:
    """All forwards, then all backwards (GPipe)."""
    forwards = [Task(stage, F, mb) for mb in range(microbatches)]
    if stage == stages - 1:
        return forwards
    return forwards + [Task(stage, B, mb) for mb in range(microbatches)]


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Task]:
    """Warm-up forwards, then one forward one backward, then the remaining backwards."""
    if stage == stages - 1:
        return [Task(stage, F, mb) for mb in range(microbatches)]
    warmup = min(stages - stage - 1, microbatches)
    order = [Task(stage, F, mb) for mb in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < microbatches:
        if next_f < microbatches:
            order.append(Task(stage, F, next_f))
            next_f += 1
        order.append(Task(stage, B, next_b))
        next_b += 1
    return order


def zb_h1(stage: int, stages: int, microbatches: int) -> list[Task]:
    """ZB-H1 (Qi et al., zero bubble at 1F1B's memory): 1F1B's order of forwards and B's, each
    stage's W of microbatch ``k`` right after its B of microbatch ``k + stage`` (the rest at the end).

    Stage ``s`` keeps ``s`` W's deferred, so in the cool-down, while the last
    B's travel back to stage 0 one B-time per stage, each stage fills the wait
    with its deferred W's: every stage ends at about the same time. The bubble
    is ``(p − 1)·(F + B − W)`` against 1F1B's ``(p − 1)·(F + B + W)``; a stage
    holds at most ``p − s`` microbatches of full residuals (1F1B's) plus ``s``
    W residuals.
    """
    lag = stage
    order: list[Task] = []
    next_w = 0
    for task in one_f_one_b(stage, stages, microbatches):
        order.append(task)
        is_b = task.kind is B or stage == stages - 1  # the last stage's forward runs its B too
        if is_b and task.microbatch >= lag:
            order.append(Task(stage, W, next_w))
            next_w += 1
    return order + [Task(stage, W, mb) for mb in range(next_w, microbatches)]


def static_order(name: str, stage: int, stages: int, microbatches: int) -> list[Task]:
    if name == "gpipe":
        return gpipe(stage, stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stage, stages, microbatches)
    if name == "zb-h1":
        return zb_h1(stage, stages, microbatches)
    raise ValueError(f"unknown static schedule {name!r}; choose one of {SCHEDULES}")


class StageView(Protocol):
    """What a schedule reads of one stage's progress in the dispatch queue."""

    forwards: int  # forwards done (the next forward is microbatch ``forwards``)
    backwards: int
    cotangents: Mapping  # microbatch → gradient arrived from the next stage
    deferred: Mapping  # split schedules: microbatch → what its B left for its W


#: ``has_input(task)``: the task's input has arrived (and, for a forward, its
#: microbatch is the stage's next one) and the stage's devices can take it
HasInput = Callable[[Task], bool]


class Schedule(Protocol):
    """Decides which ready task of this process's stages runs next.

    The dispatch queue calls :meth:`start` once per step, then :meth:`pick`
    whenever a task may run and :meth:`ran` after launching the picked task;
    it posts the receives of :meth:`in_flight_bound` ``(0)`` messages ahead
    per link (all of them when ``None``). A schedule that :attr:`splits_weights`
    also picks W tasks (the dispatch queue then runs B and W as two programs).
    """

    name: str
    splits_weights: bool  # B and W are separate tasks (zero-bubble schedules)

    def start(self, local: Sequence[int], stages: int, microbatches: int) -> None:
        """Called once at the start of a step."""

    def pick(self, states: Mapping[int, StageView], has_input: HasInput,
             microbatches: int) -> Task | None:  # fmt: skip
        """The next task, or ``None`` when none may run yet."""

    def ran(self, task: Task) -> None:
        """Called after ``task`` was launched."""

    def in_flight_bound(self, stage: int) -> int | None:
        """Most microbatches ``stage`` keeps between forward and backward (``None``: no bound)."""


class StaticSchedule:
    """Each stage follows a fixed order (:func:`gpipe`, :func:`one_f_one_b` or :func:`zb_h1`)."""

    def __init__(self, name: str):
        if name not in STATIC:
            raise ValueError(f"unknown static schedule {name!r}; choose one of {STATIC}")
        self.name = name
        self.splits_weights = name == "zb-h1"
        self._order: dict[int, list[Task]] = {}
        self._position: dict[int, int] = {}  # stage → index of its next task in its order

    def start(self, local, stages, microbatches) -> None:
        self._order = {s: static_order(self.name, s, stages, microbatches) for s in local}
        self._position = {s: 0 for s in local}

    def pick(self, states, has_input, microbatches):
        for key, order in self._order.items():
            if self._position[key] < len(order):
                task = order[self._position[key]]
                if has_input(task):
                    return task
        return None

    def ran(self, task: Task) -> None:
        self._position[self._key(task.stage)] += 1

    def _key(self, stage: int) -> int:
        """Which order ``stage``'s tasks are in (here: its own)."""
        return stage

    def in_flight_bound(self, stage: int) -> int | None:
        return None  # the order itself bounds what is in flight


class MessageDriven:
    """AxoNN: run whichever task's input has arrived, backward first.

    Per pipeline rank (the stages on one device group): a backward whose
    gradient has arrived runs first, deepest stage first — except right after
    a backward, when a forward whose input has arrived runs (so a freed slot
    is refilled at once and downstream stages stay fed: AxoNN's injection
    rule on stage 0, 1F1B's alternation elsewhere). Forwards run in groups of
    ``pipeline`` microbatches, shallow stage first within a group (with
    virtual stages, the interleaved order: a group goes through a rank's first
    stage, then through its next one); with the V-shaped placement the
    deeper stage's forward first (:meth:`_forward_order`). Stage ``s`` keeps at most
    ``limit - s`` microbatches between forward and backward (at least one);
    with ``limit`` = the number of stages that is 1F1B's residual memory.

    Without the bounds on later stages, a forward that arrives a moment before
    a backward would run first and hold the backward (and with it stage 0's
    next injection) back by a whole task: with 4 stages, 16 microbatches and a
    message latency of 5% of a task, the idle fraction was 0.29 instead of
    1F1B's 0.19 (``tests/test_schedule_sim.py``). A ``limit`` above the number
    of stages absorbs message latency (the default,
    :func:`~axonn_jax.partitioner.grid.default_limit`,
    keeps one microbatch more: 0.164 there) at the cost of residuals in flight.

    Args:
        limit: the in-flight bound of stage 0 (``None``: no bound, e.g. forward-only passes).
        pipeline: pipeline ranks (stage ``s`` runs on rank ``s mod pipeline``);
            default: one stage per rank.
        placement: the pipeline rank of each stage, stage 0 first
            (:attr:`Grid.placements <axonn_jax.partitioner.grid.Grid.placements>`,
            e.g. the V-shaped ``(0, 1, 1, 0)``); default: ``s mod pipeline``.
    """

    name = "message"
    splits_weights = False

    def __init__(self, limit: int | None, pipeline: int | None = None,
                 placement: Sequence[int] | None = None):  # fmt: skip
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit  # None: no bound (forward-only passes keep no residuals)
        self.pipeline = pipeline
        self.placement = None if placement is None else tuple(placement)
        ranks = len(set(self.placement or ()))
        self._deep_first = any(r != s % ranks for s, r in enumerate(self.placement or ()))
        self._stages = 1
        self._last: dict[int, TaskKind] = {}  # pipeline rank → kind of the last task it launched

    def start(self, local, stages, microbatches) -> None:
        self._stages = stages
        self._last = {}

    def in_flight_bound(self, stage: int) -> int | None:
        """Most microbatches ``stage`` keeps between forward and backward (``None``: no bound)."""
        return None if self.limit is None else max(self.limit - stage, 1)

    def rank(self, stage: int) -> int:
        """The pipeline rank ``stage`` runs on (its placement; default ``stage mod pipeline``)."""
        if self.placement is not None:
            return self.placement[stage]
        return stage % (self.pipeline or self._stages)

    def _admits(self, s: int, st: StageView) -> bool:
        if self.limit is None or s == self._stages - 1:  # the last stage's forward runs its backward too
            return True
        return st.forwards - st.backwards < self.in_flight_bound(s)

    def _forward_order(self, task: Task, ranks: int) -> tuple:
        """Which ready forward of a rank goes first: interleaved, groups of ``ranks``
        microbatches, shallow stage first within a group; any other placement (V-shaped),
        the deepest stage first, whose output heads for the loss (simulated at p=4, v=2,
        B = W = F/2: message-driven reaches (p−1)/(v·m+p−1) at m=4, 8, 16, where the group
        order idles 0.360 against 0.273 at m=4 and holds 11 stage-microbatches on a rank, not 9)."""
        if self._deep_first:
            return (-task.stage, task.microbatch)
        return (task.microbatch // ranks, task.stage, task.microbatch)

    def pick(self, states, has_input, microbatches):
        ranks = self.pipeline or self._stages
        best = None
        for s, st in states.items():
            rank = self.rank(s)
            refill = self._last.get(rank) is B  # right after a backward: a forward first
            if st.forwards < microbatches and self._admits(s, st):
                task = Task(s, F, st.forwards)
                key = (not refill, *self._forward_order(task, ranks))
                if (best is None or key < best[0]) and has_input(task):
                    best = (key, task, rank)
            for mb in st.cotangents:
                key = (refill, -1, -s, mb)
                if best is None or key < best[0]:
                    task = Task(s, B, mb)
                    if has_input(task):
                        best = (key, task, rank)
        if best is None:
            return None
        _, task, rank = best
        self._last[rank] = task.kind
        return task

    def ran(self, task: Task) -> None:
        pass


class ZeroBubble(MessageDriven):
    """Message-driven zero bubble: B as soon as its gradient arrives, W whenever nothing else is ready.

    Per pipeline rank: a B whose gradient has arrived or a forward, as
    :class:`MessageDriven` picks between them (B first, deepest stage first;
    right after a B, a forward whose input has arrived), and the oldest
    deferred W only when neither is ready. The *W budget* bounds what the
    deferral adds: a forward is held while the stage's forwards in flight plus
    deferred W's reach ``limit - s + budget``, and once a stage holds
    :attr:`w_first` deferred W's (``budget``; ``2·budget`` on the V-shaped
    placement) its oldest W runs before any forward of the rank (never before
    a B: a B turns a microbatch's full residuals into the smaller W
    residuals). Stage ``s`` thus holds at most ``limit - s`` microbatches
    between forward and B (:class:`MessageDriven`'s bound: 1F1B's memory at
    ``limit`` = stages) and ``limit - s + budget`` microbatches of residuals
    of either kind (the last stage, deferred W's only: ``w_first + 1``).

    Args:
        limit: as :class:`MessageDriven`.
        pipeline: as :class:`MessageDriven`.
        budget: most deferred W's per stage before W goes ahead of forwards;
            default: the pipeline ranks ``p`` (ZB-H1 defers ``s < p`` on stage
            ``s``; in the simulator a larger budget idles no less, a smaller
            one more: p=4, m=16, budget 2: 0.111 against 0.086).
        w_first: deferred W's of a stage that put W ahead of the rank's forwards;
            default ``budget``, on the V ``2·budget`` (:meth:`default_w_first`).
    """

    name = "zb"
    splits_weights = True

    def __init__(self, limit: int | None, pipeline: int | None = None, budget: int | None = None,
                 placement: Sequence[int] | None = None, w_first: int | None = None):  # fmt: skip
        super().__init__(limit, pipeline, placement)
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be >= 1 deferred W per stage, got {budget}")
        if w_first is not None and w_first < 1:
            raise ValueError(f"w_first must be >= 1 deferred W per stage, got {w_first}")
        self._budget, self._w_first = budget, w_first

    @property
    def budget(self) -> int:
        return self._budget if self._budget is not None else (self.pipeline or self._stages)

    @property
    def w_first(self) -> int:
        """Deferred W's of one stage that put the rank's oldest W ahead of its forwards."""
        return self._w_first if self._w_first is not None else self.default_w_first()

    def default_w_first(self) -> int:
        """``budget``; on the V ``2·budget``: there a forward of either stage heads on to the
        loss (the up stage directly, the down stage through the turn), so a W put ahead of it
        delays the cool-down's critical path, and a rank's wait in the cool-down runs down and
        back up the V. Simulated at the benchmark's task shares (p = 4, m = 8: ``budget`` idles
        0.149, 0.192 with a message latency of 1% of a task; ``2·budget`` the floor, 0.086; the
        memory bound ``limit − s + budget`` holds either way): docs/pipeline.md."""
        return 2 * self.budget if self._deep_first else self.budget

    def _admits(self, s: int, st: StageView) -> bool:
        if not super()._admits(s, st):
            return False
        if self.limit is None or s == self._stages - 1:  # the last stage: pick's w_first rule bounds it
            return True
        return st.forwards - st.backwards + len(st.deferred) < self.in_flight_bound(s) + self.budget

    def pick(self, states, has_input, microbatches):
        task = super().pick(states, has_input, microbatches)  # a B or a forward
        if task is not None:
            rank = self.rank(task.stage)
            if task.kind is B or all(len(st.deferred) < self.w_first
                                     for s, st in states.items() if self.rank(s) == rank):  # fmt: skip
                return task
            mine = {s: st for s, st in states.items() if self.rank(s) == rank}  # W ahead of the forward
            ready_b = [t for s, st in mine.items() for mb in st.cotangents if has_input(t := Task(s, B, mb))]
            if ready_b:  # ... but never ahead of a B (the refill rule had put the forward first)
                b = min(ready_b, key=lambda t: (-t.stage, t.microbatch))
                self._last[rank] = B
                return b
        else:
            mine = states  # nothing else is ready: any rank's W
        weights = [t for s, st in mine.items() if st.deferred and has_input(t := Task(s, W, min(st.deferred)))]
        if not weights:
            return task
        w = min(weights, key=lambda t: (-len(states[t.stage].deferred), t.microbatch, t.stage))
        self._last[self.rank(w.stage)] = W
        return w


class ZeroBubbleV(StaticSchedule):
    """ZB-V: on the V-shaped placement each pipeline rank follows one order over its two
    stages (:func:`~axonn_jax.runtime.pipeline.zb_v.zb_v`), B and W split.

    Args:
        placement: the pipeline rank of each stage; must be the V
            (``Grid(pipeline=p, virtual=2, placement="v").placements``).
    """

    def __init__(self, placement: Sequence[int] | None):
        stages = len(placement or ())
        v_shaped = Grid(pipeline=stages // 2, virtual=2, placement="v").placements if stages >= 4 else None
        if stages % 2 or tuple(placement or ()) != v_shaped:
            raise ValueError(
                f"schedule 'zb-v' runs on the V-shaped placement (rank r holds stages r and 2p-1-r), "
                f"got stage ranks {None if placement is None else tuple(placement)}. Remedy: "
                f"Grid(pipeline=p, virtual=2, placement='v'), or schedule 'zb' / 'zb-h1' on this grid."
            )
        self.name = "zb-v"
        self.splits_weights = True
        self.placement = tuple(placement)
        self._order = {}
        self._position = {}

    def start(self, local, stages, microbatches) -> None:
        p = stages // 2
        ranks = sorted({self.placement[s] for s in local})
        self._order = {r: zb_v(r, p, microbatches) for r in ranks}
        self._position = {r: 0 for r in ranks}

    def _key(self, stage: int) -> int:
        return self.placement[stage]


def make_schedule(name: str, *, limit: int | None, stages: int, pipeline: int | None = None,
                  placement: Sequence[int] | None = None) -> Schedule:  # fmt: skip
    """The schedule called ``name``; ``limit`` (message-driven) defaults to
    :func:`~axonn_jax.partitioner.grid.default_limit`.

    ``pipeline``: the pipeline ranks the ``stages`` run on (virtual stages: fewer ranks);
    ``placement``: the rank of each stage (default ``s mod pipeline``; the static
    schedules follow each stage's own order wherever it runs; ``"zb-v"`` needs the V and
    follows one order per rank).
    """
    check_schedule(name)
    if name == "message":
        return MessageDriven(limit if limit is not None else default_limit(stages), pipeline, placement)
    if name == "zb":
        return ZeroBubble(limit if limit is not None else default_limit(stages), pipeline, placement=placement)
    if name == "zb-v":
        return ZeroBubbleV(placement)
    return StaticSchedule(name)

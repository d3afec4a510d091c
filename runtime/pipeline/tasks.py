"""The pipeline's vocabulary: task kinds, tasks, messages, and what a run of the queue returns.

A *task* is one program of one stage on one microbatch; a *message* is the
input a task waits for from a neighbouring stage (activations for a forward,
gradients for a backward). Schedules order tasks
(:mod:`~axonn_jax.runtime.pipeline.schedules`), the dispatch queue runs them
(:mod:`~axonn_jax.runtime.pipeline.dispatch`) and the transport moves messages
(:mod:`~axonn_jax.runtime.pipeline.transport`). A run of the queue returns a
:class:`TrainingRun` (gradients) or a :class:`ForwardRun` (outputs), both
with the :class:`TaskRecord` of every task it ran.

Example:
    >>> Task(0, TaskKind.FORWARD, 3)
    Task(stage=0, kind=F, microbatch=3)
    >>> Message(TaskKind.BACKWARD, 1, 3).link   # the gradient stage 1 awaits from stage 2
    (B, 1)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping


class TaskKind(enum.Enum):
    """What a task computes (its value is the short label traces show)."""

    FORWARD = "F"  #: a stage's forward, keeping the residuals for its backward
    #: a stage's backward: parameter gradients and the gradient of its inputs (split
    #: schedules: the gradient of its inputs only, leaving W its residuals)
    BACKWARD = "B"
    #: the last stage's forward task when training: forward, loss and backward in one program
    #: (split schedules: its B part only)
    FORWARD_BACKWARD = "FB"
    #: split schedules (zero bubble): a stage's weight gradients, from what its B left
    WEIGHTS = "W"

    def __repr__(self) -> str:
        return self.value

    __str__ = __repr__


@dataclasses.dataclass(frozen=True)
class Task:
    """One program of one stage on one microbatch (schedules pick these)."""

    stage: int
    kind: TaskKind
    microbatch: int


@dataclasses.dataclass(frozen=True)
class Message:
    """The input of task ``(stage, kind, microbatch)`` from a neighbouring stage.

    ``FORWARD``: activations from ``stage - 1``; ``BACKWARD``: gradients from
    ``stage + 1``. The messages of one :attr:`link` are sent and received in
    microbatch order.
    """

    kind: TaskKind
    stage: int  # the destination
    microbatch: int

    @property
    def link(self) -> tuple[TaskKind, int]:
        """``(kind, destination stage)``: the messages that travel the same way."""
        return self.kind, self.stage


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    """One executed task (times in seconds since the run started)."""

    stage: int
    kind: TaskKind
    microbatch: int
    start: float
    end: float
    wait: float  # idle time of this stage's devices just before the task


@dataclasses.dataclass(frozen=True)
class QueueRun:
    """What every run of the dispatch queue records (:mod:`~axonn_jax.runtime.pipeline.timeline`)."""

    records: tuple[TaskRecord, ...]
    #: stage → most microbatches holding residuals at once (a deferred W's residuals count too)
    peak_in_flight: Mapping[int, int]
    origin: float  # wall-clock time (time.time()) of the run's start
    #: stage → most bytes per device held at once in residuals awaiting B and, in split
    #: (zero-bubble) schedules, the inputs B left for a deferred W
    peak_held_bytes: Mapping[int, int]


@dataclasses.dataclass(frozen=True)
class TrainingRun(QueueRun):
    """A training run: the last stage's loss per microbatch and each local stage's sums."""

    losses: tuple  # per microbatch (on the process of the last stage; empty elsewhere)
    grads: Mapping[int, list]  # local stage → its trained parameters' gradients, summed
    updates: Mapping[int, list]  # local stage → its model-state updates, summed over microbatches


@dataclasses.dataclass(frozen=True)
class ForwardRun(QueueRun):
    """A forward-only run: the model outputs per microbatch and each local stage's state updates."""

    outputs: tuple  # per microbatch: the last stage's output leaves (empty elsewhere)
    updates: Mapping[int, list]  # local stage → its model-state updates, summed over microbatches

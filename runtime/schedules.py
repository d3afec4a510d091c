"""Pipeline schedules: which task a stage runs next.

A task is ``("F", mb)`` (forward of microbatch ``mb``) or ``("B", mb)``
(backward); on the last stage the forward also runs the loss and backward, so
it has only ``F`` tasks. Static schedules fix each stage's order in advance;
the message-driven schedule (AxoNN) runs whichever task's input has arrived,
backward first, with stage 0 keeping at most ``limit`` microbatches in flight.

Example:
    >>> one_f_one_b(stage=0, stages=2, microbatches=3)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    >>> gpipe(stage=1, stages=2, microbatches=2)
    [('F', 0), ('F', 1)]
"""

from __future__ import annotations

Task = tuple[str, int]

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

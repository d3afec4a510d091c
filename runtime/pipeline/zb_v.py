"""ZB-V (Qi et al., zero bubble on a V): one pipeline rank's static order of F, B and W tasks.

On the V-shaped placement (``Grid(pipeline=p, virtual=2, placement="v")``)
rank ``r`` holds the *down* stage ``r`` and the *up* stage ``2p − 1 − r``; a
microbatch goes down the V through ranks ``0 … p − 1`` and back up to rank 0,
whose up stage is the last (its forward task is forward + loss + B). The
order, per rank (the pattern of the published ZB-V, as torchtitan's
``ScheduleZBVZeroBubble``):

* warm-up: ``2(p − r) − 1`` down forwards, then ``r`` pairs (up forward, down
  forward), then ``p − r`` rounds of (up forward, its B, its W);
* steady state: (down F, down B, down W, up F, up B, up W) until every forward ran;
* cool-down: ``r`` pairs of (down B, up B) with their W's deferred, then
  ``p − r`` rounds of (down B, the oldest deferred down W), then the deferred
  up W's and the remaining down W's — W fills the time the last gradients
  take to travel back.

With ``F = B = W`` per stage and ``m ≥ 2p − 1`` no rank waits once its first
forward arrived: the step is the zero-bubble floor, ``(p − 1)·F/2`` of warm-up
plus the work, at 1F1B's memory (a rank holds at most ``min(2m, 2p)``
stage-microbatches between forward and B: ``tests/test_schedule_sim.py``).
With fewer microbatches the order is built for ``2p − 1`` and the tasks of
the missing microbatches are dropped (what stays is still a valid order).

Example:
    >>> [f"{t.stage}{t.kind}{t.microbatch}" for t in zb_v(1, pipeline=2, microbatches=3)]  # doctest: +NORMALIZE_WHITESPACE
    ['1F0', '2F0', '1F1', '2F1', '2B0', '2W0', '1F2', '1B0', '1W0', '2F2', '2B1', '2W1',
     '1B1', '2B2', '1B2', '1W1', '2W2', '1W2']
"""

from __future__ import annotations

from axonn_jax.runtime.pipeline.tasks import Task, TaskKind

F, B, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.WEIGHTS


def v_stages(rank: int, pipeline: int) -> tuple[int, int]:
    """The (down, up) stages of ``rank`` on the V: ``rank`` and ``2p − 1 − rank``."""
    return rank, 2 * pipeline - 1 - rank


def zb_v(rank: int, pipeline: int, microbatches: int) -> list[Task]:
    """Rank ``rank``'s ZB-V order (module docstring); the last stage (rank 0's up stage) has
    no B task (its forward runs it), only its W."""
    p, m = pipeline, microbatches
    n = max(m, 2 * p - 1)
    stages = v_stages(rank, p)
    last = 2 * p - 1
    order: list[Task] = []
    forwards, backwards, weights = [0, 0], [0, 0], [0, 0]  # per chunk: 0 down, 1 up

    def forward(chunk: int) -> None:
        order.append(Task(stages[chunk], F, forwards[chunk]))
        forwards[chunk] += 1

    def backward(chunk: int, *, then_w: bool) -> None:
        s, mb = stages[chunk], backwards[chunk]
        if s != last:
            order.append(Task(s, B, mb))
        backwards[chunk] += 1
        if then_w:
            weight(chunk)

    def weight(chunk: int) -> None:
        order.append(Task(stages[chunk], W, weights[chunk]))
        weights[chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        forward(0)
    for _ in range(rank):
        forward(1)
        forward(0)
    for _ in range(p - rank):
        forward(1)
        backward(1, then_w=True)
    while forwards[1] < forwards[0] or forwards[0] < n:
        if forwards[0] < n:
            forward(0)
        backward(0, then_w=True)
        forward(1)
        backward(1, then_w=True)
    for _ in range(rank):
        backward(0, then_w=False)
        backward(1, then_w=False)
    for _ in range(p - rank):
        backward(0, then_w=False)
        weight(0)
    while weights[1] < backwards[1]:
        weight(1)
    while weights[0] < backwards[0]:
        weight(0)
    return [t for t in order if t.microbatch < m]

"""Pipeline traces: Chrome/Perfetto JSON, a PNG timeline, idle (bubble) fractions.

Every rank's dispatch queue records its tasks
(:class:`~axonn_jax.runtime.pipeline.dispatch.TaskRecord`); :func:`gather` brings them
to rank 0 (through the host collectives when the job has several processes), stamped with each
rank's wall-clock start so ranks line up.

Example:
    >>> rows = gather(result)                                   # doctest: +SKIP
    >>> write_chrome_trace("trace.json", rows)                  # doctest: +SKIP
    >>> plot_timeline("timeline.png", rows)                     # doctest: +SKIP
    >>> idle_fractions(rows)                                    # doctest: +SKIP
    {0: 0.21, 1: 0.20}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

#: one executed task: (rank, stage, kind, microbatch, start s, end s, wait s)
Row = tuple[int, int, str, int, float, float, float]


#: what each task kind's label means in traces and plots
KIND_NAMES = {"F": "forward", "B": "backward", "FB": "forward+loss+backward", "W": "weight gradients"}


def rows_of(result, rank: int = 0, origin: float | None = None) -> list[Row]:
    """The records of one run of the queue (a :class:`~axonn_jax.runtime.pipeline.tasks.QueueRun`),
    times shifted by its wall-clock origin; kinds as their labels ("F", "B", "FB")."""
    shift = result.origin if origin is None else origin
    return [(rank, r.stage, r.kind.value, r.microbatch, r.start + shift, r.end + shift, r.wait)
            for r in result.records]  # fmt: skip


def gather(result, comm=None) -> list[Row] | None:
    """All ranks' rows on rank 0 (``None`` elsewhere); without ``comm``: this rank's rows.

    ``comm``: the job's :class:`~axonn_jax.runtime.collectives.HostCollectives`.
    """
    import jax

    rank = jax.process_index()
    mine = rows_of(result, rank)
    if comm is None:
        return mine
    parts = comm.gather([tuple(map(_plain, row)) for row in mine], root=0)
    return None if parts is None else [row for part in parts for row in part]


def _plain(value):
    return value if isinstance(value, str) else (float(value) if isinstance(value, float) else int(value))


def _zero(rows: Sequence[Row]) -> float:
    return min(r[4] for r in rows) if rows else 0.0


def chrome_trace(rows: Sequence[Row]) -> dict:
    """Chrome trace-event JSON (open in Perfetto or chrome://tracing): pid = rank, tid = stage."""
    zero = _zero(rows)
    events = []
    for rank, stage, kind, mb, start, end, wait in rows:
        name = KIND_NAMES[kind]
        events.append({
            "name": f"{kind}{mb}", "cat": name, "ph": "X", "pid": rank, "tid": stage,
            "ts": (start - zero) * 1e6, "dur": max(end - start, 0.0) * 1e6,
            "args": {"microbatch": mb, "stage": stage, "wait_ms": wait * 1e3},
        })  # fmt: skip
    for rank in sorted({r[0] for r in rows}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, rows: Sequence[Row]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(rows)))
    return path


#: how rows are grouped: ``None`` per stage; an int ``p``: per pipeline rank ``s mod p``;
#: a sequence: per pipeline rank, the rank of each stage (``Grid.placements``, e.g. V-shaped)
Ranks = int | Sequence[int] | None


def _rank_of(pipeline: Ranks) -> Callable[[int], int]:
    """Stage → the row it counts for (see :data:`Ranks`)."""
    if pipeline is None:
        return lambda s: s
    if isinstance(pipeline, int):
        return lambda s: s % pipeline
    placement = tuple(pipeline)
    return lambda s: placement[s]


def idle_fractions(rows: Sequence[Row], pipeline: Ranks = None) -> dict[int, float]:
    """Per stage: the fraction of the step's span (first start → last end) it was idle.

    With ``pipeline`` (the grid's pipeline size): per pipeline rank instead,
    stage ``s`` counting for rank ``s mod pipeline`` — with virtual stages
    several stages share one rank's devices, and it is the devices that idle.
    Without virtual stages both are the same. Another placement (V-shaped):
    pass each stage's rank (``grid.placements``).
    """
    if not rows:
        return {}
    begin, finish = _zero(rows), max(r[5] for r in rows)
    span = max(finish - begin, 1e-12)
    busy: dict[int, float] = {}
    row_of = _rank_of(pipeline)
    for _, stage, _, _, start, end, _ in rows:
        key = row_of(stage)
        busy[key] = busy.get(key, 0.0) + (end - start)
    return {key: 1.0 - b / span for key, b in sorted(busy.items())}


def concurrent_seconds(rows: Sequence[Row]) -> float:
    """Seconds during which tasks of at least two different stages ran at the same time.

    >>> concurrent_seconds([(0, 0, "F", 0, 0.0, 2.0, 0.0), (0, 1, "FB", 0, 1.0, 3.0, 0.0)])
    1.0
    """
    events = sorted([(r[4], 1, r[1]) for r in rows] + [(r[5], -1, r[1]) for r in rows])
    running: dict[int, int] = {}
    both, previous = 0.0, None
    for t, change, stage in events:
        if previous is not None and sum(1 for n in running.values() if n > 0) >= 2:
            both += t - previous
        running[stage] = running.get(stage, 0) + change
        previous = t
    return both


def bubble_theory(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a balanced pipeline of ``stages`` ranks, (p − 1)/(v·m + p − 1).

    ``virtual`` stages per rank shorten each stage v-fold, so the fill and drain
    take (p − 1)/v of a microbatch's time instead of p − 1.

    Example:
        >>> bubble_theory(4, 16), bubble_theory(4, 16, virtual=2)
        (0.15789473684210525, 0.08571428571428572)
    """
    return (stages - 1) / (virtual * microbatches + stages - 1)


def zero_bubble_floor(pipeline: int, microbatches: int, virtual: int = 1, *, forward: float = 1.0,
                      backward: float = 1.0) -> float:  # fmt: skip
    """The least idle fraction of any schedule: the last rank waits for the first forward.

    A forward takes ``forward/v`` per stage, a backward (B + W) ``backward/v``;
    every rank does ``m·(forward + backward)`` of work and the last one cannot
    start before ``(p − 1)·forward/v``. Zero-bubble schedules fill everything
    else (the message-driven one reaches this floor in ``tests/schedule_sim.py``).

    Example:
        >>> round(zero_bubble_floor(4, 16), 4), round(zero_bubble_floor(4, 16, forward=1, backward=2), 4)
        (0.0857, 0.0588)
    """
    warmup = (pipeline - 1) * forward / virtual
    return warmup / (warmup + microbatches * (forward + backward))


def zb_h1_theory(pipeline: int, microbatches: int, *, forward: float = 1.0, b: float = 0.5,
                 w: float = 0.5) -> float:  # fmt: skip
    """ZB-H1's idle fraction (one stage per rank): a bubble of ``(p − 1)·(F + B − W)``
    against 1F1B's ``(p − 1)·(F + B + W)`` (a third of it when F = B = W).

    Example:
        >>> round(zb_h1_theory(4, 16, b=1, w=1), 4), round(bubble_theory(4, 16), 4)
        (0.0588, 0.1579)
    """
    bubble = (pipeline - 1) * (forward + b - w)
    return bubble / (bubble + microbatches * (forward + b + w))


def zb_v_theory(pipeline: int, microbatches: int) -> float:
    """ZB-V's idle fraction (:func:`~axonn_jax.runtime.pipeline.zb_v.zb_v`, ``virtual=2`` on
    the V) with ``F = B = W`` per stage, in units of one stage's forward ``f``.

    A rank's work is ``6m`` (two stages, F + B + W each). With ``m ≥ 2p − 1`` no rank
    waits after its first forward arrives (ranks r > 0 wait ``r·f`` for it, and W
    fills the cool-down): the step is the floor, ``p − 1 + 6m``
    (:func:`zero_bubble_floor`). With fewer microbatches the order's critical path is
    ``4p + 4m − 2`` (found with ``tests/schedule_sim.py``: exact for p = 2…8,
    m = 1…40, not derived by hand). The step is the larger of the two.

    Example:
        >>> round(zb_v_theory(4, 16), 4), round(zero_bubble_floor(4, 16, 2, backward=2), 4)
        (0.0303, 0.0303)
        >>> round(zb_v_theory(4, 4), 4)
        0.2
    """
    p, m = pipeline, microbatches
    return 1 - 6 * m / max(p - 1 + 6 * m, 4 * p + 4 * m - 2)


def plot_timeline(path: str | Path, rows: Sequence[Row], title: str = "pipeline timeline",
                  pipeline: Ranks = None) -> Path:  # fmt: skip
    """A PNG with one row per stage: forward, backward and (last stage) forward+loss+backward
    tasks in three colours, labelled by microbatch; the legend sits below the axes.

    With ``pipeline``: one row per pipeline rank (virtual stages share a row,
    each task labelled ``stage:microbatch``).
    """
    import matplotlib.pyplot as plt

    fig = timeline_figure(rows, title, pipeline)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_figure(rows: Sequence[Row], title: str = "pipeline timeline",
                    pipeline: Ranks = None):  # fmt: skip
    """The matplotlib figure of :func:`plot_timeline` (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    zero = _zero(rows)
    row_of = _rank_of(pipeline)
    lanes = sorted({row_of(r[1]) for r in rows})
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(lanes) + 1.8), layout="constrained")
    colours = {"F": "#4c78a8", "B": "#f58518", "FB": "#54a24b", "W": "#b279a2"}
    for rank, stage, kind, mb, start, end, _ in rows:
        y = lanes.index(row_of(stage))
        ax.broken_barh([((start - zero) * 1e3, (end - start) * 1e3)], (y - 0.4, 0.8),
                       facecolors=colours[kind], edgecolors="white", linewidth=0.5)  # fmt: skip
        label = str(mb) if pipeline is None else f"{stage}:{mb}"
        ax.text((start + end - 2 * zero) * 500, y, label, ha="center", va="center",
                fontsize=7, color="white")  # fmt: skip
    name = "stage" if pipeline is None else "rank"
    ax.set_yticks(range(len(lanes)), [f"{name} {s}" for s in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    idle = idle_fractions(rows, pipeline)
    ax.set_title(f"{title} — idle " + ", ".join(f"{name[0]}{s} {f:.0%}" for s, f in idle.items()))
    fig.legend(handles=[Patch(color=c, label=KIND_NAMES[k]) for k, c in colours.items()],
               loc="outside lower center", ncol=3, fontsize=7, frameon=False)  # fmt: skip
    return fig

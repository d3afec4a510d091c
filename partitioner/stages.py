"""Pipeline stages: contiguous ranges of the model's equations, cut where the slowest is fastest. Pure.

:func:`cut_points` lists where the model can be cut: one place between each
two consecutive equations that use parameters (so every stage holds
parameters) — there, the boundary where the fewest activation bytes cross —
each with the compute before it and the bytes crossing it. No boundary is
filtered out by its size: :func:`~axonn_jax.partitioner.balance.choose_cuts`
prices every stage as its compute plus its boundary transfers (a machine
profile's rates, :class:`~axonn_jax.partitioner.balance.StageCosts`) and picks
the cuts that make the slowest stage fastest, so a cut through the middle of
an attention costs the bytes it would send. With virtual (interleaved)
stages the same choice cuts ``pipeline·virtual`` stages; which rank runs each
is the grid's business (:meth:`~axonn_jax.partitioner.grid.Grid.pipeline_rank`).

``stages=[regex, ...]`` (explicit boundaries) cut right before the first
equation that uses a matching parameter, or are refused with the reason.
Updated model state (BatchNorm statistics) never travels between stages (it
stays on the stage that computes it), so it is not counted as crossing.

Example:
    >>> split = plan_stages(traced, jaxpr, 2)                  # doctest: +SKIP
    >>> [s.params[:2] for s in split.stages]                   # doctest: +SKIP
    [('block_0/...', ...), ('block_2/...', ...)]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.balance import CutPoint, StageCosts, choose_cuts, stage_times
from axonn_jax.partitioner.flops import equation_flops


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: equations ``[start, stop)`` of the inlined jaxpr.

    ``compute_seconds`` and ``transfer_seconds`` are the modelled time of one
    microbatch's forward and backward on one of the stage's devices
    (:mod:`~axonn_jax.partitioner.balance`).
    """

    index: int
    start: int
    stop: int
    flops: float  # forward FLOPs of one batch
    param_bytes: int
    params: tuple[str, ...]
    send_bytes: int  # activation bytes sent to the next stage per batch (0 for the last)
    compute_seconds: float = 0.0
    transfer_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.transfer_seconds


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """The stages and how they were cut: by ``costs`` (``boundaries`` None) or by ``stages=``."""

    stages: tuple[Stage, ...]
    costs: StageCosts
    boundaries: tuple[str, ...] | None = None
    notes: tuple[str, ...] = ()


def _nbytes(var) -> int:
    aval = var.aval
    return int(math.prod(aval.shape)) * aval.dtype.itemsize  # PRNG key dtypes too


def param_origins(jaxpr, num_params: int) -> dict:
    """Variable → parameter index, for parameters and their cast/reshape/broadcast chains."""
    origin = {v: i for i, v in enumerate(jaxpr.invars[:num_params])}
    for eqn in jaxpr.eqns:
        live = [v for v in eqn.invars if not R.is_literal(v)]
        follows = eqn.primitive.name in R.LAYOUT_PRESERVING or is_layer_range(eqn)
        if follows and len(live) == 1 and live[0] in origin:
            origin[eqn.outvars[0]] = origin[live[0]]
    return origin


def param_like_producers(jaxpr, num_params: int) -> dict:
    """Variables computed from parameters/constants alone (casts, reshapes, broadcasts)
    → the equation computing them. Such chains travel with their parameter: each
    pipeline stage re-runs them, and the executor runs them when first needed."""
    roots = set(jaxpr.invars[:num_params]) | set(jaxpr.constvars)
    made_by: dict = {}
    for eqn in jaxpr.eqns:
        live = [v for v in eqn.invars if not R.is_literal(v)]
        follows = eqn.primitive.name in R.LAYOUT_PRESERVING or is_layer_range(eqn)
        if follows and live and all(v in roots for v in live):
            roots.update(eqn.outvars)
            made_by.update((v, eqn) for v in eqn.outvars)
    return made_by


def is_layer_range(eqn) -> bool:
    """A ``slice`` along dim 0 only: the layers of a stacked parameter one pipeline stage
    runs (``partitioner.scan_cuts``); like a cast, it travels with the parameter."""
    if eqn.primitive.name != "slice":
        return False
    shape = R.shape_of(eqn.invars[0])
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    return tuple(start[1:]) == (0,) * (len(shape) - 1) and tuple(limit[1:]) == shape[1:] \
        and not any(s != 1 for s in (eqn.params.get("strides") or ()))  # fmt: skip


def _param_consumers(jaxpr, num_params: int) -> dict[int, list[int]]:
    """Param index → equations that use it (through casts/reshapes/broadcasts)."""
    origin = param_origins(jaxpr, num_params)
    users: dict[int, list[int]] = {i: [] for i in range(num_params)}
    for k, eqn in enumerate(jaxpr.eqns):
        live = [v for v in eqn.invars if not R.is_literal(v)]
        sources = {origin[v] for v in live if v in origin}
        chain = eqn.primitive.name in R.LAYOUT_PRESERVING or is_layer_range(eqn)
        if not sources or (chain and len(live) == 1):
            continue  # no parameter, or a parameter's own cast/reshape chain
        for p in sources:
            users[p].append(k)
    return users


def crossing_bytes(jaxpr, num_params: int, state_outputs: Sequence[tuple[int, int]] = (),
                   *, floating: bool = False, elements: bool = False) -> np.ndarray:  # fmt: skip
    """Bytes of activations alive across the boundary after each equation.

    Parameters and their cast chains do not cross (each stage re-runs them),
    nor do the model outputs at ``state_outputs`` positions (updated model
    state stays on the stage computing it). ``floating=True`` counts only
    floating values: those whose gradients cross back in the backward pass.
    ``elements=True`` counts their elements instead of their bytes.
    """
    size = (lambda v: math.prod(v.aval.shape)) if elements else _nbytes  # noqa: E731
    n = len(jaxpr.eqns)
    param_like = set(param_like_producers(jaxpr, num_params))
    param_like.update(jaxpr.invars[:num_params], jaxpr.constvars)
    defined = {v: -1 for v in jaxpr.invars[num_params:]}
    last_use: dict = {}
    for k, eqn in enumerate(jaxpr.eqns):
        live = [v for v in eqn.invars if not R.is_literal(v)]
        if eqn.outvars and eqn.outvars[0] in param_like:
            continue  # a parameter's cast/reshape travels with it
        for v in live:
            last_use[v] = k
        for v in eqn.outvars:
            defined[v] = k
    state = {k for k, _ in state_outputs}
    for k, v in enumerate(jaxpr.outvars):
        if not R.is_literal(v) and k not in state:
            last_use[v] = n
    diff = np.zeros(n + 1, dtype=np.int64)
    for v, start in defined.items():
        end = last_use.get(v)
        if end is None or v in param_like or end <= max(start, 0):
            continue
        if floating and not jnp.issubdtype(v.aval.dtype, jnp.inexact):
            continue
        lo = max(start, 0)
        diff[lo] += size(v)
        diff[end] -= size(v)
    return np.cumsum(diff)[:n]


def cut_points(jaxpr, num_params: int, flops: np.ndarray, seconds: np.ndarray,
               state_outputs: Sequence[tuple[int, int]] = ()) -> list[CutPoint]:  # fmt: skip
    """Where the inlined ``jaxpr`` can be cut, in model order, with what each cut costs.

    One point between each two consecutive equations that use parameters
    (through their cast chains): the boundary there with the fewest crossing
    bytes (the earliest on ties). ``flops`` and ``seconds`` hold each
    equation's forward FLOPs (:func:`~axonn_jax.partitioner.flops.equation_flops`)
    and compute time
    (:meth:`~axonn_jax.partitioner.balance.StageCosts.equation_seconds`).
    """
    users = _param_consumers(jaxpr, num_params)
    used = sorted({k for ks in users.values() for k in ks})
    crossing = crossing_bytes(jaxpr, num_params, state_outputs)
    floating = crossing_bytes(jaxpr, num_params, state_outputs, floating=True)
    flops_before = np.concatenate([[0.0], np.cumsum(flops)])
    seconds_before = np.concatenate([[0.0], np.cumsum(seconds)])
    points = []
    for a, b in zip(used, used[1:]):
        k = a + int(np.argmin(crossing[a:b]))
        points.append(CutPoint(k, float(seconds_before[k + 1]), float(flops_before[k + 1]),
                               int(crossing[k]), int(floating[k])))  # fmt: skip
    return points


def plan_stages(
    traced,
    jaxpr,
    num_stages: int,
    *,
    boundaries: Sequence[str] | None = None,
    costs: StageCosts = StageCosts(),
    devices: int = 1,
    where: str = "",
) -> StagePlan:
    """Split the inlined ``jaxpr`` of ``traced`` into ``num_stages`` stages.

    Args:
        boundaries: optional ``num_stages - 1`` parameter-path regexes; stage
            k+1 starts right before the first equation that uses a parameter
            matching ``boundaries[k]``.
        costs: the rates stages are priced with (:mod:`~axonn_jax.partitioner.balance`).
        devices: devices of one stage (``grid.stage_size``): its work and its
            messages are split over them.
        where: what is being split, for error messages (e.g. ``"GPT on
            Grid(..., pipeline=2, virtual=2)"``).
    """
    n_params = traced.num_params
    eqns = jaxpr.eqns
    flops = np.array([equation_flops(e) for e in eqns], dtype=np.float64)
    seconds = np.array([costs.equation_seconds(e, devices) for e in eqns], dtype=np.float64)
    users = _param_consumers(jaxpr, n_params)
    holders = _returned_by_last_stage(traced, jaxpr, users)  # which stages hold each parameter
    points = cut_points(jaxpr, n_params, flops, seconds, traced.state_outputs)
    if num_stages == 1 and not boundaries:
        return StagePlan(_stages(traced, flops, seconds, holders, [], costs, devices), costs)
    if boundaries is not None:
        cuts = _explicit_cuts(traced, users, points, boundaries, num_stages, where)
        return StagePlan(_stages(traced, flops, seconds, holders, cuts, costs, devices), costs, tuple(boundaries))
    if len(points) < num_stages - 1:
        raise ValueError(
            f"{where + ': ' if where else ''}the model has {len(points)} layer boundaries "
            f"where it can be cut, fewer than the {num_stages - 1} needed for {num_stages} "
            f"pipeline stages (pipeline × virtual). Remedy: at most {len(points) + 1} "
            "stages (fewer virtual stages per rank, or a smaller pipeline), or a deeper model."
        )
    cuts = choose_cuts(points, float(seconds.sum()), num_stages, costs, devices,
                       total_flops=float(flops.sum()))  # fmt: skip
    stages = _stages(traced, flops, seconds, holders, cuts, costs, devices)
    by_flops = choose_cuts([dataclasses.replace(p, seconds_before=p.flops_before) for p in points],
                           float(flops.sum()), num_stages,
                           dataclasses.replace(costs, link_gbps=math.inf, latency_us=0.0))  # fmt: skip
    return StagePlan(stages, costs, None, _uneven_note(stages, by_flops, float(flops.sum()), costs))


def stages_at(traced, jaxpr, cuts: Sequence[int], costs: StageCosts = StageCosts(),
              devices: int = 1) -> tuple[Stage, ...]:  # fmt: skip
    """The stages of ``jaxpr`` cut after each equation index in ``cuts`` (no balancing),
    priced like :func:`plan_stages` prices its own."""
    n_params = traced.num_params
    flops = np.array([equation_flops(e) for e in jaxpr.eqns], dtype=np.float64)
    seconds = np.array([costs.equation_seconds(e, devices) for e in jaxpr.eqns], dtype=np.float64)
    crossing = crossing_bytes(jaxpr, n_params, traced.state_outputs)
    floating = crossing_bytes(jaxpr, n_params, traced.state_outputs, floating=True)
    points = [CutPoint(k, float(seconds[: k + 1].sum()), float(flops[: k + 1].sum()), int(crossing[k]),
                       int(floating[k])) for k in cuts]  # fmt: skip
    return _stages(traced, flops, seconds, _param_consumers(jaxpr, n_params), points, costs, devices)


def _uneven_note(stages: tuple[Stage, ...], by_flops: list[CutPoint], total: float,
                 costs: StageCosts) -> tuple[str, ...]:  # fmt: skip
    """A note when the modelled times, not the FLOPs, made the stages uneven (small or narrow models)."""
    heaviest = max(s.flops for s in stages) / max(total, 1.0)
    bounds = [0.0, *(p.flops_before for p in by_flops), total]
    possible = max(b - a for a, b in zip(bounds, bounds[1:])) / max(total, 1.0)
    if heaviest <= 1.1 * possible:
        return ()
    sender = max(stages, key=lambda s: s.transfer_seconds)
    return (
        f"pipeline stages: the heaviest stage has {heaviest:.0%} of the FLOPs where cutting by "
        f"FLOPs alone gives {possible:.0%}: the cuts minimise the slowest stage's modelled time "
        f"on {costs.name} — compute with at least {costs.kernel_us:g} µs per matmul, plus "
        f"boundary transfers (up to {format_seconds(sender.transfer_seconds)} of stage "
        f"{sender.index}'s {format_seconds(sender.seconds)} per microbatch). Remedy: if that is "
        "not your machine, partition(..., machine=<its profile>); or explicit stages=[...]; "
        "or fewer pipeline stages.",
    )


def format_seconds(seconds: float) -> str:
    """``12.3 µs``, ``4.56 ms``, ``1.2 s``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _explicit_cuts(traced, users, points: list[CutPoint], boundaries, num_stages,
                   where: str = "") -> list[CutPoint]:  # fmt: skip
    """Stage k+1 starts at the cut point right before the first use of ``boundaries[k]``."""
    on = f"{where}: " if where else ""
    if len(boundaries) != num_stages - 1:
        raise ValueError(
            f"{on}stages= gives {len(boundaries)} boundaries for {num_stages} pipeline stages "
            f"(pipeline × virtual); it needs {num_stages - 1} (one parameter-path pattern per "
            f"stage after the first). Remedy: {num_stages - 1} patterns, or a grid with "
            f"pipeline × virtual = {len(boundaries) + 1} for these."
        )
    cuts: list[CutPoint] = []
    for k, pattern in enumerate(boundaries):
        matched = [(min(users[i]), path) for i, path in enumerate(traced.param_paths)
                   if re.search(pattern, path) and users[i]]  # fmt: skip
        if not matched:
            raise ValueError(
                f"{on}stage boundary {pattern!r} (stages[{k}]) matches no parameter used by the "
                f"model; parameters are e.g. {list(traced.param_paths[:5])}. Remedy: a regex "
                "of the path of the first parameter of the stage it starts."
            )
        first, path = min(matched)
        before = [p for p in points if p.after < first]
        if not before:
            raise ValueError(
                f"{on}stage boundary {pattern!r} (stages[{k}]) would start stage {k + 1} at "
                f"{path!r}, the first parameter the model uses, leaving stage {k} empty. "
                "Remedy: a pattern matching a later layer's parameters."
            )
        cut = before[-1]
        if cuts and cut.after <= cuts[-1].after:
            raise ValueError(
                f"{on}stage boundaries {list(boundaries)} are not in model order: "
                f"{pattern!r} (stages[{k}]) starts at {path!r}, which the model uses before "
                f"(or right where) {boundaries[k - 1]!r} (stages[{k - 1}]) starts stage {k}. "
                "Remedy: list the boundaries in the order the model runs them, one per layer."
            )
        cuts.append(cut)
    return cuts


def _returned_by_last_stage(traced, jaxpr, users: dict[int, list[int]]) -> dict[int, list[int]]:
    """``users`` with the parameters the model returns as outputs (a learnable temperature
    beside the logits) used by its last equation too: the last stage produces the outputs,
    so it holds them. Model state returned as it is (its new value) is not an output here."""
    state = {k for k, _ in traced.state_outputs}
    origin = param_origins(jaxpr, traced.num_params)
    last = len(jaxpr.eqns) - 1
    returned = {origin[v] for k, v in enumerate(jaxpr.outvars)
                if k not in state and not R.is_literal(v) and v in origin}  # fmt: skip
    return {i: ks + [last] if i in returned and last >= 0 and last not in ks else ks for i, ks in users.items()}


def _stages(traced, flops, seconds, users, cuts: list[CutPoint], costs: StageCosts,
            devices: int) -> tuple[Stage, ...]:  # fmt: skip
    bounds = [-1, *(c.after for c in cuts), len(flops) - 1]
    times = stage_times(cuts, float(seconds.sum()), costs, devices)
    sends = [c.send_bytes for c in cuts] + [0]
    stages = []
    for s in range(len(bounds) - 1):
        start, stop = bounds[s] + 1, bounds[s + 1] + 1
        params = tuple(
            path for i, path in enumerate(traced.param_paths)
            if any(start <= k < stop for k in users[i])
        )  # fmt: skip
        param_bytes = sum(
            math.prod(traced.param_avals[i].shape) * np.dtype(traced.param_avals[i].dtype).itemsize
            for i, path in enumerate(traced.param_paths) if path in params
        )  # fmt: skip
        stages.append(Stage(s, start, stop, float(flops[start:stop].sum()), param_bytes,
                            params, sends[s], *times[s]))  # fmt: skip
    return tuple(stages)

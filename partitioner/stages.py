"""Pipeline stages: contiguous ranges of the model's equations, balanced by DP. Pure.

A stage boundary may only fall where few activation bytes cross it (within
25% of the minimum over the model: the residual stream between blocks, not
the middle of an attention), so stages send one compact message per
microbatch. Among those boundaries, dynamic programming picks the split that
minimises the most expensive stage (FLOPs; ties broken by the largest
message), not a uniform split by layer count. With virtual (interleaved)
stages the same DP cuts ``pipeline·virtual`` stages; which rank runs each is
the grid's business (:meth:`~axonn_jax.partitioner.grid.Grid.pipeline_rank`).

Example:
    >>> stages = plan_stages(traced, jaxpr, 2)                 # doctest: +SKIP
    >>> [s.params[:2] for s in stages]                         # doctest: +SKIP
    [('block_0/...', ...), ('block_2/...', ...)]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.flops import nested_flops
from axonn_jax.partitioner.jaxprs import CONTROL_FLOW

#: boundaries whose crossing bytes are within this factor of the minimum are candidates
SLACK = 1.25


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: equations ``[start, stop)`` of the inlined jaxpr."""

    index: int
    start: int
    stop: int
    flops: float  # forward FLOPs of one batch
    param_bytes: int
    params: tuple[str, ...]
    send_bytes: int  # activation bytes sent to the next stage per batch (0 for the last)


def _nbytes(var) -> int:
    aval = var.aval
    return int(math.prod(aval.shape)) * aval.dtype.itemsize  # PRNG key dtypes too


def equation_flops(eqn) -> float:
    """Forward FLOPs of one equation (matmuls and convolutions exact, others 1/element)."""
    out = math.prod(R.shape_of(eqn.outvars[0])) if eqn.outvars else 0
    name = eqn.primitive.name
    if name in CONTROL_FLOW:  # its bodies, times the iterations (a range of a scan of layers)
        return float(nested_flops(eqn))
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = R.shape_of(eqn.invars[0])
        return 2.0 * out * math.prod(lhs[d] for d in lc)
    if name == "conv_general_dilated":
        rhs = R.shape_of(eqn.invars[1])
        out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * out * math.prod(rhs) / max(out_features, 1)
    return float(out)


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


def crossing_bytes(jaxpr, num_params: int) -> np.ndarray:
    """Bytes of activations alive across the boundary after each equation."""
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
    for v in jaxpr.outvars:
        if not R.is_literal(v):
            last_use[v] = n
    diff = np.zeros(n + 1, dtype=np.int64)
    for v, start in defined.items():
        end = last_use.get(v)
        if end is None or v in param_like or end <= max(start, 0):
            continue
        lo = max(start, 0)
        diff[lo] += _nbytes(v)
        diff[end] -= _nbytes(v)
    return np.cumsum(diff)[:n]


def plan_stages(
    traced,
    jaxpr,
    num_stages: int,
    *,
    boundaries: Sequence[str] | None = None,
    where: str = "",
) -> tuple[Stage, ...]:
    """Split the inlined ``jaxpr`` of ``traced`` into ``num_stages`` stages.

    Args:
        boundaries: optional ``num_stages - 1`` parameter-path regexes; stage
            k+1 starts at the last candidate boundary before the first use of a
            parameter matching ``boundaries[k]``.
        where: what is being split, for error messages (e.g. ``"GPT on
            Grid(..., pipeline=2, virtual=2)"``).
    """
    n_params = traced.num_params
    eqns = jaxpr.eqns
    flops = np.array([equation_flops(e) for e in eqns], dtype=np.float64)
    users = _param_consumers(jaxpr, n_params)
    crossing = crossing_bytes(jaxpr, n_params)
    if num_stages == 1:
        cuts: list[int] = []
    else:
        candidates = _candidates(crossing, users)
        if boundaries is not None:
            cuts = _explicit_cuts(traced, users, candidates, boundaries, num_stages, where)
        else:
            cuts = _balanced_cuts(flops, crossing, candidates, num_stages, where)
    return _stages(traced, eqns, flops, users, crossing, cuts)


def stages_at(traced, jaxpr, cuts: Sequence[int]) -> tuple[Stage, ...]:
    """The stages of ``jaxpr`` cut after each equation index in ``cuts`` (no balancing)."""
    eqns = jaxpr.eqns
    flops = np.array([equation_flops(e) for e in eqns], dtype=np.float64)
    users = _param_consumers(jaxpr, traced.num_params)
    return _stages(traced, eqns, flops, users, crossing_bytes(jaxpr, traced.num_params), list(cuts))


def _candidates(crossing: np.ndarray, users) -> list[int]:
    """Boundaries (after equation b) where the model may be cut.

    Within 25% of the smallest crossing inside the parametrised region, and
    at most one (the smallest; the earliest on ties) between two consecutive
    equations that use parameters, so every stage holds parameters.
    """
    used = sorted({k for ks in users.values() for k in ks})
    if len(used) < 2:
        return []
    floor = crossing[used[0] : used[-1]].min()
    chosen = []
    for a, b in zip(used, used[1:]):
        gap = [k for k in range(a, b) if crossing[k] <= SLACK * floor]
        if gap:
            chosen.append(min(gap, key=lambda k: (crossing[k], k)))
    return chosen


def _balanced_cuts(flops, crossing, candidates: list[int], num_stages: int,
                   where: str = "") -> list[int]:  # fmt: skip
    if len(candidates) < num_stages - 1:
        raise ValueError(
            f"{where + ': ' if where else ''}the model has {len(candidates)} layer boundaries "
            f"where it can be cut, fewer than the {num_stages - 1} needed for {num_stages} "
            f"pipeline stages (pipeline × virtual). Remedy: at most {len(candidates) + 1} "
            "stages (fewer virtual stages per rank, or a smaller pipeline), or a deeper model."
        )
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    ends = candidates + [len(flops) - 1]  # stage j ends after equation ends[j]

    def cost(a: int, b: int) -> float:  # equations (a, b]
        return prefix[b + 1] - prefix[a + 1]

    # best[s][j]: (max stage cost, max message) for s+1 stages ending at ends[j]
    inf = (math.inf, math.inf)
    best = [[inf] * len(ends) for _ in range(num_stages)]
    back = [[-1] * len(ends) for _ in range(num_stages)]
    for j, e in enumerate(ends):
        best[0][j] = (cost(-1, e), 0)
    for s in range(1, num_stages):
        for j, e in enumerate(ends):
            for i in range(j):
                prev = best[s - 1][i]
                if prev == inf:
                    continue
                cand = (max(prev[0], cost(ends[i], e)), max(prev[1], int(crossing[ends[i]])))
                if cand < best[s][j]:
                    best[s][j], back[s][j] = cand, i
    cuts, j = [], len(ends) - 1
    for s in range(num_stages - 1, 0, -1):
        j = back[s][j]
        cuts.append(ends[j])
    return sorted(cuts)


def _explicit_cuts(traced, users, candidates, boundaries, num_stages, where="") -> list[int]:
    if len(boundaries) != num_stages - 1:
        raise ValueError(
            f"{where + ': ' if where else ''}stages= gives {len(boundaries)} boundaries for "
            f"{num_stages} pipeline stages (pipeline × virtual); it needs {num_stages - 1} "
            "(one parameter-path pattern per stage after the first)."
        )
    cuts = []
    for pattern in boundaries:
        firsts = [min(users[i]) for i, path in enumerate(traced.param_paths)
                  if re.search(pattern, path) and users[i]]  # fmt: skip
        if not firsts:
            raise ValueError(
                f"stage boundary {pattern!r} matches no parameter used by the model; "
                f"parameters are e.g. {list(traced.param_paths[:5])}"
            )
        before = [b for b in candidates if b < min(firsts)] or [min(firsts) - 1]
        cuts.append(before[-1])
    if cuts != sorted(set(cuts)):
        raise ValueError(f"stage boundaries {list(boundaries)} are not in model order")
    return cuts


def _stages(traced, eqns, flops, users, crossing, cuts) -> tuple[Stage, ...]:
    bounds = [-1] + list(cuts) + [len(eqns) - 1]
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
        send = int(crossing[bounds[s + 1]]) if s < len(bounds) - 2 else 0
        stages.append(Stage(s, start, stop, float(flops[start:stop].sum()), param_bytes,
                            params, send))  # fmt: skip
    return tuple(stages)

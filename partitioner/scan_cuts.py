"""Pipeline cuts inside a scan over stacked layers: what can be cut, and the cut made. Pure.

A transformer written as one ``scan`` over stacked layers (linen ``nn.scan``,
``nnx.scan`` over an ``nnx.vmap``-made stack) is one equation, so a stage
boundary could only fall before or after all of its layers. Here such a scan
(one that slices a parameter: its ``xs`` include stacked weights) is split
into iteration ranges: each range is the same ``scan`` primitive over a
``slice`` of every ``xs`` (the stacked parameters sliced along their layer
dim), the carry chaining the ranges and the ``ys`` concatenated back.

* :func:`split_scans` rewrites a jaxpr with the scans split at given
  iterations (the other equations are the same objects).
* :func:`cut_stages` is the interface to the stage planner: it offers every
  iteration boundary as a cut candidate (the scans split at every iteration),
  lets :func:`~axonn_jax.partitioner.stages.plan_stages` balance the stages
  on that jaxpr, then splits the scans only where a stage boundary fell, so
  that each stage runs one scan over its range of layers, and returns the
  stage plan re-indexed on the final jaxpr and the cuts (``Plan.scan_cuts``)
  that :func:`split_scans` replays for other input shapes.

What a stage reads of a stacked parameter is the ``slice`` of its range (a
parameter-like equation that travels with the parameter: each stage re-runs
it; ``stages.param_like_producers``).

Example:
    >>> final, split, cuts = cut_stages(traced, jaxpr, 2)       # doctest: +SKIP
    >>> cuts                                                    # doctest: +SKIP
    ((3, (2,)),)          # the scan at equation 3 cut after its 2nd iteration
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jax import lax
from jax.extend import core as jex_core

from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.balance import StageCosts
from axonn_jax.partitioner.stages import StagePlan, param_origins, plan_stages, stages_at

#: (equation index of a scan in the inlined jaxpr, iterations where a new range starts)
ScanCuts = tuple[tuple[int, tuple[int, ...]], ...]

#: what a rewritten equation is: (index of the original equation, role, first iteration,
#: end iteration); role "eqn" (unchanged), "slice", "piece" (a range's scan), "concat" (ys)
Origin = tuple[int, str, int, int]


def stacked_scans(jaxpr, num_params: int) -> list[int]:
    """Indices of the scans that slice a parameter (``xs`` from a parameter or its casts)."""
    origin = param_origins(jaxpr, num_params)
    found = []
    for k, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name == "scan" and eqn.params["length"] > 1:
            xs = eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"]:]
            if any(not R.is_literal(v) and v in origin for v in xs):
                found.append(k)
    return found


def split_scans(jaxpr, cuts: Mapping[int, Sequence[int]]):
    """``jaxpr`` with the scan at each index of ``cuts`` split where a new range starts.

    Returns ``(new jaxpr, origins)``: one :data:`Origin` per new equation.
    """
    eqns, origins = [], []
    for k, eqn in enumerate(jaxpr.eqns):
        starts = sorted(set(cuts.get(k, ())))
        if not starts:
            eqns.append(eqn)
            origins.append((k, "eqn", 0, 0))
            continue
        for new, origin in _split(eqn, starts):
            eqns.append(new)
            origins.append((k,) + origin)
    return jaxpr.replace(eqns=eqns), origins


def _split(eqn, starts: Sequence[int]):
    """The equations of one scan split into ranges beginning at 0 and at each of ``starts``."""
    p = eqn.params
    nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = eqn.invars[:nc], eqn.invars[nc:nc + nk], eqn.invars[nc + nk:]
    carry_out, ys_out = eqn.outvars[:nk], eqn.outvars[nk:]
    bounds = [0, *[s for s in starts if 0 < s < length], length]
    ranges = list(zip(bounds, bounds[1:]))
    order = ranges[::-1] if p["reverse"] else ranges
    ys_parts: list[list] = [[] for _ in ys_out]
    for n, (a, b) in enumerate(order):
        sliced = []
        for x in xs:  # an xs operand has a leading dim: never a literal
            out = _var(x.aval, b - a)
            yield _eqn([x], [out], lax.slice_p, _slice_params(x.aval.shape, a, b), eqn), ("slice", a, b)
            sliced.append(out)
        last = n == len(order) - 1
        new_carry = list(carry_out) if last else [_var(v.aval) for v in carry_out]
        ys = [_var(v.aval, b - a) for v in ys_out]
        for part, y in zip(ys_parts, ys):
            part.append((a, y))
        yield _eqn([*consts, *carry, *sliced], [*new_carry, *ys], eqn.primitive,
                   dict(p, length=b - a), eqn), ("piece", a, b)  # fmt: skip
        carry = new_carry
    for out, parts in zip(ys_out, ys_parts):
        if isinstance(out, jex_core.DropVar):
            continue
        pieces = [y for _, y in sorted(parts, key=lambda ay: ay[0])]
        yield _eqn(pieces, [out], lax.concatenate_p, {"dimension": 0}, eqn), ("concat", 0, length)


def _var(aval, rows: int | None = None):
    """A new variable like ``aval``; ``rows``: another leading dim (a range of a stack)."""
    if rows is None:
        return jex_core.Var(aval)
    return jex_core.Var(aval.update(shape=(rows, *aval.shape[1:])))


def _slice_params(shape, a: int, b: int) -> dict:
    return {"start_indices": (a,) + (0,) * (len(shape) - 1),
            "limit_indices": (b, *shape[1:]), "strides": None}  # fmt: skip


def _eqn(invars, outvars, primitive, params, like):
    return jex_core.new_jaxpr_eqn(list(invars), list(outvars), primitive, params, like.effects,
                                  like.source_info, like.ctx)  # fmt: skip


def cut_stages(traced, jaxpr, num_stages: int, **options) -> tuple[object, StagePlan, ScanCuts]:
    """Stages of ``jaxpr`` that may cut scans over stacked layers between iterations.

    The stage planner (:func:`~axonn_jax.partitioner.stages.plan_stages`,
    given ``options``) sees each such scan split at every iteration, so every
    layer boundary is a candidate and each range costs its layers' time.
    Returns ``(jaxpr, split, cuts)``: the jaxpr with the scans split only where
    a stage boundary fell, the :class:`~axonn_jax.partitioner.stages.StagePlan`
    on it, and the :data:`ScanCuts` that rebuild it.
    """
    scans = stacked_scans(jaxpr, traced.num_params) if num_stages > 1 else []
    if not scans:
        return jaxpr, plan_stages(traced, jaxpr, num_stages, **options), ()
    every = {k: tuple(range(1, jaxpr.eqns[k].params["length"])) for k in scans}
    unrolled, origins = split_scans(jaxpr, every)
    split = plan_stages(traced, unrolled, num_stages, **options)
    starts = [origins[st.start] for st in split.stages[1:]]  # where each later stage begins
    chosen: dict[int, list[int]] = {}
    for k, role, a, b in starts:
        if role in ("slice", "piece"):  # a range ends there: reverse scans run downwards
            edge = b if jaxpr.eqns[k].params["reverse"] else a
            if 0 < edge < jaxpr.eqns[k].params["length"]:
                chosen.setdefault(k, []).append(edge)
    cuts = tuple((k, tuple(sorted(set(v)))) for k, v in sorted(chosen.items()))
    final, final_origins = split_scans(jaxpr, dict(cuts))
    starts = [_first_of(start, final_origins) for start in starts]
    stages = stages_at(traced, final, [k - 1 for k in starts], options.get("costs") or StageCosts(),
                       options.get("devices", 1))  # fmt: skip
    return final, dataclasses.replace(split, stages=stages), cuts


def _first_of(start: Origin, origins: list[Origin]) -> int:
    """Where the equation ``start`` (of the jaxpr split at every iteration) begins its part
    of the jaxpr split at the chosen cuts: the first equation of the range holding it."""
    k, role, a, _ = start
    for i, (k2, role2, a2, b2) in enumerate(origins):
        if k2 != k:
            continue
        if role in ("slice", "piece") and (role2 == "eqn" or (role2 != "concat" and a2 <= a < b2)):
            return i
        if role == role2 and role in ("eqn", "concat"):
            return i
    for i, (k2, *_) in enumerate(origins):  # a concatenation the chosen cuts do not need
        if k2 > k:
            return i
    return len(origins)  # pragma: no cover - a stage never starts past the last equation


def with_cuts(closed, cuts: ScanCuts):
    """``closed`` (a ClosedJaxpr) with its scans split as ``cuts`` (from :func:`cut_stages`)."""
    if not cuts:
        return closed
    jaxpr, _ = split_scans(closed.jaxpr, dict(cuts))
    return jex_core.ClosedJaxpr(jaxpr, closed.consts)

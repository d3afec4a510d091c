"""Every rank of a job must partition the same model for the same grid.

Different grids, models, example input shapes, options or library versions on
different ranks would make their programs issue different collectives, which
hangs or silently corrupts. :func:`check_consistent` compares a fingerprint of
a partitioned model (:func:`fingerprint`) across all processes with one small MPI
allgather (digests only; the details travel only when they differ) and raises
``ValueError`` on *every* rank, naming the ranks that differ and how.
:class:`~axonn_jax.Partitioned` runs it when it first needs its devices,
before any collective; in a single process it does nothing.

Example (rank 1 was given ``Grid(x=2, z=2, pipeline=2)``)::

    ValueError: the ranks of this job partition different things: rank 1 has grid
    Grid(x=2, y=1, z=2, data=1, pipeline=2) but rank 0 has Grid(x=2, y=2, z=2, ...). ...
"""

from __future__ import annotations

import cmath
import hashlib
from collections.abc import Mapping
from typing import Any, Protocol

from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.program import Program
from axonn_jax.runtime.collectives import world


#: what is compared, in the order differences are reported
FIELDS = ("versions", "grid", "model", "inputs", "params", "options", "plan")
#: differences listed per field before "and N more"
MAX_LISTED = 3


class Comm(Protocol):
    def allgather(self, obj: Any) -> list: ...


def fingerprint(model, plan: Plan, program: Program, options: Mapping[str, Any]) -> dict[str, Any]:
    """What must be equal on every rank, field by field (plain, picklable values)."""
    import importlib.metadata

    import flax
    import jax

    try:
        version = importlib.metadata.version("axonn_jax")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
        version = "(source tree)"
    traced = program.traced
    return {
        "versions": f"axonn_jax {version}, jax {jax.__version__}, "
        f"flax {flax.__version__}",
        "grid": repr(plan.grid),
        "model": f"{traced.kind} {type(model).__module__}.{type(model).__qualname__}",
        "inputs": tuple((tuple(a.shape), str(a.dtype)) for a in traced.arg_avals),
        "params": tuple((p.path, tuple(p.shape), str(p.dtype)) for p in plan.params),
        "options": repr(sorted(options.items())),
        "plan": (tuple((p.path, repr(p.storage)) for p in plan.params),
                 tuple((s.start, s.stop) for s in plan.stages)),  # fmt: skip
    }


def step_fingerprint(optimizer, abstract_params, options: Mapping[str, Any]) -> dict[str, Any]:
    """What every rank's train step must agree on: the optimizer's update and the step options.

    The update is traced on the abstract parameters; its fingerprint is the
    jaxpr's digest plus the scalar constants it holds (learning rate, betas,
    weight decay, clipping threshold, schedule values), which name the usual
    difference in the error message.
    """
    import jax

    state = jax.eval_shape(optimizer.init, abstract_params)
    closed = jax.make_jaxpr(optimizer.update)(abstract_params, state, abstract_params)
    text = str(closed.jaxpr)
    # NaN (schedule-free's) compares unequal to everything: ordered after the numbers, by text,
    # a set of the same constants always lists them in the same order (complex ones, of
    # complex parameters, by their real then imaginary parts)
    values = {_constant_text(c): complex(c) for c in _scalars(closed)}

    def order(text: str) -> tuple:
        v = values[text]
        return (True, 0.0, 0.0, text) if cmath.isnan(v) else (False, v.real, v.imag, text)

    constants = sorted(values, key=order)
    summary = f"update {hashlib.sha256(text.encode()).hexdigest()[:12]} with constants {constants}"
    return {"optimizer": summary, "step": repr(sorted(options.items()))}


def _constant_text(c) -> str:
    """A scalar constant as the fingerprint lists it: ``0.001``, or ``1+2j`` if complex."""
    import numpy as np

    return f"{complex(c):.6g}" if np.iscomplexobj(c) else f"{float(c):.6g}"


def _scalars(closed):
    """Scalar literals and constants of a closed jaxpr (nested jaxprs included)."""
    import numpy as np
    from jax.extend import core as jex_core

    for const in closed.consts:
        if np.ndim(const) == 0 and np.issubdtype(np.asarray(const).dtype, np.number):
            yield np.asarray(const)
    stack = [closed.jaxpr]
    while stack:
        jaxpr = stack.pop()
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, jex_core.Literal) and np.ndim(v.val) == 0 \
                        and np.issubdtype(np.asarray(v.val).dtype, np.number):  # fmt: skip
                    yield np.asarray(v.val)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    stack.append(inner)


def digests(print_: dict[str, Any]) -> dict[str, str]:
    return {k: hashlib.sha256(repr(v).encode()).hexdigest()[:16] for k, v in print_.items()}


def check_consistent(mine: dict[str, Any], comm: Comm | None = None, *,
                     remedy: str | None = None, what: str | None = None) -> None:  # fmt: skip
    """Raise ``ValueError`` on every rank unless all ranks have the same :func:`fingerprint`.

    ``comm``: anything with ``allgather`` (default: :func:`~axonn_jax.runtime.collectives.world`;
    nothing to check in a single process). Collective: every rank must call it. Any
    dict of plain values can be compared; ``what`` words the error (default: from
    the fields). A script's run configuration, before its first step::

        check_consistent({"--steps": args.steps, "--seed": args.seed}, what="run different
                         configurations", remedy=" Remedy: the same arguments on every rank.")
        # ValueError: the ranks of this job run different configurations: rank 1 has --steps 4
        # but rank 0 has 3. Remedy: ...
    """
    comm = comm if comm is not None else world()
    if comm is None:
        return
    every = comm.allgather(digests(mine))
    if all(d == every[0] for d in every):
        return
    details = comm.allgather(mine)  # every rank sees the mismatch, so every rank gets here
    raise ValueError(describe(details, what) + (_REMEDY if remedy is None else remedy))


_REMEDY = (
    " Remedy: every rank must call axonn_jax.partition with the same model, grid, example "
    "input shapes and options, and run the same library versions (e.g. build them from the "
    "same command-line arguments and environment on every rank; do not branch on the rank)."
)


def describe(prints: list[dict[str, Any]], what: str | None = None) -> str:
    """Which ranks differ from rank 0, and in what (ranks with equal fingerprints grouped)."""
    ref = prints[0]
    groups: dict[str, list[int]] = {}
    for rank, p in enumerate(prints[1:], start=1):
        if p != ref:
            groups.setdefault(repr(p), []).append(rank)
    lines = []
    for ranks in groups.values():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_span(ranks)}"
        other = prints[ranks[0]]
        fields = [f for f in (*FIELDS, *ref) if f in ref and other[f] != ref[f]]
        fields = list(dict.fromkeys(fields))
        if fields != ["plan"]:  # the plan follows from the rest: report it alone only
            fields = [f for f in fields if f != "plan"]
        lines += [f"{who} {_difference(f, other[f], ref[f])}" for f in fields]
    if what is None:
        what = "partition different things" if "grid" in ref else "run different train steps"
    return f"the ranks of this job {what}: " + "; ".join(lines) + "."


def _span(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}–{ranks[-1]} ({len(ranks)})"


def _difference(field: str, mine: Any, ref: Any) -> str:
    if field == "params":
        return "has " + _param_difference(mine, ref)
    if field == "inputs":
        return f"has example inputs {_avals(mine)} but rank 0 has {_avals(ref)}"
    if field == "plan":
        return ("computed a different plan from the same model and grid (different library "
                "versions or code?)")  # fmt: skip
    return f"has {field} {mine} but rank 0 has {ref}"


def _avals(avals) -> str:
    return ", ".join(f"{dtype}{list(shape)}" for shape, dtype in avals) or "none"


def _param_difference(mine, ref) -> str:
    a = {path: (shape, dtype) for path, shape, dtype in mine}
    b = {path: (shape, dtype) for path, shape, dtype in ref}
    diffs = []
    for path in [p for p, _, _ in ref if p in a and a[p] != b[p]]:
        diffs.append(f"parameter '{path}' {_aval(*a[path])} but rank 0 has {_aval(*b[path])}")
    missing = [p for p in b if p not in a]
    extra = [p for p in a if p not in b]
    if missing:
        diffs.append(f"no parameters {_first(missing)} (rank 0 has them)")
    if extra:
        diffs.append(f"parameters {_first(extra)} that rank 0 lacks")
    if not diffs:
        diffs.append("its parameters in a different order")
    listed = diffs[:MAX_LISTED] + ([f"and {len(diffs) - MAX_LISTED} more"] if diffs[MAX_LISTED:] else [])
    return ", ".join(listed)


def _aval(shape, dtype) -> str:
    return f"{dtype}{list(shape)}"


def _first(paths: list[str]) -> str:
    shown = ", ".join(f"'{p}'" for p in paths[:MAX_LISTED])
    return shown + (f" and {len(paths) - MAX_LISTED} more" if paths[MAX_LISTED:] else "")

"""Where an equation of the inlined jaxpr comes from: its layer and its parameters. Pure.

Flax linen records the module path of every equation in
``eqn.source_info.name_stack``, but :func:`~axonn_jax.partitioner.trace.inline_calls`
re-traces the model and drops it, so :func:`name_stacks` walks the original
jaxpr in the same order to recover it. nnx records nothing: there an equation
is identified by the parameters nearest to it in the data flow
(:meth:`Provenance.nearest_params`), found by walking back from the equation
to the first equations that read a parameter.

Example:
    >>> prov = Provenance(program.traced, program.jaxpr)         # doctest: +SKIP
    >>> prov.describe(7)                                        # doctest: +SKIP
    "equation 7 'log' in layer 'layer_2' (parameters nearby: layer_2/bias)"
"""

from __future__ import annotations

import dataclasses
import sys
import types

from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.stages import param_origins
from axonn_jax.partitioner.trace import inlined_body

def user_frame() -> tuple[types.FrameType | None, int]:
    """Where the user's code called into axonn_jax: the first frame outside it, and its
    ``stacklevel`` for ``warnings.warn`` counted from the function that asks (1).

    Example:
        >>> warnings.warn("replicated", stacklevel=user_frame()[1])  # doctest: +SKIP
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("axonn_jax"):
        frame, level = frame.f_back, level + 1
    return frame, level


#: how far back (in equations) :meth:`Provenance.nearest_params` looks
MAX_SEARCH = 256


@dataclasses.dataclass(frozen=True)
class EquationInfo:
    """One equation of the inlined jaxpr, described for people."""

    index: int
    primitive: str
    layer: str | None  # linen module path (root module stripped); None for nnx / root
    params: tuple[str, ...]  # nearest parameter paths in the data flow

    @property
    def module(self) -> str | None:
        """The layer, or the longest common parent path of :attr:`params`."""
        if self.layer:
            return self.layer
        parents = [p.split("/")[:-1] for p in self.params]
        if not parents:
            return None
        common = parents[0]
        for parts in parents[1:]:
            n = 0
            while n < min(len(common), len(parts)) and common[n] == parts[n]:
                n += 1
            common = common[:n]
        return "/".join(common) or None

    def __str__(self) -> str:
        text = f"equation {self.index} '{self.primitive}'"
        if self.module:
            text += f" in layer '{self.module}'"
        if self.params:
            text += f" (parameters nearby: {', '.join(self.params)})"
        return text


def _join(prefix: str, name: str) -> str:
    return "/".join(p for p in (prefix, name) if p)


def name_stacks(closed) -> list[tuple[str, str]]:
    """``(primitive, name stack)`` of each primitive :func:`inline_calls` binds for ``closed``.

    Walks nested calls exactly as the inliner does; a nested equation's name
    is appended to its caller's. (The inlined jaxpr may lack a few of these:
    see :func:`_align`.)
    """
    out: list[tuple[str, str]] = []

    def walk(jaxpr, prefix: str) -> None:
        for eqn in jaxpr.eqns:
            name = _join(prefix, str(eqn.source_info.name_stack))
            inner = inlined_body(eqn)
            if inner is not None:
                walk(inner[0], name)
            else:
                out.append((eqn.primitive.name, name))

    walk(closed.jaxpr, "")
    return out


class Provenance:
    """Layer names and nearest parameters of the equations of an inlined model jaxpr."""

    def __init__(self, traced, inlined, *, root: str | None = None):
        """``traced``: the :class:`TracedModel`; ``inlined``: its inlined Jaxpr (``program.jaxpr``).

        ``root``: the name the root module has in linen name stacks (its class
        name), stripped from layer names.
        """
        self.jaxpr = inlined
        self.paths = traced.param_paths
        eqns = self.jaxpr.eqns
        self.layers: list[str | None] = [None] * len(eqns)
        if traced.kind == "linen":
            names = _align(name_stacks(traced.jaxpr), [e.primitive.name for e in eqns])
            if names is not None:  # else: layer names unknown, parameters still identify
                self.layers = [_strip_root(name, root) for name in names]
        self.producer: dict = {}
        for k, eqn in enumerate(eqns):
            for v in eqn.outvars:
                self.producer[v] = k
        self.origin = param_origins(self.jaxpr, traced.num_params)

    def direct_params(self, k: int) -> set[int]:
        """Parameters equation ``k`` reads (through casts and reshapes)."""
        return {self.origin[v] for v in self.jaxpr.eqns[k].invars
                if not R.is_literal(v) and v in self.origin}  # fmt: skip

    def nearest_params(self, k: int) -> tuple[str, ...]:
        """Paths of the parameters closest upstream of equation ``k`` (breadth-first)."""
        frontier, seen = [k], {k}
        for _ in range(MAX_SEARCH):
            found = set().union(*(self.direct_params(j) for j in frontier))
            if found:
                return tuple(self.paths[i] for i in sorted(found))
            nxt = []
            for j in frontier:
                for v in self.jaxpr.eqns[j].invars:
                    p = None if R.is_literal(v) else self.producer.get(v)
                    if p is not None and p not in seen:
                        seen.add(p)
                        nxt.append(p)
            if not nxt or len(seen) > MAX_SEARCH:
                break
            frontier = nxt
        return ()

    def info(self, k: int) -> EquationInfo:
        eqn = self.jaxpr.eqns[k]
        return EquationInfo(k, eqn.primitive.name, self.layers[k], self.nearest_params(k))

    def param_users(self, i: int) -> list[int]:
        """Equations reading parameter ``i`` (through casts and reshapes)."""
        return [k for k in range(len(self.jaxpr.eqns)) if i in self.direct_params(k)]

    def consumers(self, var) -> list[int]:
        """Equations that read ``var``, in model order."""
        return [k for k, e in enumerate(self.jaxpr.eqns)
                if any(u is var for u in e.invars if not R.is_literal(u))]  # fmt: skip

    def describe(self, k: int) -> str:
        return str(self.info(k))


def _align(stacks: list[tuple[str, str]], primitives: list[str]) -> list[str] | None:
    """Name stack of each inlined equation.

    Re-tracing folds some equations away (a cast of a constant), so the
    inlined equations are a subsequence of the walk: match them in order.
    """
    names, j = [], 0
    for prim in primitives:
        while j < len(stacks) and stacks[j][0] != prim:
            j += 1
        if j == len(stacks):
            return None
        names.append(stacks[j][1])
        j += 1
    return names


def _strip_root(name: str, root: str | None) -> str | None:
    parts = name.split("/") if name else []
    if parts and root is not None and parts[0] == root:
        parts = parts[1:]
    return "/".join(parts) or None



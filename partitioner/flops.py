"""FLOPs of a jaxpr, per source line of the model. Pure: shapes only, no devices.

Counts what the equations compute, walking into sub-jaxprs (``shard_map``
bodies count their local shapes, so a partitioned step gives per-device
FLOPs): a matmul is ``2 · output elements · contracted size``, a convolution
``2 · output elements · window · input channels per group``, a scatter-add
one per update it adds, any other equation one FLOP per output element (data
movement and collectives: none).
Random bits count one FLOP per bit drawn, on both sides alike: the plain
model's ``random_bits`` and the runtime's block of them (the call named
:data:`RANDOM_BITS_CALL`, whose index arithmetic is not counted apart).
Control flow is counted once per iteration it names (``scan`` length), and
``cond`` by its most expensive branch.

Each count is attributed to the user's source line of the equation (through
inlined calls), so the per-line counts of a partitioned step and of the plain
model show where work is repeated. :func:`equation_flops` is the same count
for one equation: pipeline stages are balanced with it
(:mod:`~axonn_jax.partitioner.stages`), so a stage's share and this report
agree.

Example:
    >>> import jax, jax.numpy as jnp
    >>> count(jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((4, 8)), jnp.ones((8, 2)))).total
    128
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from axonn_jax.partitioner.jaxprs import subjaxprs
from axonn_jax.partitioner.trace import user_line

#: primitives whose FLOPs are products (each runs as its own device kernel)
MATMULS = frozenset(["dot_general", "conv_general_dilated"])
#: primitives that move or relabel data without arithmetic
_FREE = frozenset("""reshape transpose broadcast_in_dim squeeze expand_dims slice dynamic_slice
    dynamic_update_slice concatenate pad gather scatter copy copy_p convert_element_type
    iota select_n stack tile split rev bitcast_convert_type stop_gradient sharding_constraint
    pvary pcast mesh_cast all_gather all_gather_invariant psum psum_invariant pmax pmin
    reduce_scatter all_to_all ppermute axis_index optimization_barrier axonn_barrier random_wrap
    random_unwrap random_seed random_fold_in random_split threefry2x32""".split())
#: the name of the call in which the runtime draws a block of random bits (counted as bits)
RANDOM_BITS_CALL = "axonn_random_bits"


@dataclasses.dataclass(frozen=True)
class Flops:
    """Total FLOPs and their split by ``"file:line primitive"``."""

    total: int
    by_line: dict[str, int]

    def __add__(self, other: Flops) -> Flops:
        lines = Counter(self.by_line)
        lines.update(other.by_line)
        return Flops(self.total + other.total, dict(lines))


def count(closed_jaxpr) -> Flops:
    """FLOPs of ``closed_jaxpr`` (a ``ClosedJaxpr`` or ``Jaxpr``), per source line."""
    lines: Counter = Counter()
    _walk(getattr(closed_jaxpr, "jaxpr", closed_jaxpr).eqns, 1, lines)
    return Flops(int(sum(lines.values())), dict(lines))


def equation_flops(eqn) -> int:
    """FLOPs of one equation, its sub-jaxprs included (the one count per equation).

    What :func:`count` adds up for ``eqn``: pipeline stages are balanced with
    it (:mod:`~axonn_jax.partitioner.stages`) and the compute report sums it,
    so a stage's share and the report can never disagree.

    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((4, 8)), jnp.ones((8, 2))).eqns[0]
    >>> equation_flops(eqn)
    128
    """
    return int(equation_total(eqn, primitive_flops))


def equation_total(eqn, per_primitive) -> float:
    """``per_primitive(e)`` summed over the primitives ``eqn`` runs, the way FLOPs are.

    Sub-jaxprs included, a ``scan`` body times its length, a ``cond`` by its
    costliest branch: e.g. the modelled time of an equation
    (:meth:`~axonn_jax.partitioner.balance.StageCosts.equation_seconds`).
    """
    lines: Counter = Counter()
    _walk((eqn,), 1, lines, per_primitive)
    return sum(lines.values())


def _walk(eqns, times: int, lines: Counter, per_equation=None) -> None:
    per_equation = per_equation or primitive_flops
    for eqn in eqns:
        subs = subjaxprs(eqn)
        if eqn.params.get("name") == RANDOM_BITS_CALL and per_equation is primitive_flops:
            bits = sum(math.prod(v.aval.shape) for v in eqn.outvars)  # this device's block of bits
            lines[f"{user_line(eqn.source_info) or '?'} random_bits"] += bits * times
            continue
        if subs:
            name = eqn.primitive.name
            if name == "cond":
                branches = []
                for j in subs:
                    branch: Counter = Counter()
                    _walk(j.eqns, times, branch, per_equation)
                    branches.append(branch)
                lines.update(max(branches, key=lambda b: sum(b.values())))
                continue
            repeat = int(eqn.params.get("length", 1)) if name == "scan" else 1
            for sub in subs:
                _walk(sub.eqns, times * repeat, lines, per_equation)
            continue
        value = per_equation(eqn)
        if value:
            lines[f"{user_line(eqn.source_info) or '?'} {eqn.primitive.name}"] += value * times


def primitive_flops(eqn) -> int:
    """FLOPs of one equation's own primitive, not counting sub-jaxprs (module docstring)."""
    name = eqn.primitive.name
    if name in _FREE or not eqn.outvars:
        return 0
    out = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        return 2 * out * math.prod(shape[d] for d in lc)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        dn = eqn.params["dimension_numbers"]
        in_features = rhs[dn.rhs_spec[1]]
        window = math.prod(rhs[d] for d in dn.rhs_spec[2:])
        return 2 * out * in_features * window
    if name in ("scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"):
        return math.prod(getattr(eqn.invars[2].aval, "shape", ()))  # one per update combined
    if name.startswith("reduce_") and eqn.invars:
        return math.prod(getattr(eqn.invars[0].aval, "shape", ()))
    return out


@dataclasses.dataclass(frozen=True)
class ComputeReport:
    """FLOPs of one training step (forward and backward of the model): per device vs plain.

    ``redundancy = devices · per_device / plain``: 1.00 when the work is split
    with nothing repeated. ``str()`` lists the source lines repeated most.

    Example:
        >>> r = ComputeReport(Flops(30, {"m.py:3 mul": 30}), Flops(100, {"m.py:3 mul": 100}), 4)
        >>> round(r.redundancy, 2)
        1.2
    """

    per_device: Flops
    plain: Flops
    devices: int

    @property
    def redundancy(self) -> float:
        return self.devices * self.per_device.total / max(self.plain.total, 1)

    def repeated(self, top: int = 5) -> list[tuple[str, float]]:
        """``(line, extra FLOPs as a fraction of the plain step)``, most repeated first."""
        lines = set(self.plain.by_line) | set(self.per_device.by_line)
        extra = {k: self.devices * self.per_device.by_line.get(k, 0) - self.plain.by_line.get(k, 0)
                 for k in lines}  # fmt: skip
        worst = sorted(lines, key=lambda k: -extra[k])[:top]
        share = {k: extra[k] / max(self.plain.total, 1) for k in worst}
        return [(k, share[k]) for k in worst if share[k] >= 5e-4]

    def __str__(self) -> str:
        head = (f"compute per device and step: {self.per_device.total:,} FLOPs; the plain model "
                f"{self.plain.total:,} on one device; redundancy {self.redundancy:.2f} "
                f"({self.devices} devices, 1.00 = nothing repeated)")  # fmt: skip
        rows = [f"  {share:+.1%}  {line}" for line, share in self.repeated()]
        return "\n".join([head] + (["most repeated (extra work, share of the plain step):"] + rows
                                   if rows else []))  # fmt: skip

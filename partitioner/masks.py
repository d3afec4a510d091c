"""Random bits take the layout of the activation they mask. Pure.

Dropout draws ``random_bits`` of the activation's shape, turns them into a
mask with a few elementwise ops on constants (shift, or, bitcast, compare,
cast, broadcast) and meets the activation in a ``select_n`` or ``mul``. The
bits have no operand to take a layout from, so the planner follows them
along that chain (:class:`MaskTracker`) to the first equation that meets
another value, and the next planning walk draws them in that value's layout
(``rules.Context.random_layouts``): split over every axis the activation is,
x and y included, so no device draws or compares bits it then throws away.

Example:
    >>> tracker = MaskTracker(pass_map)                       # doctest: +SKIP
    >>> for eqn in jaxpr.eqns: tracker.step(eqn, layouts_of(eqn))  # doctest: +SKIP
    >>> tracker.found   # {random_bits output var: layout}    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.layout import Layout, merge

#: ops through which a mask keeps being a mask when its other operands are constants
_CHAIN = R.ELEMENTWISE | R.LAYOUT_PRESERVING | R.POINTWISE_CALLS | {"bitcast_convert_type"}
#: of those, the ones whose output dims are the operands' (size-1 dims broadcast)
_SAME_DIMS = R.ELEMENTWISE | R.POINTWISE_CALLS | {"bitcast_convert_type"}


class MaskTracker:
    """Follows each scalar-keyed ``random_bits`` output to the activation it first meets.

    ``pass_map(eqn, dim_map)`` maps a dim map through a layout-preserving op
    (None when it does not preserve the dims). ``found`` maps each
    ``random_bits`` output variable to the layout of the value its mask met,
    on the bits' own dims (dims the mask broadcasts stay whole).
    """

    def __init__(self, pass_map: Callable):
        self.pass_map = pass_map
        self.lineage: dict = {}  # var -> {random_bits output var: dim map (bits dim or None)}
        self.constant: set = set()  # values computed from literals alone
        self.found: dict = {}

    def step(self, eqn, layouts: list[Layout | None]) -> None:
        """Account for one equation (``layouts``: its operands' layouts, None if undecided)."""
        name = eqn.primitive.name
        operands = [(v, lay) for v, lay in zip(eqn.invars, layouts) if not R.is_literal(v)]
        if name == "random_bits":
            if not R.shape_of(eqn.invars[0]):
                out = eqn.outvars[0]
                self.lineage[out] = {out: tuple(range(len(R.shape_of(out))))}
            return
        if all(v in self.constant for v, _ in operands):
            self.constant.update(eqn.outvars)
            return
        masks = [v for v, _ in operands if v in self.lineage]
        if not masks:
            return
        others = [(v, lay) for v, lay in operands if v not in self.lineage and v not in self.constant]
        if name not in _CHAIN:
            return
        if others:
            self._meet(eqn, masks, others)
        else:
            self._follow(eqn, masks)

    def _follow(self, eqn, masks) -> None:
        """A mask op on constants: the output is still the mask, its dims mapped."""
        out_shape = R.shape_of(eqn.outvars[0])
        lineage: dict = {}
        for v in masks:
            for key, dims in self.lineage[v].items():
                if eqn.primitive.name in _SAME_DIMS:
                    mapped = _elementwise_map(dims, R.shape_of(v), out_shape)
                else:
                    mapped = self.pass_map(eqn, dims)
                if mapped is not None:
                    lineage.setdefault(key, mapped)
        if lineage:
            for var in eqn.outvars:
                self.lineage[var] = lineage

    def _meet(self, eqn, masks, others) -> None:
        """The mask meets an activation: its bits should have been split like it."""
        out_shape = R.shape_of(eqn.outvars[0])
        if eqn.primitive.name not in R.ELEMENTWISE:
            return
        full = [tuple(() if s == 1 and o != 1 else axes  # dims it broadcasts do not count
                      for axes, s, o in zip(lay, R.shape_of(v), out_shape))
                for v, lay in others if lay is not None and len(lay) == len(out_shape)]  # fmt: skip
        if not full:
            return
        target = merge(full)
        for v in masks:
            for key, dims in self.lineage[v].items():
                mapped = _elementwise_map(dims, R.shape_of(v), out_shape)
                if mapped is None:
                    continue
                layout: list[tuple[str, ...]] = [()] * len(R.shape_of(key))
                for out_dim, bits_dim in enumerate(mapped):
                    if bits_dim is not None:
                        layout[bits_dim] = target[out_dim]
                self.found.setdefault(key, tuple(layout))


def _elementwise_map(dims, shape, out_shape):
    """Dim map of an elementwise op's output: dims the operand broadcasts (1 → n) map to None."""
    if len(shape) != len(out_shape):
        return None
    return tuple(None if s != o else d for d, s, o in zip(dims, shape, out_shape))

"""The planning pass: walk the model's jaxpr with layouts only and decide them.

Pure: works on abstract shapes, needs no devices. Parameters start
*undecided*; they flow through layout-preserving ops (casts, reshapes that only
add or drop unit dims, broadcasts, transposes) and are decided by the first
equation that asks for a layout (a matmul makes its weight a 4D layer weight,
an elementwise op with an activation makes a bias or a norm scale follow the
activation, a lookup makes a table an embedding). Matmul and embedding
weights are then additionally split over z (depth, FSDP-like) on their
largest divisible dim.

Decisions are iterated to a fixpoint: when a later equation has to *slice* a
replicated value that derives from an undecided-then-replicated parameter,
that parameter is re-planned with the sliced layout (so e.g. a LayerNorm scale
ends up split like the hidden dim it scales, instead of its gradient being
all-reduced at activation size).

Example:
    >>> import flax.linen as nn, jax.numpy as jnp
    >>> from axonn_jax import Grid
    >>> from axonn_jax.partitioner.trace import trace_model
    >>> result = plan_layouts(trace_model(nn.Dense(8), jnp.zeros((4, 8))), Grid(x=2, y=2))
    >>> result.storage["kernel"]
    (('y',), ('x',))
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping, Sequence

from axonn_jax.partitioner.grid import BATCH_AXES, Z, Grid
from axonn_jax.partitioner import control_flow as CF
from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.jaxprs import CONTROL_FLOW
from axonn_jax.partitioner.layout import Layout, divides, factor, replicated, use_layout, used_axes, without
from axonn_jax.partitioner.masks import MaskTracker
from axonn_jax.partitioner.pointwise import replaced_rules
from axonn_jax.partitioner.roles import DEPTH_SPLIT_PRIMITIVES, ParamRole
from axonn_jax.partitioner.stacking import stacking_dims
from axonn_jax.partitioner.trace import TracedModel, inline_calls, user_line


@dataclasses.dataclass(frozen=True)
class Fallback:
    """An equation that could not be partitioned and runs replicated."""

    primitive: str
    reason: str
    where: str
    params: tuple[str, ...]  # parameter paths that feed it directly


@dataclasses.dataclass(frozen=True)
class PlannedLayouts:
    """Result of :func:`plan_layouts`, keyed by parameter path."""

    use: dict[str, Layout]  # layout of each parameter where it is used
    storage: dict[str, Layout]  # layout it is stored in (use + depth split over z)
    args: tuple[Layout, ...]
    outs: tuple[Layout, ...]
    fallbacks: tuple[Fallback, ...]
    layers: dict[str, tuple[str, str]]  # weight path -> (in_axis, out_axis)
    roles: dict[str, ParamRole]
    notes: tuple[str, ...]  # parameters left replicated or not depth-split, and why
    scatter_batch: bool = True  # the rules' option these layouts were planned with
    #: random_bits output variable -> its layout (``rules.Context.random_layouts``)
    random_layouts: Mapping = dataclasses.field(default_factory=dict)


def batch_layout(shape, grid: Grid) -> Layout:
    """Dim 0 split over (data, z) when divisible; everything else replicated."""
    if not shape:
        return ()
    lay = replicated(len(shape))
    if divides(shape[0], BATCH_AXES, grid):
        lay = (BATCH_AXES,) + lay[1:]
    return lay


def batch_problems(shapes, grid: Grid) -> list[str]:
    """One message per input whose leading (batch) dim data·z does not divide."""
    return [
        f"input {k} has shape {tuple(shape)}: its batch dim {shape[0]} (the leading dim) is "
        f"not divisible by data·z = {grid.data}·{grid.z} = {grid.batch_shards}, so it is "
        f"replicated (every device computes the whole batch). Remedy: a batch size that "
        f"is a multiple of {grid.batch_shards}, or a grid with a smaller data·z."
        for k, shape in enumerate(shapes)
        if shape and shape[0] % grid.batch_shards
    ]


def plan_layouts(
    traced: TracedModel,
    grid: Grid,
    *,
    strict: bool = False,
    rules: Mapping[str, Sequence] | None = None,
    replicate: Sequence[str] = (),
    jaxpr=None,
    scatter_batch: bool = True,
    fixed: Mapping[str, Layout] | None = None,
) -> PlannedLayouts:
    """Decide the layout of every parameter, argument and output of ``traced``.

    Args:
        rules: ``{regex: PartitionSpec-like}`` forcing the *use* layout of matching
            parameter paths (e.g. ``{"head/kernel": (("y",), ())}``).
        replicate: regexes of parameter paths to keep fully replicated.
        strict: raise ``ValueError`` instead of falling back to replication.
        jaxpr: the already inlined ClosedJaxpr of ``traced`` (computed if omitted).
        scatter_batch: reduce-scatter layer outputs onto the batch dim between layers
            (the rules' ``Context``); False keeps all-reduces.
        fixed: ``{path: stored layout}`` of every parameter, already decided (a plan's,
            for another call of the same model): each is read in its use layout
            (:func:`~axonn_jax.partitioner.layout.use_layout`, as the runtime reads it)
            and kept as stored; only the values are planned, around them. ``rules``
            and ``replicate`` then decide nothing (the plan they made is given).
    """
    jaxpr = (jaxpr if jaxpr is not None else inline_calls(traced.jaxpr)).jaxpr
    if fixed is None:
        forced = _forced_layouts(traced, grid, rules or {}, replicate)
    else:
        forced = {i: use_layout(fixed[path]) for i, path in enumerate(traced.param_paths)}
    hints: dict[int, Layout] = {}
    random: dict = {}  # random_bits output -> the layout of the activation its mask meets
    stacked = stacking_dims(jaxpr)
    for _ in range(4):
        walk = _Walk(traced, jaxpr, grid, strict, {**hints, **forced}, scatter_batch, random, stacked,
                     stored=fixed)  # fmt: skip
        walk.run()
        new_hints = {p: h for p, h in walk.hints.items() if p not in forced and p not in hints}
        new_random = {k: v for k, v in walk.masks.found.items() if random.get(k) != v}
        if not new_hints and not new_random:
            break
        hints.update(new_hints)
        random.update(new_random)
    planned = walk.result()
    unmatched = unmatched_patterns(traced.param_paths, rules or {}, replicate)
    if unmatched and strict:
        raise ValueError(f"{unmatched[0]} (grid {grid}; strict=True)")
    return dataclasses.replace(planned, notes=planned.notes + replaced_rules(traced.jaxpr) + unmatched,
                               scatter_batch=scatter_batch, random_layouts=random)  # fmt: skip


def unmatched_patterns(paths: Sequence[str], rules: Mapping[str, Sequence],
                       replicate: Sequence[str]) -> tuple[str, ...]:  # fmt: skip
    """One message per ``rules=``/``replicate=`` pattern that matches no parameter path."""
    shown = ", ".join(paths[:6]) + (", …" if len(paths) > 6 else "")
    return tuple(
        f"{option}= pattern {pattern!r} matches no parameter, so it does nothing. Remedy: use a "
        f"regex over the parameter paths (re.search), e.g. {shown}"
        for option, patterns in (("rules", list(rules)), ("replicate", list(replicate)))
        for pattern in patterns
        if not any(re.search(pattern, path) for path in paths)
    )


def _forced_layouts(traced, grid, rules, replicate) -> dict[int, Layout]:
    forced: dict[int, Layout] = {}
    for i, (path, aval) in enumerate(zip(traced.param_paths, traced.param_avals)):
        if any(re.search(p, path) for p in replicate):
            forced[i] = replicated(len(aval.shape))
            continue
        for pattern, layout in rules.items():
            if re.search(pattern, path):
                lay = tuple(
                    () if a is None else (a,) if isinstance(a, str) else tuple(a) for a in layout
                )
                lay = lay + ((),) * (len(aval.shape) - len(lay))
                for d, axes in enumerate(lay):
                    grid.check_divides(f"parameter '{path}' dim {d}", aval.shape[d], axes)
                forced[i] = lay
                break
    return forced


class _Walk:
    """One pass over the jaxpr with layouts only."""

    def __init__(self, traced, jaxpr, grid, strict, predecided, scatter_batch=True, random=None,
                 stacked=None, stored=None):  # fmt: skip
        self.traced, self.jaxpr, self.grid, self.strict = traced, jaxpr, grid, strict
        self.stored: Mapping[str, Layout] = stored or {}  # path -> stored layout (plan_layouts' fixed)
        self.ctx = R.Context(grid, scatter_batch=scatter_batch, random_layouts=random, stacked=stacked)
        self.masks = MaskTracker(_pass_map)
        self.decided: dict[int, Layout] = dict(predecided)
        self.layout: dict = {}
        self.pending: dict = {}  # var -> (param index, dim map)
        self.lineage: dict = {}  # var -> {param index: dim map} through elementwise ops
        self.fallbacks: list[Fallback] = []
        self.layers: dict[int, tuple[str, str]] = {}
        self.hints: dict[int, Layout] = {}
        self.depth_split: set[int] = set()  # weights of a matmul or an embedding lookup
        self.weights_only: set = set()  # values computed from parameters alone (not activations)
        self.problems: list[str] = []
        #: param index → dims a scan iterates over (stacked layers): never split
        self.stacked: dict[int, set[int]] = {}

    def _problem(self, message: str) -> None:
        """Something left unsplit: a warning in the plan, an error when strict."""
        if self.strict:
            raise ValueError(f"{message} (grid {self.grid}; strict=True)")
        if message not in self.problems:
            self.problems.append(message)

    # --- reading ----------------------------------------------------------
    def layout_of(self, var) -> Layout | None:
        if R.is_literal(var):
            return replicated(len(R.shape_of(var)))
        if var in self.pending:
            p, dim_map = self.pending[var]
            if p not in self.decided:
                return None
            return tuple(self.decided[p][m] if m is not None else () for m in dim_map)
        return self.layout[var]

    def run(self) -> None:
        n = self.traced.num_params
        invars = self.jaxpr.invars
        for i, var in enumerate(invars[:n]):
            self.pending[var] = (i, tuple(range(len(R.shape_of(var)))))
            self.lineage[var] = {i: tuple(range(len(R.shape_of(var))))}
        self.arg_layouts = []
        keys = self.traced.rng_args
        batch = [R.shape_of(v) for j, v in enumerate(invars[n:]) if j not in keys]
        for problem in batch_problems(batch, self.grid):
            self._problem(problem)
        for j, var in enumerate(invars[n:]):  # RNG keys are replicated, batches split
            shape = R.shape_of(var)
            lay = replicated(len(shape)) if j in keys else batch_layout(shape, self.grid)
            self.layout[var] = lay
            self.arg_layouts.append(lay)
        for var in self.jaxpr.constvars:
            self.layout[var] = replicated(len(R.shape_of(var)))
        for eqn in self.jaxpr.eqns:
            self.step(eqn)
        self.out_layouts = [self.layout_of(v) for v in self.jaxpr.outvars]
        for k, var in enumerate(self.jaxpr.outvars):
            if self.out_layouts[k] is None:  # a parameter returned as is
                self.decide(var, replicated(len(R.shape_of(var))))
                self.out_layouts[k] = self.layout_of(var)

    # --- one equation -----------------------------------------------------
    def step(self, eqn) -> None:
        name = eqn.primitive.name
        if name in CONTROL_FLOW:
            self._control_flow(eqn)
            return
        layouts = [self.layout_of(v) for v in eqn.invars]
        live = [v for v in eqn.invars if not R.is_literal(v)]
        if (
            name in R.LAYOUT_PRESERVING
            and len(live) == 1
            and live[0] in self.pending
            and layouts[eqn.invars.index(live[0])] is None
        ):
            new_map = _pass_map(eqn, self.pending[live[0]][1])
            if new_map is not None:
                self.pending[eqn.outvars[0]] = (self.pending[live[0]][0], new_map)
                self.lineage[eqn.outvars[0]] = {self.pending[live[0]][0]: new_map}
                return
        step = R.rule(eqn, layouts, self.ctx)
        self.masks.step(eqn, layouts)
        if name in DEPTH_SPLIT_PRIMITIVES:  # weights computed from parameters only (weight norm)
            for var in eqn.invars:
                if not R.is_literal(var) and var in self.weights_only:
                    self.depth_split.update(self.lineage.get(var, {}))
        if step.fallback:
            self._fallback(eqn, step.fallback)
        for var, lay, target in zip(eqn.invars, layouts, step.targets):
            if R.is_literal(var) or target is None:
                continue
            if lay is None:
                self.decide(var, target, depth=name in DEPTH_SPLIT_PRIMITIVES)
                if step.layer is not None:
                    self.layers[self.pending[var][0]] = step.layer
            else:
                self._note_slices(var, lay, target)
        for k, var in enumerate(eqn.outvars):
            self.layout[var] = step.outs[k]
        operands = [v for v in eqn.invars if not R.is_literal(v)]
        if operands and all(v in self.pending or v in self.weights_only for v in operands):
            self.weights_only.update(eqn.outvars)
        self._propagate_lineage(eqn)

    # --- control flow: bodies planned with the same rules (partitioner.control_flow) ---
    def _control_flow(self, eqn) -> None:
        """Plan a scan / while / cond: its bodies walked like the model, the carry at a fixed point.

        Parameters entering a body stay undecided there, so that the body's
        equations decide them (a stacked weight sliced per iteration becomes a
        4D layer weight; its stacked dim is recorded and never split). The
        carry's layout is searched with trial walks whose decisions are undone
        (:func:`~axonn_jax.partitioner.control_flow.fixed_point`), then the
        bodies are walked once for good. The outputs take the layouts the
        runtime computes them in (the pure rule, now that parameters are decided).
        """
        operands = [self.layout_of(v) for v in eqn.invars]
        found = CF.bodies(eqn)
        carry_at = CF.carry_operands(eqn)
        carry = {k: operands[k] or replicated(len(R.shape_of(eqn.invars[k]))) for k in carry_at}
        carrying = [b for b in found if b.carry_outs]
        if carrying:
            body = carrying[0]

            def trial(layouts: list) -> list:
                saved = self._snapshot()
                outs = self._walk_body(eqn, body, dict(zip(carry_at, layouts)))
                self._restore(saved)
                return outs[: body.carry_outs]

            carry = dict(zip(carry_at, CF.fixed_point(trial, [carry[k] for k in carry_at])))
        for body in found:
            self._walk_body(eqn, body, carry)
        for k, var in enumerate(eqn.invars):  # operands no body decided: as the runtime gets them
            if not R.is_literal(var) and var in self.pending and self.layout_of(var) is None:
                self.decide(var, carry.get(k) or replicated(len(R.shape_of(var))))
        step = R.rule(eqn, [self.layout_of(v) for v in eqn.invars], self.ctx)
        for var, lay in zip(eqn.outvars, step.outs):
            self.layout[var] = lay

    def _walk_body(self, eqn, body, carry: dict) -> list:
        """Walk ``body`` with its inputs bound (parameters left pending); its output layouts."""
        jaxpr = body.jaxpr
        for var in jaxpr.constvars:
            self.layout[var] = replicated(len(R.shape_of(var)))
        for bvar, (kind, k) in zip(jaxpr.invars, body.inputs):
            var = eqn.invars[k]
            self.pending.pop(bvar, None)
            if kind == CF.CARRY:
                self.layout[bvar] = carry[k]
            elif R.is_literal(var):
                self.layout[bvar] = replicated(len(R.shape_of(bvar)))
            elif var in self.pending and self.layout_of(var) is None:
                p, dim_map = self.pending[var]
                self._note_stacked(var, kind)
                dim_map = dim_map[1:] if kind == CF.SLICE else dim_map
                self.pending[bvar] = (p, dim_map)
                self.lineage[bvar] = {p: dim_map}
            else:
                self._note_stacked(var, kind)
                lay = self.layout_of(var)
                self.layout[bvar] = without(lay, {0})[1:] if kind == CF.SLICE else lay
                lineage = self.lineage.get(var, {})
                self.lineage[bvar] = {p: m[1:] for p, m in lineage.items()} if kind == CF.SLICE else lineage
        for inner in jaxpr.eqns:
            self.step(inner)
        return [self.layout_of(v) or replicated(len(R.shape_of(v))) for v in jaxpr.outvars]

    def _note_stacked(self, var, kind: str) -> None:
        """Record the dim of a parameter that a scan slices (it holds the stacked layers)."""
        if kind == CF.SLICE and var in self.pending and self.pending[var][1][0] is not None:
            p, dim_map = self.pending[var]
            self.stacked.setdefault(p, set()).add(dim_map[0])

    _STATE = ("decided", "layout", "pending", "lineage", "fallbacks", "layers", "hints",
              "depth_split", "weights_only", "problems", "stacked")  # fmt: skip

    def _snapshot(self) -> dict:
        """A copy of the walk's state (values are immutable; containers are copied)."""
        saved = {name: copy.copy(getattr(self, name)) for name in self._STATE}
        saved["stacked"] = {p: set(d) for p, d in self.stacked.items()}
        return saved

    def _restore(self, saved: dict) -> None:
        for name, value in saved.items():
            setattr(self, name, value)

    def decide(self, var, target: Layout, *, depth: bool = False) -> None:
        """Fix the use layout of the parameter behind ``var``; ``depth``: also split it over z."""
        p, dim_map = self.pending[var]
        shape = self.traced.param_avals[p].shape
        lay: list[tuple[str, ...]] = [()] * len(shape)
        for vdim, pdim in enumerate(dim_map):
            if pdim is not None and target[vdim] and divides(shape[pdim], target[vdim], self.grid):
                if not (set(target[vdim]) & used_axes(tuple(lay))):
                    lay[pdim] = target[vdim]
        self.decided[p] = tuple(lay)
        if depth:
            self.depth_split.add(p)

    def _fallback(self, eqn, reason: str) -> None:
        feeding = sorted(
            {self.traced.param_paths[self.pending[v][0]] for v in eqn.invars
             if not R.is_literal(v) and v in self.pending}
        )
        fb = Fallback(eqn.primitive.name, reason, _where(eqn), tuple(feeding))
        if self.strict:
            raise ValueError(
                f"cannot partition '{fb.primitive}' at {fb.where}: {reason}"
                + (f" (parameters {', '.join(feeding)})" if feeding else "")
                + f" on {self.grid}. Remedy: pass strict=False to run it replicated, or "
                "replace the operation."
            )
        self.fallbacks.append(fb)

    # --- hints: re-plan params whose derived values had to be sliced ------
    def _propagate_lineage(self, eqn) -> None:
        name = eqn.primitive.name
        merged: dict[int, tuple] = {}
        if name in R.ELEMENTWISE:
            out_shape = R.shape_of(eqn.outvars[0])
            for v in eqn.invars:
                if R.is_literal(v):
                    continue
                shape = R.shape_of(v)
                for p, m in self.lineage.get(v, {}).items():
                    if len(m) == len(out_shape):
                        m = tuple(None if s == 1 and o != 1 else d
                                  for d, s, o in zip(m, shape, out_shape))  # fmt: skip
                        merged.setdefault(p, m)
        elif name in R.LAYOUT_PRESERVING and eqn.invars and not R.is_literal(eqn.invars[0]):
            for p, m in self.lineage.get(eqn.invars[0], {}).items():
                new = _pass_map(eqn, m)
                if new is not None:
                    merged[p] = new
        if merged:
            for var in eqn.outvars:
                self.lineage[var] = merged

    def _note_slices(self, var, lay: Layout, target: Layout) -> None:
        for p, dim_map in self.lineage.get(var, {}).items():
            if p not in self.decided:
                continue
            shape = self.traced.param_avals[p].shape
            hint = list(self.decided[p])
            changed = False
            for vdim, pdim in enumerate(dim_map):
                if pdim is None or hint[pdim] or not target[vdim] or lay[vdim]:
                    continue
                if divides(shape[pdim], target[vdim], self.grid) and not (
                    set(target[vdim]) & used_axes(tuple(hint))
                ):
                    hint[pdim] = target[vdim]
                    changed = True
            if changed:
                self.hints.setdefault(p, tuple(hint))

    # --- result -----------------------------------------------------------
    def result(self) -> PlannedLayouts:
        paths, avals = self.traced.param_paths, self.traced.param_avals
        for p, (in_axis, out_axis) in self.layers.items():
            self._check_layer(p, in_axis, out_axis)
        use, storage, unused = {}, {}, []
        for i, (path, aval) in enumerate(zip(paths, avals)):
            use[path] = self.decided.get(i, replicated(len(aval.shape)))
            self._check_stacked(i, use[path])
            if path in self.stored:  # given (plan_layouts' fixed)
                storage[path] = self.stored[path]
            else:
                storage[path] = self._depth_split(i, path, aval.shape, use[path])
            if i not in self.decided:
                unused.append(f"{path}: never used by the model; kept replicated")
        return PlannedLayouts(
            use=use,
            storage=storage,
            args=tuple(self.arg_layouts),
            outs=tuple(self.out_layouts),
            fallbacks=tuple(self.fallbacks),
            layers={paths[p]: v for p, v in self.layers.items()},
            roles={path: self._role(i, use[path]) for i, path in enumerate(paths)},
            notes=tuple(self.problems + unused),
        )

    def _role(self, p: int, use: Layout) -> ParamRole:
        if p in self.layers:
            return ParamRole.of_layer(self.layers[p][0])
        return ParamRole.FOLLOWS_ACTIVATION if any(use) else ParamRole.REPLICATED

    def _check_layer(self, p: int, in_axis: str, out_axis: str) -> None:
        """Report a matmul weight that could not take its layer's x/y split."""
        path, shape = self.traced.param_paths[p], self.traced.param_avals[p].shape
        lay = self.decided.get(p, ())
        for axis in (in_axis, out_axis):
            size = self.grid.axis_size(axis)
            if size > 1 and axis not in used_axes(lay):
                if all(d % size == 0 for d in shape):  # it could be split: its activation is not
                    why = (f"its dims divide by {size}, but the activation it multiplies is not split "
                           f"over {axis} there (a transpose or reshape before it moved the split)")
                    remedy = f"none needed if the layer is small (its work repeats over {axis}); else a grid with a smaller {axis}"
                else:
                    why = (f"the dim that should be is not divisible by {size}, or the activation it "
                           f"multiplies is not split over {axis} there")
                    remedy = f"make the layer's feature dims multiples of {size}, or choose a grid with a smaller {axis}"
                self._problem(
                    f"parameter '{path}' {tuple(shape)}: no dim of it is split over {axis}={size} "
                    f"({why}); that part of the layer is replicated over {axis}. Remedy: {remedy}."
                )

    def _check_stacked(self, p: int, lay: Layout) -> None:
        """A scan reads a stacked parameter one layer per iteration: its layer dim stays whole."""
        split = sorted(d for d in self.stacked.get(p, ()) if lay[d])
        if split:
            path, shape = self.traced.param_paths[p], tuple(self.traced.param_avals[p].shape)
            raise ValueError(
                f"parameter '{path}' {shape} is stacked along dim {split[0]} (a scan runs one "
                f"slice per iteration), but rules= split that dim over {lay[split[0]]} on "
                f"{self.grid}. Remedy: leave the stacked dim unsplit in rules=, e.g. "
                f"{tuple(None if d == split[0] else (a or None) for d, a in enumerate(lay))}."
            )

    def _depth_split(self, p, path, shape, lay: Layout) -> Layout:
        """Add z to the largest divisible dim of a matmul or embedding weight."""
        if p not in self.depth_split or len(shape) < 2 or self.grid.z == 1 or Z in used_axes(lay):
            return lay
        stacked = self.stacked.get(p, set())  # a scan's layer dim: each iteration reads one
        candidates = [
            d for d in range(len(shape))
            if d not in stacked and divides(shape[d], lay[d] + (Z,), self.grid)
        ]  # fmt: skip
        if not candidates:
            self._problem(
                f"{path} {tuple(shape)}: no dim divisible by its tensor split × z={self.grid.z};"
                " not depth-split (replicated over z). Remedy: a dim that is a multiple of"
                f" {self.grid.z}, or a smaller z."
            )
            return lay
        best = max(candidates, key=lambda d: (shape[d] // factor(lay[d], self.grid), -d))
        return tuple(axes + (Z,) if d == best else axes for d, axes in enumerate(lay))


def _pass_map(eqn, dim_map):
    """Dim map of a layout-preserving op's output, or None if not preserving."""
    name = eqn.primitive.name
    in_shape = R.shape_of(eqn.invars[0])
    out_shape = R.shape_of(eqn.outvars[0])
    if name in ("convert_element_type", "copy", "copy_p", "reduce_precision"):
        return dim_map
    if name == "transpose":
        return tuple(dim_map[p] for p in eqn.params["permutation"])
    if name == "squeeze":
        drop = {d % len(in_shape) for d in eqn.params["dimensions"]}
        return tuple(m for d, m in enumerate(dim_map) if d not in drop)
    if name == "slice":  # one piece of a stacked parameter (Gemma's gating_einsum[0])
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        strides = eqn.params.get("strides") or (1,) * len(in_shape)
        return tuple(m if (start[d], limit[d], strides[d]) == (0, in_shape[d], 1) else None
                     for d, m in enumerate(dim_map))  # fmt: skip
    if name == "broadcast_in_dim":
        out = [None] * len(out_shape)
        for src, dst in enumerate(eqn.params["broadcast_dimensions"]):
            if in_shape[src] == out_shape[dst]:
                out[dst] = dim_map[src]
        return tuple(out)
    if name == "reshape" and eqn.params.get("dimensions") is None:
        groups = R.reshape_groups(in_shape, out_shape)
        if groups is None or any(len(gi) != 1 or len(go) != 1 for gi, go in groups):
            return None
        out = [None] * len(out_shape)
        for gi, go in groups:
            out[go[0]] = dim_map[gi[0]]
        return tuple(out)
    return None


def _where(eqn) -> str:
    """Best-effort source location / module path of an equation."""
    info = getattr(eqn, "source_info", None)
    stack = getattr(info, "name_stack", None)
    text = str(stack) if stack else ""
    loc = user_line(info)
    if loc:
        text = f"{text} ({loc})" if text else loc
    return text or "<unknown>"

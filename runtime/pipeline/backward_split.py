"""A stage's backward split in two: B (input gradients) and W (weight gradients).

Zero-bubble pipelines run B as soon as the next stage's gradient arrives (the
previous stage waits for it) and W later, whenever the rank would otherwise
idle. Both are cut from the one traced backward, so they compute exactly what
the fused backward does, each operation once: B is every operation the input
gradients need; W is every remaining operation the weight gradients need,
reading the backward's inputs it uses (residuals, output gradient) and the
values B computed for it (for a matmul layer: its output gradient, ``dy``).

Inside ``shard_map`` (tensor-parallel stages) the body is cut the same way and
becomes two ``shard_map`` calls on the stage's mesh; a value B hands to W
crosses between them per device (a leading axis over the mesh axes it varies
on), so every collective stays where the fused backward had it.

Example:
    >>> split = BackwardSplit(backward, avals, input_outputs=[False, False, True])  # doctest: +SKIP
    >>> g_in, carried = split.input_gradients(*leaves)                     # doctest: +SKIP
    >>> weights = split.weight_gradients(split.kept(leaves), carried)      # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from axonn_jax.partitioner import flops

#: the primitive names of ``shard_map`` (cut inside) across JAX versions
_SHARD_MAP = ("shard_map",)


def _is_var(v) -> bool:
    return not isinstance(v, jcore.Literal)


class _Cut:
    """One jaxpr cut in two: the B part computes ``b_outs``, the W part the rest of the outputs.

    ``carried``: the vars B defines that W reads (in a cut ``shard_map``: a new
    output of its B half and input of its W half, see :func:`_per_device_spec`).
    ``w_inputs``: the positions of the jaxpr's inputs W reads.
    """

    def __init__(self, jaxpr, b_outs: Sequence[bool]):
        self.jaxpr = jaxpr
        self.b_out_mask = list(b_outs)
        eqns = jaxpr.eqns
        # --- B: every equation the B outputs need (a shard_map: only its needed outputs) ---
        need = {v for v, b in zip(jaxpr.outvars, b_outs) if b and _is_var(v)}
        self.b_eqns: dict[int, list[bool] | None] = {}  # index → outputs B needs (None: whole eqn)
        self.inner: dict[int, _Cut] = {}
        for i in range(len(eqns) - 1, -1, -1):
            e = eqns[i]
            used = [o in need for o in e.outvars]
            if not any(used):
                continue
            if e.primitive.name in _SHARD_MAP and not all(used):
                cut = _Cut(e.params["jaxpr"], used)
                self.inner[i] = cut
                self.b_eqns[i] = used
                need |= {v for v, k in zip(e.invars, cut.b_inputs) if k and _is_var(v)}
            else:
                self.b_eqns[i] = None
                need |= {v for v in e.invars if _is_var(v)}
        self.b_inputs = [v in need for v in jaxpr.invars]
        b_defined = set()
        for i, used in self.b_eqns.items():
            e = eqns[i]
            b_defined |= {o for o, u in zip(e.outvars, used or [True] * len(e.outvars)) if u}
        # --- W: every equation (or W half) the other outputs need, not already in B ---
        need = {v for v, b in zip(jaxpr.outvars, b_outs) if not b and _is_var(v)}
        self.w_eqns: list[int] = []
        self.carried: list = []  # vars B defines that W reads, in first-read order
        for i in range(len(eqns) - 1, -1, -1):
            e = eqns[i]
            if i in self.b_eqns and i not in self.inner:
                continue
            outs = e.outvars if i not in self.inner else [o for o, u in zip(e.outvars, self.b_eqns[i]) if not u]
            if not any(o in need for o in outs):
                continue
            self.w_eqns.append(i)
            reads = e.invars
            if i in self.inner:
                reads = [v for v, k in zip(e.invars, self.inner[i].w_inputs) if k]
            need |= {v for v in reads if _is_var(v) and v not in b_defined}
            self.carried += [v for v in reads if _is_var(v) and v in b_defined and v not in self.carried]
        self.w_eqns.reverse()
        self.carried += [v for v, b in zip(jaxpr.outvars, b_outs)
                         if not b and _is_var(v) and v in b_defined and v not in self.carried]  # fmt: skip
        self.w_inputs = [v in need for v in jaxpr.invars]

    # --- evaluation (traced under jit) -----------------------------------------
    def run_b(self, consts, inputs: Sequence) -> tuple[list, list]:
        """``(B outputs, carried values)``; ``inputs`` are all the jaxpr's inputs."""
        env = dict(zip(self.jaxpr.constvars, consts))
        env.update(zip(self.jaxpr.invars, inputs))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
        for i in sorted(self.b_eqns):
            e = self.jaxpr.eqns[i]
            if i in self.inner:
                outs = _run_shard_map_half(e, self.inner[i], "b", [read(v) for v in e.invars])
                used = [o for o, u in zip(e.outvars, self.b_eqns[i]) if u]
                b_outs, carried = outs
                env.update(zip(used, b_outs))
                env.update(zip(self.inner[i].carried_keys(e), carried))
                continue
            env.update(zip(e.outvars, _bind(e, [read(v) for v in e.invars])))
        b_outs = [read(v) for v, b in zip(self.jaxpr.outvars, self.b_out_mask) if b]
        return b_outs, [env[k] for k in self.carried_keys_outer()]

    def run_w(self, consts, inputs: Sequence, carried: Sequence) -> list:
        """The W outputs; ``inputs`` are the jaxpr inputs W reads (``w_inputs``), then B's carried values."""
        env = dict(zip(self.jaxpr.constvars, consts))
        env.update(zip([v for v, k in zip(self.jaxpr.invars, self.w_inputs) if k], inputs))
        env.update(zip(self.carried_keys_outer(), carried))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
        for i in self.w_eqns:
            e = self.jaxpr.eqns[i]
            if i in self.inner:
                cut = self.inner[i]
                args = [read(v) for v, k in zip(e.invars, cut.w_inputs) if k]
                outs = _run_shard_map_half(e, cut, "w", args, [env[k] for k in cut.carried_keys(e)])
                env.update(zip([o for o, u in zip(e.outvars, self.b_eqns[i]) if not u], outs))
                continue
            env.update(zip(e.outvars, _bind(e, [read(v) for v in e.invars])))
        return [read(v) for v, b in zip(self.jaxpr.outvars, self.b_out_mask) if not b]

    # a carried var of a cut shard_map is keyed (eqn id, inner var): it exists only between halves
    def carried_keys(self, eqn) -> list:
        return [(id(eqn), v) for v in self.carried]

    def carried_keys_outer(self) -> list:
        """What B hands to W: the vars above, then the values each cut ``shard_map`` carries."""
        keys = list(self.carried)
        for i, cut in sorted(self.inner.items()):
            if i in self.w_eqns:
                keys += cut.carried_keys(self.jaxpr.eqns[i])
        return keys


def _bind(eqn, values: list) -> list:
    """Run one equation on ``values`` (as ``jax.core.eval_jaxpr`` does): its outputs, a list."""
    out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def _varying(aval) -> frozenset:
    """The manual mesh axes a value inside ``shard_map`` varies over."""
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _per_device_spec(aval, mesh_axes: Sequence[str]) -> PartitionSpec:
    """A value crossing from B's ``shard_map`` to W's: one block per device along a new leading
    axis over the manual axes it varies on (it is the same on the others)."""
    vma = _varying(aval)
    axes = tuple(a for a in mesh_axes if a in vma)
    return PartitionSpec(axes if axes else None)


def _run_shard_map_half(eqn, cut: _Cut, half: str, args: list, carried: Sequence = ()) -> list:
    """B's or W's half of a cut ``shard_map`` equation, as a new ``shard_map`` on its mesh."""
    p = eqn.params
    mesh, inner = p["mesh"], p["jaxpr"]
    axes = [a for a in mesh.axis_names if a in p.get("manual_axes", p.get("newly_manual_axes", mesh.axis_names))]
    carry_specs = [_per_device_spec(v.aval, axes) for v in cut.carried]
    consts = getattr(p["jaxpr"], "consts", ())
    if half == "b":
        in_specs = tuple(p["in_specs"])
        out_specs = ([s for s, u in zip(p["out_specs"], cut.b_out_mask) if u], carry_specs)

        def body(*xs):
            outs, carry = cut.run_b(consts, xs)
            return outs, [c[None] for c in carry]

    else:
        in_specs = (*[s for s, k in zip(p["in_specs"], cut.w_inputs) if k], *carry_specs)
        out_specs = [s for s, u in zip(p["out_specs"], cut.b_out_mask) if not u]
        n = len(args)

        def body(*xs):
            return cut.run_w(consts, xs[:n], [c[0] for c in xs[n:]])

        args = [*args, *carried]
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      axis_names=frozenset(axes), check_vma=p.get("check_vma", True))  # fmt: skip
    return f(*args)


class BackwardSplit:
    """``backward(*leaves) → flat outputs`` cut into :meth:`input_gradients` and :meth:`weight_gradients`.

    Args:
        backward: a function of flat array leaves returning a flat list of outputs.
        avals: the leaves' ShapeDtypeStructs.
        input_outputs: which outputs are input gradients (B); the others are W's.
    """

    def __init__(self, backward: Callable, avals: Sequence, input_outputs: Sequence[bool]):
        self._avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        closed = jax.make_jaxpr(backward)(*avals)
        self._consts = closed.consts
        self.cut = _Cut(closed.jaxpr, input_outputs)
        #: positions of the leaves W reads (keep these alive until W runs; B may drop the rest)
        self.kept_leaves = [k for k, used in enumerate(self.cut.w_inputs) if used]

    def input_gradients(self, *leaves) -> tuple[list, list]:
        """``(the B outputs, values carried to W)``."""
        return self.cut.run_b(self._consts, leaves)

    def weight_gradients(self, kept: Sequence, carried: Sequence) -> list:
        """The W outputs from the leaves at :attr:`kept_leaves` and B's carried values."""
        return self.cut.run_w(self._consts, list(kept), list(carried))

    def kept(self, leaves: Sequence) -> list:
        return [leaves[k] for k in self.kept_leaves]

    def flops(self) -> tuple[int, int]:
        """``(B's FLOPs, W's FLOPs)`` per device, counted on the two traced halves the way
        :mod:`~axonn_jax.partitioner.flops` counts (matmul layers: about 1:1, ``dx = dy·Wᵀ``
        and ``dW = xᵀ·dy``; a first stage whose input is data has no B). The uniform mode of
        ``benchmarks/pipeline_bubble.py`` splits a backward's time between B and W in this ratio."""
        b = jax.make_jaxpr(self.input_gradients)(*self._avals)
        _, carried = jax.eval_shape(self.input_gradients, *self._avals)
        w = jax.make_jaxpr(self.weight_gradients)(self.kept(self._avals), carried)
        return flops.count(b).total, flops.count(w).total

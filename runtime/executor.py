"""Run a planned model: a jaxpr interpreter over local shards inside ``shard_map``.

Each equation is executed by the rule the planner used
(:mod:`axonn_jax.partitioner.rules`): operands are relayouted to the rule's
targets (all-gather to un-shard, a local slice to shard), the primitive is
bound on local shards with parameters rewritten for local shapes, and the
rule's reductions are applied (``psum``). Parameters are read by gathering
their depth (z) split — the forward all-gather whose transpose is the
weight-gradient reduce-scatter — after being marked varying over the batch
axes so that their gradients are reduced over data and z at parameter size.

Broadcasts are kept lazy until a consumer asks for a layout, so a bias or a
norm scale is broadcast straight into the local shape of the activation it
meets and its gradient is reduced at its own size.

Parameters are gathered where :class:`~axonn_jax.runtime.overlap.Overlap`
says: one layer ahead (OAG) or just in time; their cast/reshape chains run
when first needed. Matmuls whose input gradient needs an all-reduce get the
explicit backward of :func:`~axonn_jax.runtime.overlap.contraction` (OAR).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from axonn_jax.partitioner.grid import Grid
from axonn_jax.partitioner import control_flow as CF
from axonn_jax.partitioner.blocks import block_of, bucket_runs
from axonn_jax.partitioner import rules as R
from axonn_jax.partitioner.jaxprs import CONTROL_FLOW, dependents
from axonn_jax.partitioner.layout import Layout, common_prefix, factor, live, local_shape, use_layout, used_axes
from axonn_jax.partitioner.program import Program
from axonn_jax.partitioner.stages import is_layer_range, param_like_producers, param_origins
from axonn_jax.partitioner.trace import source_context
from axonn_jax.runtime import loops
from axonn_jax.runtime.overlap import Overlap, contraction, is_float, tie
from axonn_jax.runtime.param_reads import (needs_gather, open_buckets, read_param, read_params,
                                          reduce_scatter_together)
from axonn_jax.runtime.pointwise import bind_custom_jvp
from axonn_jax.runtime.shard_index import shard_index
from axonn_jax.runtime.local_ops import KERNELS
from axonn_jax.runtime.varying import match_vma, vary, vma

#: primitives that start a "layer" for the gather prefetch (OAG)
LAYER_PRIMITIVES = frozenset(["dot_general", "conv_general_dilated"])


@dataclasses.dataclass
class _Lazy:
    """A ``broadcast_in_dim`` not materialised yet (shapes are global)."""

    operand: jax.Array
    operand_layout: Layout
    dims: tuple[int, ...]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    literal: bool


@dataclasses.dataclass
class _Stored:
    """A parameter's local shard, not yet read (gathered) for use."""

    shard: jax.Array
    storage: Layout


@dataclasses.dataclass
class _Deferred:
    """A parameter cast/reshape equation, run when its output is first needed."""

    eqn: object


def relayout(x: jax.Array, src: Layout, dst: Layout, grid: Grid,
             partial: frozenset = frozenset()) -> jax.Array:  # fmt: skip
    """Move local shard ``x`` from layout ``src`` to ``dst`` (same global shape).

    ``partial``: axes gathered for a matmul whose gradient for this operand is a
    partial sum over them: the gathered value stays typed varying over them, so
    autodiff transposes the gather into a reduce-scatter of those partial sums
    (instead of an all-reduce followed by a slice).
    """
    src, dst = live(src, grid), live(dst, grid)
    if src == dst:
        return x
    for d, (s, t) in enumerate(zip(src, dst)):
        keep = len(common_prefix(s, t))
        for axis in reversed(s[keep:]):
            x = _gather(x, axis, d, partial=axis in partial)
    for d, (s, t) in enumerate(zip(src, dst)):
        axes = t[len(common_prefix(s, t)) :]
        if not axes:
            continue
        chunk = x.shape[d] // factor(axes, grid)
        x = lax.dynamic_slice_in_dim(x, shard_index(axes, grid) * chunk, chunk, axis=d)
    return x


def _gather(x: jax.Array, axis: str, dim: int, partial: bool = False) -> jax.Array:
    if axis in vma(x):
        return lax.all_gather(x, axis, axis=dim, tiled=True, to="varying" if partial else "invarying")
    # identical on every device of `axis` (a broadcast value): tiling is exact
    size = lax.axis_size(axis)
    return jnp.concatenate([x] * size, axis=dim) if size > 1 else x


def gather_points(jaxpr, num_params: int, made_by: dict, blocks: Sequence[str | None] = (),
                  bucket_blocks: int = 1) -> tuple[dict, dict, dict, dict, list]:  # fmt: skip
    """Where each parameter is needed, and where it is gathered (pure, per jaxpr).

    ``made_by`` is :func:`~axonn_jax.partitioner.stages.param_like_producers`
    of ``jaxpr``. Returns ``(needs, prefetch, starts, siblings)``: ``needs[id(eqn)]``
    lists the parameters an equation reads (through their cast chains);
    ``prefetch[id(eqn)]`` lists the parameters of the *next* layer, to gather
    when this layer starts (OAG); ``starts[id(eqn)]`` those of the layer this
    equation starts, gathered together when it is reached. A layer starts at
    each matmul/convolution that reads parameters, unless it reads the same
    input as the matmul that started the current layer (q, k and v; gate and
    up): those are one layer, whose weights are gathered in one all-gather
    (:func:`~axonn_jax.runtime.param_reads.read_params`). A parameter first
    read elsewhere (a bias, a norm scale) belongs to the layer of the last
    matmul before that read. ``siblings[id(eqn)]``: the matmuls of a layer of
    several (q, k, v), keyed by the first; their outputs are reduced together.

    ``blocks``: the repeated block of each parameter
    (:func:`~axonn_jax.partitioner.blocks.block_of`), or empty. Consecutive
    layers whose weights lie in one block are gathered as one (a transformer
    block's attention and MLP weights in one all-gather, at its first layer,
    or with OAG while the block before computes). The first group is read at
    the first equation that reads a parameter, so the parameters read before
    the first layer (an embedding table) are gathered with it.

    The fifth result lists the gradient buckets: the parameters of each run of
    ``bucket_blocks`` consecutive block groups (group order, a group's in its
    read order), whose weight gradients are reduce-scattered in one call
    (:mod:`~axonn_jax.runtime.grad_buckets`); runs of one group are no bucket.
    """
    origin = param_origins(jaxpr, num_params)
    needs: dict = {}
    layer_of: dict = {}
    layers: list = []
    siblings: dict = {}
    layer_input: set = set()  # the activation inputs of the matmul that started the current layer
    first = None  # the first equation reading a parameter
    for eqn in jaxpr.eqns:
        if eqn.outvars and eqn.outvars[0] in made_by or eqn.primitive.name in CONTROL_FLOW:
            continue  # a cast chain runs when needed; a loop reads its parameters inside
        read = sorted({origin[v] for v in eqn.invars if not R.is_literal(v) and v in origin})
        if not read:
            continue
        needs[id(eqn)] = read
        if first is None:
            first = eqn
        if eqn.primitive.name in LAYER_PRIMITIVES:
            inputs = {v for v in eqn.invars if not R.is_literal(v) and v not in origin}
            if not (inputs and inputs <= layer_input):
                layers.append(eqn)
                layer_input = inputs
                siblings[id(eqn)] = [eqn]
            else:
                siblings[id(layers[-1])].append(eqn)
        for i in read:
            layer_of.setdefault(i, max(len(layers) - 1, 0))
    heads, group_of, group_blocks = _block_groups(layers, origin, blocks)
    # the first group, which nothing prefetches, is read at the first read of a parameter
    # (an embedding lookup: the table joins the first block's gather)
    reads_at = [first, *heads[1:]]
    prefetch: dict = {}
    starts: dict = {}
    for i, layer in layer_of.items():
        if layers and group_of[layer] >= 1:
            prefetch.setdefault(id(heads[group_of[layer] - 1]), []).append(i)
        if layers:
            starts.setdefault(id(reads_at[group_of[layer]]), []).append(i)
    members = [starts.get(id(eqn), []) for eqn in reads_at[: len(heads)]]
    buckets = [[i for g in run for i in members[g]] for run in bucket_runs(group_blocks, bucket_blocks)
               if len(run) > 1]  # fmt: skip
    return needs, prefetch, starts, {k: eqns for k, eqns in siblings.items() if len(eqns) > 1}, buckets


def _block_groups(layers: list, origin: dict,
                  blocks: Sequence[str | None]) -> tuple[list, list[int], list]:  # fmt: skip
    """Layers gathered together: ``(first layer of each group, group of each layer, block of
    each group)``.

    A layer joins the group before it when its first weight lies in the same
    block (``blocks[parameter]``, not None); without ``blocks`` each layer is a group.
    """
    heads: list = []
    group_of: list[int] = []
    group_blocks: list = []
    last = None
    for eqn in layers:
        read = [origin[v] for v in eqn.invars if not R.is_literal(v) and v in origin]
        block = blocks[read[0]] if blocks and read else None
        if block is None or block != last:
            heads.append(eqn)
            group_blocks.append(block)
        group_of.append(len(heads) - 1)
        last = block
    return heads, group_of, group_blocks


class Executor:
    """Interpret ``jaxpr`` on local shards; call inside ``shard_map`` on a stage mesh."""

    def __init__(self, program: Program, *, overlap: Overlap = Overlap()):
        self.jaxpr, self.consts, self.grid = program.jaxpr, list(program.consts), program.grid
        self.param_storage = list(program.param_storage)
        self._trainable = program.traced.trainable  # one flag per variable leaf (partitioner.trace)
        self.arg_layouts = list(program.arg_layouts)
        self.out_layouts = list(program.output_layouts)
        self.overlap = overlap
        self.ctx = program.rules_context()
        n = len(self.param_storage)
        jaxpr = self.jaxpr
        self._made_by = param_like_producers(jaxpr, n)
        paths = program.traced.param_paths
        blocks = [block_of(p) for p in paths] if overlap.gather_blocks and len(paths) == n else []
        self._needs, self._prefetch, self._starts, self._siblings, buckets = gather_points(
            jaxpr, n, self._made_by, blocks, overlap.buckets() if self.grid.z > 1 else 1)
        gathered = [needs_gather(s, self.grid) for s in self.param_storage]
        self._buckets = [[i for i in b if gathered[i]] for b in buckets]
        self._bucket_of = {i: b for b, members in enumerate(self._buckets) for i in members}
        self._param_dependent = dependents(jaxpr, jaxpr.invars[:n])

    def __call__(self, params: Sequence[jax.Array], args: Sequence[jax.Array]) -> list:
        env, lay = self.bind(params, args)
        self.run(self.jaxpr.eqns, env, lay)
        return self.outputs(env, lay, self.jaxpr.outvars, self.out_layouts)

    def bind(self, params: Sequence[jax.Array], args: Sequence[jax.Array], *,
             param_vars=None, arg_vars=None) -> tuple[dict, dict]:
        """Environment (value, layout per variable) holding params, args and consts.

        ``param_vars``/``arg_vars`` select a subset of the jaxpr's inputs (a
        pipeline stage binds only the parameters and arguments it uses).
        """
        env: dict = {}
        lay: dict = {}
        n = len(self.param_storage)
        if param_vars is None:
            param_vars = list(range(n))
        if arg_vars is None:
            arg_vars = list(range(len(self.jaxpr.invars) - n))
        for i, x in zip(param_vars, params):
            storage = self.param_storage[i]
            var = self.jaxpr.invars[i]
            if self._trainable[i]:
                env[var], lay[var] = _Stored(x, storage), use_layout(storage)
            else:  # state (BatchNorm statistics, caches): no gradient, so not marked varying over
                # the batch; its updates stay typed invariant there and leave without a gather
                env[var], lay[var] = relayout(x, storage, use_layout(storage), self.grid), use_layout(storage)
        for j, x in zip(arg_vars, args):
            var = self.jaxpr.invars[n + j]
            env[var], lay[var] = x, self.arg_layouts[j]
        for var, x in zip(self.jaxpr.constvars, self.consts):
            env[var], lay[var] = x, ((),) * jnp.ndim(x)
        return env, lay

    def run(self, eqns, env: dict, lay: dict) -> None:
        """Execute ``eqns`` (in order) on the environment, in place.

        Parameter cast chains are deferred until first needed, and parameters
        are gathered at the points :class:`Overlap` chooses.
        """
        done: set = set()
        for eqn in eqns:
            if eqn.outvars and eqn.outvars[0] in self._made_by:
                for var in eqn.outvars:
                    env[var] = _Deferred(eqn)
                continue
            if id(eqn) in done:
                continue
            siblings = self._siblings.get(id(eqn), [])
            if siblings and all(R.is_literal(v) or v in env for e in siblings for v in e.invars):
                self._run_siblings(siblings, env, lay)
                done.update(id(e) for e in siblings)
                continue
            self._gather_for(eqn, env)
            self._run(eqn, env, lay)

    def _run_siblings(self, eqns, env: dict, lay: dict) -> None:
        """The matmuls of one layer that read the same input (q, k, v), run at the first:
        outputs reduce-scattered onto the batch over the same axes take one reduce-scatter
        (:func:`~axonn_jax.runtime.param_reads.reduce_scatter_together`)."""
        held: dict = {}
        for eqn in eqns:
            self._gather_for(eqn, env)
            with source_context(eqn.source_info):
                self._run_here(eqn, env, lay, held=held)
        for (axes, onto), items in held.items():
            outs = reduce_scatter_together([out for _, out in items], axes, onto)
            for (var, _), out in zip(items, outs):
                env[var] = out

    def _gather_for(self, eqn, env: dict) -> None:
        """Read the parameters due at ``eqn``, tied to its activation inputs.

        A layer's weights are read together when it starts (one all-gather
        per dtype), or one layer ahead with OAG.
        """
        params = self.jaxpr.invars

        def stored(ids):
            return [i for i in ids if isinstance(env.get(params[i]), _Stored)]

        due = stored(self._needs.get(id(eqn), []))
        layer = stored(self._starts.get(id(eqn), []))
        ahead = stored(self._prefetch.get(id(eqn), [])) if self.overlap.gather else []
        tied = ahead if self.overlap.gather else list(dict.fromkeys(layer + due))
        tied = [i for i in tied if needs_gather(env[params[i]].storage, self.grid)]
        if tied:
            anchors = [v for v in eqn.invars if not R.is_literal(v) and v in env
                       and not isinstance(env[v], (_Stored, _Deferred, _Lazy))]  # fmt: skip
            # without ORS, the gradients of the activations computed from parameters
            # (so differentiated) wait for these weights' gradient reductions
            waiting = [] if self.overlap.reduce_scatter else [
                v for v in anchors if v in self._param_dependent and is_float(env[v])]  # fmt: skip
            shards, waited = tie([env[params[i]].shard for i in tied],
                                 after=[env[v] for v in anchors],
                                 backward_with=[env[v] for v in waiting])  # fmt: skip
            for v, value in zip(waiting, waited):
                env[v] = value
            for i, shard in zip(tied, shards):
                env[params[i]].shard = shard
        # the layer ahead (tied) in one read, then this layer's and this equation's own
        for ids in (tied, layer + due):
            by_bucket: dict = {}
            for i in stored(dict.fromkeys(ids)):
                by_bucket.setdefault(self._bucket_of.get(i), []).append(i)
            for b, ids in by_bucket.items():
                reads = read_params([env[params[i]].shard for i in ids],
                                    [env[params[i]].storage for i in ids], self.grid,
                                    None if b is None else self._open_bucket(b, env), ids)  # fmt: skip
                for i, value in zip(ids, reads):
                    env[params[i]] = value

    def _open_bucket(self, b: int, env: dict) -> dict:
        """Gradient bucket ``b``'s sinks (:func:`~axonn_jax.runtime.param_reads.open_buckets`),
        opened at its first read over its members not read yet (a pipeline stage's)."""
        key = ("grad bucket", b)
        if key not in env:
            params = self.jaxpr.invars
            members = [i for i in self._buckets[b] if isinstance(env.get(params[i]), _Stored)]
            env[key] = open_buckets({i: env[params[i]].shard for i in members}, self.grid)
        return env[key]

    def value(self, var, env: dict, lay: dict):
        """``env[var]``, running a deferred parameter chain (or read) first."""
        value = env[var]
        if isinstance(value, _Stored):
            env[var] = read_param(value.shard, value.storage, self.grid)
        elif isinstance(value, _Deferred):
            for v in value.eqn.invars:
                if not R.is_literal(v):
                    self.value(v, env, lay)
            self._run(value.eqn, env, lay)
        return env[var]

    def outputs(self, env: dict, lay: dict, outvars, targets: Sequence[Layout]) -> list:
        """Local values of ``outvars`` in layouts ``targets`` (one copy where replicated)."""
        outs = []
        for var, target in zip(outvars, targets):
            if R.is_literal(var):
                outs.append(jnp.asarray(var.val))
                continue
            value = self._materialise(self.value(var, env, lay), lay[var], target, frozenset())
            outs.append(_one_copy(value, target))
        return outs

    def _run(self, eqn, env, lay) -> None:
        # the local equations carry the model's source line and module names (profiles, reports)
        with source_context(eqn.source_info):
            self._run_here(eqn, env, lay)

    def _run_here(self, eqn, env, lay, held: dict | None = None) -> None:
        """Run one equation; ``held``: collects reduce-scatters by (axes, dim) instead of issuing them."""
        if eqn.primitive.name in CONTROL_FLOW:
            self._run_control_flow(eqn, env, lay)
            return
        for var in eqn.invars:
            if not R.is_literal(var):
                self.value(var, env, lay)
        layouts = [
            ((),) * len(R.shape_of(v)) if R.is_literal(v) else lay[v] for v in eqn.invars
        ]
        step = R.rule(eqn, layouts, self.ctx)
        if eqn.primitive.name == "broadcast_in_dim" and len(eqn.invars) == 1:
            var = eqn.invars[0]
            literal = R.is_literal(var)
            operand = var.val if literal else env[var]
            if not isinstance(operand, _Lazy):
                env[eqn.outvars[0]] = _Lazy(
                    operand,
                    layouts[0],
                    tuple(eqn.params["broadcast_dimensions"]),
                    R.shape_of(var),
                    tuple(eqn.params["shape"]),
                    literal,
                )
                lay[eqn.outvars[0]] = step.outs[0]
                return
        values: list = [None] * len(eqn.invars)
        lazy = []
        partial = self._partial_gathers(eqn, layouts, step.targets, env)
        for i, (var, src, dst) in enumerate(zip(eqn.invars, layouts, step.targets)):
            if R.is_literal(var):
                values[i] = var.val
            elif isinstance(env[var], _Lazy):
                lazy.append(i)
            else:  # one relayout per value and layout (q, k and v read the same gathered input)
                key = ("relayout", var, live(dst, self.grid), partial[i])
                if key not in env:
                    env[key] = relayout(env[var], src, dst, self.grid, partial[i])
                values[i] = env[key]
        together = frozenset().union(
            *(vma(values[i]) for i, v in enumerate(eqn.invars) if i not in lazy and not R.is_literal(v))
        )
        for i in lazy:
            values[i] = self._materialise(env[eqn.invars[i]], layouts[i], step.targets[i], together)
        if step.local:
            outs = KERNELS[step.local](eqn, values, step, self.grid,
                                       lambda vals, params: self._bind(eqn, vals, params))  # fmt: skip
        else:
            outs = self._bind(eqn, values, step.params, ordered=any(partial))
        for k, (var, out) in enumerate(zip(eqn.outvars, outs)):
            axes = tuple(a for a in step.reduce[k] if self.grid.axis_size(a) > 1)
            onto = step.scatter[k] if step.scatter else None
            if axes and onto is not None and held is not None:
                held.setdefault((axes, onto), []).append((var, out))
                lay[var] = step.outs[k]
                continue
            if axes and onto is not None:
                out = lax.psum_scatter(out, axes, scatter_dimension=onto, tiled=True)
            elif axes:
                out = lax.psum(out, axes)
            env[var], lay[var] = out, step.outs[k]

    def _run_control_flow(self, eqn, env, lay) -> None:
        """A scan / while / cond rebuilt around its bodies run on local shards (runtime.loops).

        Stacked parameters a scan slices (``xs``) enter the loop as their
        stored shards: each iteration reads (depth-gathers) one layer, and the
        backward reduce-scatters its gradient, inside the loop.
        """
        layouts = [((),) * len(R.shape_of(v)) if R.is_literal(v) else self._layout(v, env, lay)
                   for v in eqn.invars]  # fmt: skip
        step = R.rule(eqn, layouts, self.ctx)
        found = CF.bodies(eqn)
        sliced = {k for body in found for kind, k in body.inputs if kind == CF.SLICE}
        values, storage = [], {}
        for k, (var, target) in enumerate(zip(eqn.invars, step.targets)):
            if R.is_literal(var):
                values.append(jnp.asarray(var.val, dtype=var.aval.dtype))
            elif k in sliced and isinstance(self._stored_layers(var, env), _Stored):
                stored = self._stored_layers(var, env)
                values.append(stored.shard)
                storage[k] = stored.storage[1:]
            else:
                value = env[var] if isinstance(env[var], _Lazy) else self.value(var, env, lay)
                values.append(self._materialise(value, layouts[k], target, frozenset()))

        def run_body(b: int, inputs: list) -> list:
            body = found[b]
            inputs = [_Stored(x, storage[k]) if kind == CF.SLICE and k in storage else x
                      for x, (kind, k) in zip(inputs, body.inputs)]  # fmt: skip
            return self.run_body(body.jaxpr, body.consts, step.loop.bodies[b], inputs)

        outs = loops.run(eqn, values, run_body)
        for var, out, layout in zip(eqn.outvars, outs, step.outs):
            env[var], lay[var] = out, layout

    def _layout(self, var, env: dict, lay: dict) -> Layout:
        """The layout of ``var``, also when it is a parameter cast chain not run yet."""
        if var not in lay and isinstance(env.get(var), _Deferred):
            eqn = env[var].eqn
            ins = [((),) * len(R.shape_of(v)) if R.is_literal(v) else self._layout(v, env, lay)
                   for v in eqn.invars]  # fmt: skip
            for out, layout in zip(eqn.outvars, R.rule(eqn, ins, self.ctx).outs):
                lay[out] = layout
        return lay[var]

    def _stored_layers(self, var, env):
        """The stored shard of a stacked parameter, or of the range of its layers a pipeline
        stage runs (a deferred ``slice`` along dim 0 of it), else None."""
        value = env[var]
        if isinstance(value, _Deferred) and is_layer_range(value.eqn):
            source = value.eqn.invars[0]
            inner = env.get(source)
            if isinstance(inner, _Stored):
                start, limit = value.eqn.params["start_indices"][0], value.eqn.params["limit_indices"][0]
                return _Stored(lax.slice_in_dim(inner.shard, start, limit), inner.storage)
        return value if isinstance(value, _Stored) else None

    def run_body(self, jaxpr, consts, layouts: CF.BodyLayouts, inputs: Sequence) -> list:
        """Outputs of a control-flow body on local ``inputs``, in the layouts it leaves in."""
        env: dict = {}
        lay: dict = {}
        for var, x in zip(jaxpr.constvars, consts):
            env[var], lay[var] = x, ((),) * jnp.ndim(x)
        for var, x, layout in zip(jaxpr.invars, inputs, layouts.ins):
            env[var], lay[var] = x, layout
        self.run(jaxpr.eqns, env, lay)
        outs = []
        for var, target in zip(jaxpr.outvars, layouts.outs):
            if R.is_literal(var):
                outs.append(jnp.asarray(var.val, dtype=var.aval.dtype))
                continue
            outs.append(self._materialise(self.value(var, env, lay), lay[var], target, frozenset()))
        return outs

    def _partial_gathers(self, eqn, layouts, targets, env) -> list[frozenset]:
        """Per operand of a matmul: the axes its gather may leave to a reduce-scatter (OAR).

        An operand gathered over an axis that splits a free dim of the other
        operand (the default program's batch all-gather before a layer: the
        layer's output axis, which splits the weight's output features) gets,
        on each device, only that device's share of its gradient. Gathered
        typed varying (:func:`relayout`), its gradient is reduce-scattered back
        onto the scattered dim: half the bytes of the all-reduce and slice of
        an invariant gather, and one reduce-scatter for every matmul reading
        it (q, k, v). Only with OAR (``Overlap.all_reduce``), which places it.
        """
        none = [frozenset()] * len(eqn.invars)
        if eqn.primitive.name != "dot_general" or not self.overlap.all_reduce or any(
            R.is_literal(v) or isinstance(env[v], _Lazy) or not is_float(env[v]) for v in eqn.invars
        ):  # fmt: skip
            return none
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        paired = (set(lc) | set(lb), set(rc) | set(rb))
        free = [{a for d, axes in enumerate(live(t, self.grid)) if d not in paired[i] for a in axes}
                for i, t in enumerate(targets)]  # fmt: skip
        out = []
        for i, (src, dst) in enumerate(zip(layouts, targets)):
            gathered = {a for s, t in zip(live(src, self.grid), live(dst, self.grid))
                        for a in s[len(common_prefix(s, t)):]}  # fmt: skip
            out.append(frozenset(gathered & free[1 - i] & vma(env[eqn.invars[i]])))
        return out

    def _bind(self, eqn, values: list, params: dict, ordered: bool = False) -> list:
        """Bind the primitive on local shards (operands marked varying alike).

        ``ordered``: an operand's gradient is reduce-scattered by its gather's
        transpose (:meth:`_partial_gathers`): the backward is written out too.
        """
        if eqn.primitive.name == "dot_general" and all(
            isinstance(v, jax.Array) and is_float(v) for v in values
        ):
            together = vma(values[0]) | vma(values[1])
            lhs_missing, rhs_missing = together - vma(values[0]), together - vma(values[1])
            if lhs_missing or rhs_missing or ordered:  # a gradient reduction: order it (OAR)
                out = contraction(
                    lambda a, b: eqn.primitive.bind(a, b, **params),
                    values[0],
                    values[1],
                    lhs_missing=lhs_missing,
                    rhs_missing=rhs_missing,
                    overlap_all_reduce=self.overlap.all_reduce,
                )
                return [out]
        values = match_vma(values, [v.aval.dtype for v in eqn.invars])
        if eqn.primitive.name in R.POINTWISE_CALLS:
            return bind_custom_jvp(params, values)
        outs = eqn.primitive.bind(*values, **params)
        return outs if eqn.primitive.multiple_results else [outs]

    def _materialise(self, value, src: Layout, dst: Layout, together: frozenset):
        """A concrete local array of ``value`` in layout ``dst``.

        A lazy broadcast is built directly at the local shape of ``dst``, its
        operand first marked varying over ``together`` (the axes the other
        operands vary over) so that gradients are reduced at operand size.
        """
        if not isinstance(value, _Lazy):
            return relayout(value, src, dst, self.grid)
        need: list[tuple[str, ...]] = [()] * len(value.in_shape)
        for s_dim, o_dim in enumerate(value.dims):
            if value.in_shape[s_dim] == value.out_shape[o_dim]:
                need[s_dim] = dst[o_dim]
        operand = value.operand
        if not value.literal:
            operand = relayout(operand, value.operand_layout, tuple(need), self.grid)
            operand = vary(operand, together)
        shape = local_shape(value.out_shape, dst, self.grid)
        return lax.broadcast_in_dim(operand, shape, value.dims)


def _one_copy(x: jax.Array, layout: Layout) -> jax.Array:
    """Make a value that is replicated over some axes also *typed* invariant there.

    A value computed identically on every device of an axis (e.g. after a
    replicated fallback) can still be typed varying, because the parameters
    it depends on are. Returning it as replicated takes one device's copy: an
    all-gather whose transpose hands the cotangent to exactly that copy, so
    gradients are not multiplied by the axis size.
    """
    extra = tuple(sorted(vma(x) - used_axes(layout)))
    if not extra:
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(_one_copy(jax.random.key_data(x), layout + ((),)), impl=impl)
    if not is_float(x):  # integers (e.g. nnx RNG state): no gradient, so the first device's copy
        first = functools.reduce(jnp.logical_and, [lax.axis_index(a) == 0 for a in extra])
        return lax.psum(jnp.where(first, x, jnp.zeros_like(x)), extra)
    return lax.all_gather(x, extra, axis=0, tiled=False, to="invarying")[0]

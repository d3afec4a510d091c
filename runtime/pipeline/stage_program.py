"""Per-stage compiled programs of a pipelined model.

What each stage reads and sends is planned by the partitioner
(:class:`~axonn_jax.partitioner.flows.StageFlow`, part of the
:class:`~axonn_jax.partitioner.program.Program`). :class:`StageProgram`
compiles, once, the three programs the dispatch queue runs on one microbatch: ``forward`` (outbound values + the residuals for the
backward), ``backward`` (parameter and inbound gradients from the outbound
cotangents), and on the last stage ``forward_backward`` (loss and gradients
in one program); ``forward_only`` serves evaluation and sampling. Each runs the 4D executor inside ``shard_map`` on the stage's
own mesh.

Example:
    >>> executor = Executor(program)                                          # doctest: +SKIP
    >>> stage = StageProgram(program.stage_flows[0], executor, mesh, last=False)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.stages import Compiled

from axonn_jax.partitioner.flows import StageFlow
from axonn_jax.partitioner.layout import Layout
from axonn_jax.runtime.executor import Executor
from axonn_jax.runtime.pipeline.backward_split import BackwardSplit
from axonn_jax.runtime.sharded import on_mesh, sharding, spec


class StageProgram:
    """The compiled programs of one stage, on its mesh.

    ``loss_fn(outputs, batch) -> (loss, aux)`` (a
    :class:`~axonn_jax.runtime.loss_program.ScalarLoss`; ``aux`` ``None`` without
    ``has_aux``) is applied on the last stage to the model outputs (rebuilt with
    ``out_tree``; state updates there are ``None``) and the microbatch ``batch``; the
    last stage's programs return the pair where they return the loss. Model state a stage updates (``flow.updates``)
    is returned next to its parameter gradients, ``(grads, updates)``, so the
    dispatch queue sums both over microbatches. Only ``trainable`` parameters
    are differentiated.
    """

    def __init__(
        self,
        flow: StageFlow,
        executor: Executor,
        mesh: jax.sharding.Mesh,
        *,
        last: bool,
        out_tree=None,
        loss_fn: Callable | None = None,
        remat: Callable[[Callable], Callable] | None = None,
        trainable: tuple[bool, ...] = (),
    ):
        self.flow, self.executor, self.grid, self.mesh = flow, executor, executor.grid, mesh
        #: positions in ``flow.params`` of the differentiated parameters (model state is not)
        self.trained = [k for k, i in enumerate(flow.params) if not trainable or trainable[i]]
        self.last = last
        self.out_tree, self.loss_fn = out_tree, loss_fn
        self._remat = remat or (lambda f: f)
        self.diff_in, self.diff_out = flow.diff_in, flow.diff_out
        self._body = self._shard_mapped()
        self.forward = jax.jit(self._forward)
        self.backward = jax.jit(self._backward)
        self.forward_backward = jax.jit(self._forward_backward)
        #: ``(outbound values or model outputs, state updates)``: no residuals
        self.forward_only = jax.jit(self._body)
        #: split backward (zero-bubble schedules), built by :meth:`split_backward`: B is
        #: ``backward_input(residuals, cotangents) → (inbound gradients, carried)`` (last stage:
        #: ``forward_backward_input(...) → (loss, inbound gradients, W's inputs)``), W is
        #: ``backward_weights(*weight_inputs(...)) → (gradients, state updates)``
        self.backward_input: Callable | None = None
        self.forward_backward_input: Callable | None = None
        self.backward_weights: Callable | None = None
        self._split: BackwardSplit | None = None
        self.split_compiled = False  # True once compile(split=True) compiled B and W
        self.compiled = False  # True once compile() replaced the jits by executables
        self.forward_compiled = False  # True once compile_forward_only() ran

    # --- shardings -------------------------------------------------------
    def spec(self, layout: Layout):
        return spec(layout, self.grid)

    def sharding(self, layout: Layout) -> NamedSharding:
        return sharding(self.mesh, self.grid, layout)

    def param_sharding(self, i: int) -> NamedSharding:
        """Where parameter ``i`` (model leaf index) is read by this stage."""
        return self.sharding(self.executor.param_storage[i])

    @property
    def inbound_shardings(self) -> list[NamedSharding]:
        return [self.sharding(l) for l in self.flow.inbound_layouts]

    @property
    def outbound_shardings(self) -> list[NamedSharding]:
        return [self.sharding(l) for l in self.flow.outbound_layouts]

    def inbound_avals(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=s)
                for v, s in zip(self.flow.inbound, self.inbound_shardings)]  # fmt: skip

    # --- the stage as a function of local shards --------------------------
    def _shard_mapped(self) -> Callable:
        flow, ex = self.flow, self.executor
        storage = [ex.param_storage[i] for i in flow.params]
        arg_layouts = [ex.arg_layouts[j] for j in flow.args]

        updates = [v for v, _ in flow.updates]
        rows = [(k, r) for k, i in enumerate(flow.params) if (r := flow.rows_of(i))]

        def body(params, args, inbound):
            for k, (first, end) in rows:  # its slices index these rows (partitioner.flows)
                if params[k].shape[0] != end - first:
                    raise ValueError(
                        f"stage {flow.index} reads rows {first}:{end} of parameter {flow.params[k]} but "
                        f"was given {params[k].shape[0]}: pass layer_rows.rows_given(flow, i, leaf)"
                    )
            env, lay = ex.bind(params, args, param_vars=flow.params, arg_vars=flow.args)
            for var, x, layout in zip(flow.inbound, inbound, flow.inbound_layouts):
                env[var], lay[var] = x, layout
            ex.run(flow.eqns, env, lay)
            return (ex.outputs(env, lay, flow.outbound, flow.outbound_layouts),
                    ex.outputs(env, lay, updates, flow.update_layouts))  # fmt: skip

        return on_mesh(body, self.mesh, self.grid,
                       in_layouts=[storage, arg_layouts, list(flow.inbound_layouts)],
                       out_layouts=(list(flow.outbound_layouts), list(flow.update_layouts)))  # fmt: skip

    def _split_inbound(self, inbound):
        return [inbound[i] for i in self.diff_in]

    def _merge(self, inbound, diff):
        merged = list(inbound)
        for i, x in zip(self.diff_in, diff):
            merged[i] = x
        return merged

    def _stage_fn(self, params, args, inbound):
        """f(trained params, differentiable inbound) → (differentiable outbound, (outbound, updates))."""

        def f(trained, diff):
            merged = list(params)
            for k, x in zip(self.trained, trained):
                merged[k] = x
            outs, updates = self._body(merged, args, self._merge(inbound, diff))
            return [outs[i] for i in self.diff_out], (outs, updates)

        return self._remat(f)

    def _trained(self, params) -> list:
        return [params[k] for k in self.trained]

    def traceable(self) -> tuple[Callable, Callable]:
        """The ``(forward, backward)`` of one microbatch before ``jax.jit`` (step reports trace them)."""
        return self._forward, self._backward

    # --- the compiled programs --------------------------------------------
    def _forward(self, params, args, inbound):
        """One microbatch forward: (outbound values, residuals for :meth:`backward`)."""
        f = self._stage_fn(params, args, inbound)
        _, vjp, (outs, updates) = jax.vjp(f, self._trained(params), self._split_inbound(inbound), has_aux=True)
        return outs, (vjp, updates)

    @staticmethod
    def _backward(residuals, cotangents):
        """``((gradients of the trained params, state updates), inbound gradients)``."""
        vjp, updates = residuals
        g_params, g_in = vjp(cotangents)
        return (list(g_params), list(updates)), g_in

    def _loss_fn(self, params, args, inbound, batch) -> Callable:
        """Last stage: ``(trained params, differentiable inbound) → (loss, (state updates, aux))``."""
        f = self._stage_fn(params, args, inbound)
        positions = self.flow.output_positions

        def loss(trained, diff):
            _, (outs, updates) = f(trained, diff)
            full = [None] * self.out_tree.num_leaves
            for k, x in zip(positions, outs):
                full[k] = x
            value, aux = self.loss_fn(jax.tree.unflatten(self.out_tree, full), batch)
            return value, (updates, aux)

        return loss

    def _forward_backward(self, params, args, inbound, batch):
        """Last stage: ``(loss, aux)`` of one microbatch, gradients (+ state updates) and inbound
        gradients."""
        loss = self._loss_fn(params, args, inbound, batch)
        (value, (updates, aux)), (g_params, g_in) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            self._trained(params), self._split_inbound(inbound)
        )  # fmt: skip
        return (value, aux), (list(g_params), list(updates)), g_in

    def _loss_forward(self, params, args, inbound, batch):
        """Last stage: ``(loss, aux)`` of one microbatch and the residuals of its backward."""
        loss = self._loss_fn(params, args, inbound, batch)
        value, vjp, (updates, aux) = jax.vjp(loss, self._trained(params), self._split_inbound(inbound),
                                             has_aux=True)  # fmt: skip
        return (value, aux), (vjp, updates)

    # --- the split backward (B, then W) ---------------------------------------
    def split_backward(self, params, args, batch=None) -> BackwardSplit:
        """Cut this stage's backward into B and W (:mod:`.backward_split`) and set
        :attr:`backward_input` (or, last stage, :attr:`forward_backward_input`) and
        :attr:`backward_weights`; ``params``/``args``/``batch`` as in :meth:`compile`."""
        if self._split is not None:
            return self._split
        inbound = self.inbound_avals()
        if self.last:
            (value, _), residuals = jax.eval_shape(self._loss_forward, params, args, inbound, batch)
            cotangents = jax.ShapeDtypeStruct(value.shape, value.dtype)
        else:
            _, residuals = jax.eval_shape(self._forward, params, args, inbound)
            cotangents = self.outbound_cotangent_avals()
        leaves, tree = jax.tree.flatten((residuals, cotangents))

        def backward(*flat):
            (g_params, updates), g_in = self._backward(*jax.tree.unflatten(tree, flat))
            return [*g_params, *updates, *g_in]

        n_in = len(self.diff_in)
        n_out = len(jax.eval_shape(backward, *leaves))
        split = BackwardSplit(backward, leaves, [k >= n_out - n_in for k in range(n_out)])
        n_params = len(self.trained)

        def weights(kept, carried):
            flat = split.weight_gradients(kept, carried)
            return list(flat[:n_params]), list(flat[n_params:])

        def input_backward(residuals, cotangents):
            return split.input_gradients(*jax.tree.leaves((residuals, cotangents)))

        def forward_input_backward(params, args, inbound, batch):
            (value, aux), residuals = self._loss_forward(params, args, inbound, batch)
            flat = jax.tree.leaves((residuals, jax.numpy.ones_like(value)))
            g_in, carried = split.input_gradients(*flat)
            return (value, aux), g_in, (split.kept(flat), carried)  # the kept residuals are new values here

        self.backward_weights = jax.jit(weights)
        if self.last:
            self.forward_backward_input = jax.jit(forward_input_backward)
        else:
            self.backward_input = jax.jit(input_backward)
        self._split = split
        return split

    @property
    def backward_split(self) -> BackwardSplit | None:
        """The B/W cut of this stage's backward (None until a zero-bubble schedule built it)."""
        return self._split

    def weight_inputs(self, residuals, cotangents, carried) -> tuple[list, list]:
        """What W reads: the residual and gradient leaves it uses (picked outside B's program,
        so they are not copied) and the values B ``carried`` to it."""
        return self._split.kept(jax.tree.leaves((residuals, cotangents))), list(carried)

    def compile(self, params, args, batch=None, *, split: bool = False) -> None:
        """Compile this stage's programs ahead of time (before any message is exchanged).

        ``params``/``args``/``batch`` are arrays or ShapeDtypeStructs of one
        microbatch; afterwards :attr:`forward`, :attr:`backward` and
        :attr:`forward_backward` are the compiled executables, so the first step
        measures (and times out on) communication only, not a peer's compilation.
        """
        inbound = self.inbound_avals()
        if split:
            self.split_backward(params, args, batch)
        forward = None
        if not self.last:
            forward = self.forward if isinstance(self.forward, Compiled) else self.forward.lower(params, args, inbound).compile()
        if split and not self.split_compiled:
            if self.last:
                first = self.forward_backward_input.lower(params, args, inbound, batch).compile()
                _, _, w_state = first.out_info
                self.forward_backward_input = first
            else:
                residuals, cotangents = forward.out_info[1], self.outbound_cotangent_avals()
                first = self.backward_input.lower(residuals, cotangents).compile()
                w_state = self.weight_inputs(residuals, cotangents, first.out_info[1])
                self.backward_input = first
            self.backward_weights = self.backward_weights.lower(*w_state).compile()
            self.split_compiled = True
        if not split and not self.compiled:
            if self.last:
                self.forward_backward = self.forward_backward.lower(params, args, inbound, batch).compile()
            else:
                self.backward = self.backward.lower(forward.out_info[1], self.outbound_cotangent_avals()).compile()
            self.compiled = True
        if forward is not None:
            self.forward = forward

    def compile_forward_only(self, params, args) -> None:
        """Compile :attr:`forward_only` (outbound values or the model outputs, and state updates)."""
        self.forward_only = self.forward_only.lower(params, args, self.inbound_avals()).compile()
        self.forward_compiled = True

    def outbound_cotangent_avals(self) -> list[jax.ShapeDtypeStruct]:
        shardings = self.outbound_shardings
        return [jax.ShapeDtypeStruct(self.flow.outbound[i].aval.shape,
                                     self.flow.outbound[i].aval.dtype, sharding=shardings[i])
                for i in self.diff_out]  # fmt: skip

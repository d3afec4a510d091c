"""The search behind ``axonn_jax.health``: the first layer (and stage) that makes a NaN or Inf.

The planned model runs on its own grid (same layouts, same collectives),
stage by stage in this process, with a finiteness flag after every equation
of the forward pass and, given a loss, of the backward pass
(:class:`~axonn_jax.runtime.probe.ProbedStage`). :func:`first_nonfinite`
returns a :class:`NonFinite` naming the first offender — a model input, a
parameter, an equation of the forward pass, the loss, the backward of an
equation, or a parameter gradient — with its primitive, its layer (the linen
module path, or for nnx the parameters nearest to it in the data flow) and
its pipeline stage.

Example:
    >>> found = first_nonfinite(pm.engine, params, (tokens,), {}, loss_fn=loss)   # doctest: +SKIP
    >>> print(found)                                                              # doctest: +SKIP
    NaN in the forward pass: equation 41 'log' in layer 'block_1/mlp' ..., pipeline stage 1 of 2
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from axonn_jax.partitioner.flows import is_float
from axonn_jax.partitioner.provenance import EquationInfo, Provenance
from axonn_jax.partitioner.trace import call_leaves, is_static, path_string
from axonn_jax.runtime.executor import Executor
from axonn_jax.runtime.pipeline.layer_rows import rows_given
from axonn_jax.runtime.probe import NAN, ProbedStage, badness, is_drop
from axonn_jax.runtime.sharded import place

if TYPE_CHECKING:
    from axonn_jax.runtime.engine import Engine

#: where a non-finite value was first seen, in the order the checks run
WHERES = ("input", "parameter", "forward", "loss", "backward", "gradient")


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first non-finite value found by :func:`first_nonfinite`."""

    where: str  # one of WHERES
    kind: str  # "NaN" or "Inf"
    stage: int | None  # pipeline stage (0 without a pipeline)
    num_stages: int
    equation: EquationInfo | None = None  # the equation (forward/backward)
    name: str | None = None  # the input or parameter path (input/parameter/gradient)
    shape: tuple[int, ...] = ()
    dtype: str = ""
    detail: str = ""

    @property
    def layer(self) -> str | None:
        return self.equation.module if self.equation else None

    def __str__(self) -> str:
        stage = ""
        if self.stage is not None and self.num_stages > 1:
            stage = f"pipeline stage {self.stage} of {self.num_stages}"
        head = {
            "input": f"{self.kind} in model input {self.name}",
            "parameter": f"{self.kind} in parameter '{self.name}'",
            "forward": f"{self.kind} first produced in the forward pass by {self.equation}",
            "loss": f"{self.kind} in the loss although the model outputs are finite",
            "backward": f"{self.kind} first produced in the backward pass by the backward of "
            f"{self.equation}",
            "gradient": f"{self.kind} in the gradient of parameter '{self.name}'",
        }[self.where]
        parts = [head]
        if self.shape or self.dtype:
            parts.append(f"value {self.dtype}{list(self.shape)}")
        if stage:
            parts.append(stage)
        text = ", ".join(parts)
        if self.detail:
            text += f"; {self.detail}"
        return text + ". " + _REMEDY[self.where]


_REMEDY = {
    "input": "Remedy: clean the data (e.g. np.nan_to_num) or fix the loader.",
    "parameter": "Remedy: restore the parameters from an earlier checkpoint or lower the "
    "learning rate (the last update made them non-finite).",
    "forward": "Remedy: guard the operation (e.g. clip its input, add an epsilon), lower the "
    "learning rate, or use float32 for this layer.",
    "loss": "Remedy: check the loss function (log of 0, division by 0, empty mask).",
    "backward": "Remedy: guard the operation's gradient (e.g. sqrt/log near 0), or clip its input.",
    "gradient": "Remedy: guard the operations using this parameter or clip gradients.",
}


_BADNESS = jax.jit(badness)


def _read(x) -> np.ndarray:
    """A replicated value (or host array) as NumPy, on any process."""
    if isinstance(x, jax.Array):
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _kind(flag: float) -> str:
    return "NaN" if flag >= NAN else "Inf"


def first_nonfinite(engine: Engine, params, args: tuple, kwargs: dict, *, loss_fn: Callable | None = None,
                    intermediates: bool = False) -> NonFinite | None:  # fmt: skip
    """The first NaN/Inf that the engine's model produces on ``args``/``kwargs`` (``None`` if none).

    See :func:`axonn_jax.health.first_nonfinite`; the probed programs are
    compiled once per engine and input signature.
    """
    leaves, static = call_leaves(args, kwargs)
    key = (tuple((tuple(np.shape(x)), _dtype(x)) for x in leaves),
           jax.tree.structure((args, kwargs)), static)  # fmt: skip
    per_engine = _SEARCHES.setdefault(engine, {})
    if key not in per_engine:
        per_engine[key] = NonFiniteSearch(engine, args, kwargs)
    return per_engine[key].find(params, args, kwargs, loss_fn, intermediates=intermediates)


#: per engine: its searches by input signature (programs compiled once)
_SEARCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class NonFiniteSearch:
    """The probed programs of a model for one input signature, and the search over their flags."""

    def __init__(self, engine: Engine, args: tuple, kwargs: dict[str, Any]):
        placed = engine.placed
        if placed.spread:
            raise NotImplementedError(
                f"first_nonfinite runs every pipeline stage in one process, but {engine.grid} spreads "
                "the stages over several processes. Remedy: run the check in one process with "
                "simulated devices (XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{engine.grid.size}) and the same grid."
            )
        self.placed, self.plan = placed, engine.plan
        program = engine.program_for(args, kwargs)
        self.traced = program.traced
        self.prov = Provenance(program.traced, program.jaxpr, root=type(engine.model).__name__)
        executor = Executor(program, overlap=engine.overlap)
        self.stages = [ProbedStage(f, executor, placed.meshes[f.index]) for f in program.stage_flows]
        self.index = {id(e): k for k, e in enumerate(program.jaxpr.eqns)}

    # --- running -----------------------------------------------------------
    def find(self, params, args: tuple, kwargs: dict, loss_fn: Callable | None, *,
             intermediates: bool) -> NonFinite | None:  # fmt: skip
        """Run the checks on concrete values and report the first offender."""
        leaves = self.placed.param_leaves(params)
        self.placed.check_params(params)
        arg_leaves, _ = call_leaves(args, kwargs)  # arrays only: Python scalars are static
        found = self._inputs(args, kwargs) or self._params(leaves)
        if found:
            return found
        forward, vjps, outs = [], [], []
        for st in self.stages:
            ex = st.executor
            p = [place(rows_given(st.flow, i, leaves[i]), st.sharding(ex.param_storage[i])) for i in st.flow.params]
            a = [place(arg_leaves[j], st.sharding(ex.arg_layouts[j])) for j in st.flow.args]
            inbound = [place(x, st.sharding(l)) for x, l in zip(outs, st.flow.inbound_layouts)]
            if loss_fn is None:
                outs, flags = st.forward(p, a, inbound)
            else:
                outs, flags, vjp = st.forward_vjp(p, a, inbound)
                vjps.append(vjp)
            forward.append(flags)
        bad_out = any(float(_read(_BADNESS(o))) for o in outs)
        loss_flag = 0.0
        backward: list = []
        grads: dict[int, float] = {}
        if loss_fn is not None:
            flag, cts = self._loss(loss_fn, outs)
            loss_flag = float(_read(flag))
            for st, vjp in zip(reversed(self.stages), reversed(vjps)):
                cts = [place(c, st.sharding(st.flow.outbound_layouts[i]))
                       for c, i in zip(cts, st.diff_out)]  # fmt: skip
                g_bad, cts, flags = st.backward(vjp, cts)
                backward.insert(0, flags)
                for i, g in zip(st.flow.params, g_bad):
                    grads[i] = max(grads.get(i, 0.0), float(_read(g)))
        if intermediates or bad_out or loss_flag:
            found = self._forward(forward)
            if found:
                return found
        if loss_flag:
            return NonFinite("loss", _kind(loss_flag), len(self.stages) - 1, len(self.stages))
        if intermediates or any(grads.values()):
            found = self._backward(backward)
            if found:
                return found
        for i, flag in sorted(grads.items()):
            if flag:
                return self._param_report("gradient", i, flag)
        return None

    def _loss(self, loss_fn: Callable, outs: list):
        last = self.stages[-1]
        tree = self.traced.out_tree

        def loss(diff, merged):
            merged = list(merged)
            for i, x in zip(last.diff_out, diff):
                merged[i] = x
            value = loss_fn(jax.tree.unflatten(tree, merged))
            return value, badness(value)

        (_, flag), cts = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            [outs[i] for i in last.diff_out], outs
        )
        return flag, cts

    # --- reporting -----------------------------------------------------------
    def _inputs(self, args: tuple, kwargs: dict) -> NonFinite | None:
        for path, x in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
            if is_static(x):
                continue
            flag = float(_read(_BADNESS(x)))
            if flag:
                return NonFinite("input", _kind(flag), None, len(self.stages),
                                 name=_arg_name(path_string(path)), shape=tuple(np.shape(x)),
                                 dtype=_dtype(x))  # fmt: skip
        return None

    def _params(self, leaves) -> NonFinite | None:
        for i, x in enumerate(leaves):
            flag = 0.0 if x is None else float(_read(_BADNESS(x)))
            if flag:
                return self._param_report("parameter", i, flag)
        return None

    def _forward(self, forward) -> NonFinite | None:
        """The first flagged output in execution order."""
        for st, flags in zip(self.stages, forward):
            values = _read(flags)
            for t, (pos, k) in enumerate(st.slots):
                if values[t]:
                    return self._eqn_report("forward", st, pos, k, values[t])
        return None

    def _backward(self, backward) -> NonFinite | None:
        """The first flagged gradient in backward order (last stage, last equation first)."""
        for st, flags in zip(reversed(self.stages), reversed(backward)):
            values = _read(flags)
            for t in reversed(range(len(st.slots))):
                if values[t]:
                    pos, k = st.slots[t]
                    return self._backward_report(st, pos, k, values[t])
        return None

    def _param_report(self, where: str, i: int, flag: float) -> NonFinite:
        p = self.plan.params[i]
        users = self.prov.param_users(i)
        stage = self._stage_of(users[0]) if users else None
        detail = f"first used by {self.prov.info(users[0])}" if users else "unused by the model"
        return NonFinite(where, _kind(flag), stage, len(self.stages), name=p.path,
                         shape=p.shape, dtype=p.dtype, detail=detail)  # fmt: skip

    def _eqn_report(self, where: str, st: ProbedStage, pos: int, k: int, flag: float) -> NonFinite:
        eqn = st.flow.eqns[pos]
        var = eqn.outvars[k]
        return NonFinite(where, _kind(flag), st.flow.index, len(self.stages),
                         equation=self.prov.info(self.index[id(eqn)]),
                         shape=tuple(var.aval.shape), dtype=str(var.aval.dtype))  # fmt: skip

    def _backward_report(self, st: ProbedStage, pos: int, k: int, flag: float) -> NonFinite:
        """The gradient of an output went bad: blame the backward of the equations reading it."""
        eqn = st.flow.eqns[pos]
        var = eqn.outvars[k]
        producer = self.prov.info(self.index[id(eqn)])
        readers = [j for j in self.prov.consumers(var) if j > producer.index and any(
            not is_drop(v) and is_float(v.aval) for v in self.prov.jaxpr.eqns[j].outvars)]
        if not readers:  # a model output: its gradient came from the loss
            return NonFinite("backward", _kind(flag), st.flow.index, len(self.stages),
                             equation=producer, shape=tuple(var.aval.shape),
                             dtype=str(var.aval.dtype),
                             detail="the gradient of this model output from the loss is "
                             "non-finite")  # fmt: skip
        culprit = readers[0]
        others = f" (or of equations {readers[1:]}, which read it too)" if readers[1:] else ""
        return NonFinite(
            "backward", _kind(flag), self._stage_of(culprit), len(self.stages),
            equation=self.prov.info(culprit), shape=tuple(var.aval.shape),
            dtype=str(var.aval.dtype),
            detail=f"it made the gradient of the output of {producer} non-finite{others}",
        )

    def _stage_of(self, k: int) -> int:
        for st in self.plan.stages:
            if st.start <= k < st.stop:
                return st.index
        return len(self.stages) - 1


def _dtype(x) -> str:
    return str(x.dtype) if hasattr(x, "dtype") else str(np.asarray(x).dtype)


def _arg_name(path: str) -> str:
    """``"0/1"`` (args, index 1) → ``"args[1]"``; kwargs by name."""
    parts = path.split("/")
    if parts[0] == "0" and len(parts) > 1:
        return f"args[{parts[1]}]" + "".join(f"[{p}]" for p in parts[2:])
    if parts[0] == "1" and len(parts) > 1:
        return f"kwargs[{parts[1]!r}]" + "".join(f"[{p}]" for p in parts[2:])
    return path
